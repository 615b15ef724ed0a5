"""``workers.pool.send_loop``: the thread that feeds one engine process (the data-parallel pool's worker pipes and
the front-ends' engine sockets both use it), on a real ``multiprocessing`` pipe.

A message that cannot be pickled must fail only its own job (a ``submit``: through ``unsendable`` with the
pickling error's type and text), the messages after it must still arrive in order, and the loop must end
quietly on None or when the other end is gone. The two callers' ``unsendable`` hooks are checked too: the
pool turns it into the job's ``rejected`` + ``end`` messages, the front-end link into the request's.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading

from glmasr.workers.pool import send_loop


def _run(messages, conn):
    q = queue.SimpleQueue()
    for m in messages:
        q.put(m)
    failed = []
    t = threading.Thread(target=send_loop, args=(q, conn, lambda job, err: failed.append((job, err))), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "send_loop did not return"
    return failed


def _received(conn):
    out = []
    while conn.poll(0.5):
        out.append(conn.recv())
    return out


def test_messages_arrive_in_order_and_none_ends_the_loop():
    recv, send = mp.Pipe(duplex=False)
    msgs = [("submit", 1, b"audio"), ("cancel", 1), ("submit", 2, {"k": [1, 2]})]
    assert _run(msgs + [None, ("submit", 3, b"after the end")], send) == []
    assert _received(recv) == msgs


def test_an_unpicklable_submit_fails_alone():
    recv, send = mp.Pipe(duplex=False)

    def local_callback():  # a local function: pickle refuses it
        return 0

    msgs = [("submit", 7, local_callback), ("submit", 8, b"fine"), ("cancel", 9, lambda: 1), ("submit", 10, b"x"),
            None]
    failed = _run(msgs, send)
    assert [job for job, _ in failed] == [7], "only the unpicklable submit fails; a bad non-submit is dropped"
    err = failed[0][1]
    assert err.split(":")[0] in ("PicklingError", "AttributeError", "TypeError") and "local" in err, err
    assert _received(recv) == [("submit", 8, b"fine"), ("submit", 10, b"x")]


def test_the_loop_ends_when_the_other_end_is_gone():
    recv, send = mp.Pipe(duplex=False)
    recv.close()
    assert _run([("submit", 1, b"a" * 100_000), ("submit", 2, b"b")], send) == []  # returns, fails nothing


def test_the_pool_turns_an_unsendable_submit_into_the_jobs_rejection():
    """WorkerPool._send_loop's hook: the job gets ``rejected`` (error, the pickling message) then ``end``."""
    from glmasr.workers.pool import WorkerPool

    pool = WorkerPool.__new__(WorkerPool)  # only the hook's two attributes: no processes
    pool._cv = threading.Condition()
    seen = []
    pool._message = lambda w, msg: seen.append((w, msg))
    recv, send = mp.Pipe(duplex=False)
    q = queue.SimpleQueue()
    q.put(("submit", 5, lambda: 0))
    q.put(None)
    pool._send_loop("worker-0", q, send)
    assert [m for _, m in seen] == [("rejected", 5, "error", seen[0][1][3]), ("end", 5)]
    assert all(w == "worker-0" for w, _ in seen) and "pickle" in seen[0][1][3].lower()


def test_the_frontend_link_rejects_the_request_it_held():
    """AttachedEngineClient._send_loop's hook: the held request gets ``rejected`` then ``end`` and is released."""
    from glmasr.workers.attached import AttachedEngineClient

    class Req:
        def __init__(self):
            self.got = []

        def _deliver(self, msg):
            self.got.append(msg)

    class Link:
        held = {}

    client = AttachedEngineClient.__new__(AttachedEngineClient)
    client._cv = threading.Condition()
    link, req, other = Link(), Req(), Req()
    link.held = {3: req, 4: other}
    recv, send = mp.Pipe(duplex=False)
    q = queue.SimpleQueue()
    q.put(("submit", 3, lambda: 0))
    q.put(None)
    client._send_loop(link, q, send)
    assert req.got[0][:2] == ("rejected", "error") and "pickle" in req.got[0][2].lower() and req.got[1] == ("end",)
    assert link.held == {4: other} and other.got == []
