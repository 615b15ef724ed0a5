"""Sample a running server's processes with py-spy for a while and summarize where each spends its time.

    python -m scripts.bench.profile_tree PID [--seconds 15] [--rate 50] [--out DIR] [--json FILE]

``PID`` is the root (e.g. the ``glmasr serve`` process a benchmark started); every Python process below it
(engine processes, front-ends) is sampled at once, one ``py-spy record --nonblocking`` each (active threads only),
its raw stacks kept under ``--out`` as ``pyspy_<pid>.txt``. The summary per process: its command line, the samples
per thread (a thread busy the whole time has ``seconds x rate``), the functions most often on top of the stack
(self time; also per thread for its three busiest threads) and the ones most often anywhere on it (inclusive).
``--idle``: blocked threads are sampled too, so the self time shows where each waits. Used by ``realtime_load
--profile-s``; needs py-spy (``pip install py-spy``; on the device it travels in ``.whl/``) and the right to trace
the processes (same user, ptrace allowed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
        children[ppid].append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def is_python(pid: int) -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        return False


def summarize(raw: str, top: int = 12) -> dict:
    """py-spy's raw (collapsed) stacks -> samples per thread, top self and inclusive functions."""
    threads, self_, incl = collections.Counter(), collections.Counter(), collections.Counter()
    thread_self: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        thread = None
        if frames[0].startswith("thread"):
            thread = frames[0]
            threads[thread] += n
            frames = frames[1:] or frames
        names = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f for f in frames]  # no line
        self_[names[-1]] += n
        if thread is not None:
            thread_self[thread][names[-1]] += n
        for name in set(names):
            incl[name] += n
    return {"samples": total, "threads": dict(threads.most_common(8)),
            "self": self_.most_common(top), "inclusive": incl.most_common(top),
            "thread_self": {t: thread_self[t].most_common(top) for t, _ in threads.most_common(3)}}


def profile_tree(root: int, seconds: float = 15.0, rate: int = 50, out_dir: Path | None = None,
                 pyspy: str | None = None, idle: bool = False) -> dict:
    """Sample every Python process under ``root`` for ``seconds``; returns {"processes": [...]} or {"error": ...}.
    ``idle``: blocked threads' samples too (py-spy --idle: where a thread waits, for the GIL, a lock, a sync)."""
    exe = pyspy or shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy not found (pip install py-spy)"}
    out_dir = Path(out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    pids = [p for p in descendants(root) if is_python(p)]
    procs = {}
    for pid in pids:
        path = out_dir / f"pyspy_{pid}.txt"
        cmd = [exe, "record", "--nonblocking", "--threads", "-r", str(rate), "-d", str(max(1, round(seconds))),
               "-f", "raw", "-o", str(path), "-p", str(pid)] + (["--idle"] if idle else [])
        procs[pid] = (path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    report = []
    deadline = time.monotonic() + seconds + 30
    for pid, (path, proc) in procs.items():
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        entry = {"pid": pid, "cmdline": _cmdline(pid)[:200], "seconds": seconds, "rate": rate}
        if path.exists():
            entry.update(summarize(path.read_text()))
        else:
            entry["error"] = (err or b"").decode(errors="replace").strip()[-300:]
        report.append(entry)
    return {"root": root, "processes": report}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pid", type=int)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rate", type=int, default=50)
    p.add_argument("--idle", action="store_true", help="blocked threads' samples too (where they wait)")
    p.add_argument("--out", default=".")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    report = profile_tree(args.pid, args.seconds, args.rate, Path(args.out), idle=args.idle)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
