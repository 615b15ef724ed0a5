"""``glmasr serve`` with every prompt's token budget forced to ceil(3 x its seconds), for load benchmarks on random
weights.

    python -m scripts.bench.forced_serve [--tokens-per-s 3 | --tokens N] SERVE-ARGS...

A random-weight model almost never emits EOS, so each prompt decodes its whole default budget
(``pipeline.default_max_new_tokens``: 32 + 6 per second of audio), several times what speech gives (GLM-ASR
writes ~3 tokens per second of English speech). The offline benchmarks force ~3 tokens per second
(``segments_cost.forced_budgets``); this does the same for a server process, live finals and drafts included, so
that a load test on random weights decodes what real speech would; ``--tokens N`` forces exactly N per prompt
(issue 13's mixed workload: 40). ``GLMASR_BENCH_STEP_LOG=PREFIX`` also logs every engine step of the engine
process(es) to ``PREFIX<pid>.jsonl`` (``_install_step_log``), ``GLMASR_BENCH_FINALS_LOG=PREFIX`` the path of every
live final through the front-ends (``_install_finals_log``). Nothing of the product changes: the budget function
of ``glmasr.pipeline`` is replaced in this process before ``glmasr.cli.serve.main`` runs, and in the processes the
server spawns
(``--frontends``, ``--data-parallel``: spawn re-imports this module as their ``__main__``, and the setting
travels in the environment).
"""

from __future__ import annotations

import os
import sys

_FIXED, _RATE = "GLMASR_BENCH_FORCED_TOKENS", "GLMASR_BENCH_FORCED_TOKENS_PER_S"


def _apply_from_env() -> None:
    fixed, rate = os.environ.get(_FIXED), os.environ.get(_RATE)
    if fixed is None and rate is None:
        return
    from glmasr import pipeline

    from .segments_cost import forced_budgets

    if fixed is not None:
        n = int(fixed)
        pipeline.default_max_new_tokens = lambda seconds: n
    else:
        forced_budgets(float(rate))  # for the life of this process


_STEP_LOG = "GLMASR_BENCH_STEP_LOG"


def _write_every_second(rows: list, lock, path: str, name: str) -> None:
    """A daemon thread that appends ``rows`` (taken under ``lock``) to ``path`` as JSON lines every second."""
    import json
    import threading
    import time

    def writer():
        while True:
            time.sleep(1.0)
            with lock:
                batch = rows[:]
                rows.clear()
            if batch:
                with open(path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in batch)

    threading.Thread(target=writer, name=name, daemon=True).start()


def _install_step_log(prefix: str) -> None:
    """Every engine step of this process as one JSON line in ``PREFIX<pid>.jsonl`` (written each second): its
    host start and end, the sequences waiting / ready / running at its start, the windows it encoded, the
    prompts it admitted, its decode steps, and the requests added since the previous step (their count): the
    timeline behind the stage means of ``realtime_load``."""
    import threading
    import time

    from glmasr.engine.engine import Engine
    from glmasr.engine.model_runner import ModelRunner

    rows, lock = [], threading.Lock()
    cur: dict = {}
    added = [0]
    step, add = Engine.step, Engine.add_request
    encode, prefill, decode = ModelRunner.encode, ModelRunner.prefill, ModelRunner.decode

    def logged_step(self):
        sched = self.scheduler
        cur.clear()
        cur.update(t0=time.perf_counter(), waiting=len(sched.waiting), ready=len(sched.ready),
                   running=sched.num_running, added=added[0], windows=0, admitted=0, steps=0)
        added[0] = 0
        try:
            return step(self)
        finally:
            cur["t1"] = time.perf_counter()
            with lock:
                rows.append(dict(cur))

    def logged_add(self, *a, **k):
        added[0] += 1
        return add(self, *a, **k)

    def logged_encode(self, plans):
        cur["windows"] = cur.get("windows", 0) + sum(p.num_windows for p in plans)
        return encode(self, plans)

    def logged_prefill(self, slots, *a, **k):
        cur["admitted"] = cur.get("admitted", 0) + len(slots)
        return prefill(self, slots, *a, **k)

    def logged_decode(self, b, top, steps):
        cur["steps"] = cur.get("steps", 0) + steps
        return decode(self, b, top, steps)

    Engine.step, Engine.add_request = logged_step, logged_add
    ModelRunner.encode, ModelRunner.prefill, ModelRunner.decode = logged_encode, logged_prefill, logged_decode
    _write_every_second(rows, lock, f"{prefix}{os.getpid()}.jsonl", "step-log")


_FINALS_LOG = "GLMASR_BENCH_FINALS_LOG"


def _install_finals_log(prefix: str) -> None:
    """Every live final of this process (a front-end) as one JSON line in ``PREFIX<pid>.jsonl``: when its turn
    was committed (its task entered), when the final before it in its session had ended, when the engine
    client's ``submit`` ran (in the executor), when the engine accepted it and when the session had its last
    delta; all ``time.perf_counter()``, comparable with the engine's step log on one machine."""
    import asyncio
    import threading
    import time

    from glmasr.live.session import LiveSession
    from glmasr.workers.attached import AttachedEngineClient

    marks: dict = {}
    rows, lock = [], threading.Lock()
    run_final, submit_session, submit_client = LiveSession._run_final, LiveSession._submit, AttachedEngineClient.submit
    commit = LiveSession._commit

    def logged_commit(self, item, end):
        marks.setdefault(item.item_id, {})["commit"] = time.perf_counter()
        return commit(self, item, end)

    async def logged_run_final(self, item, samples, before):
        m = marks.setdefault(item.item_id, {})
        m["task_start"] = time.perf_counter()
        if before is not None:
            await asyncio.wait([before])
        m["previous_done"] = time.perf_counter()
        try:
            return await run_final(self, item, samples, None)
        finally:
            m["done"] = time.perf_counter()
            with lock:
                rows.append(marks.pop(item.item_id, m))

    async def logged_submit(self, samples, decode, priority, stream, item_id):
        m = marks.setdefault(item_id, {})
        m.setdefault("submit", time.perf_counter())
        req = await submit_session(self, samples, decode, priority, stream, item_id)
        m.setdefault("accepted", time.perf_counter())
        return req

    def logged_client_submit(self, audio, *a, **k):
        item = audio.source.rsplit(" ", 1)[-1]
        marks.setdefault(item, {}).setdefault("client_submit", time.perf_counter())
        return submit_client(self, audio, *a, **k)

    LiveSession._commit, LiveSession._run_final, LiveSession._submit = logged_commit, logged_run_final, logged_submit
    AttachedEngineClient.submit = logged_client_submit
    _write_every_second(rows, lock, f"{prefix}{os.getpid()}.jsonl", "finals-log")


_apply_from_env()  # in a process the server spawned, before it plans anything
if os.environ.get(_STEP_LOG):
    _install_step_log(os.environ[_STEP_LOG])
if os.environ.get(_FINALS_LOG):
    _install_finals_log(os.environ[_FINALS_LOG])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--tokens-per-s"]:
        os.environ[_RATE], argv = argv[1], argv[2:]
    elif argv[:1] == ["--tokens"]:
        os.environ[_FIXED], argv = argv[1], argv[2:]
    else:
        os.environ[_RATE] = "3"
    _apply_from_env()
    from glmasr.cli.serve import main as serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
