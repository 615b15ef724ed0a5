"""pytest plugin of scripts/device.sh: stop the session cleanly once its time budget is spent.

    PYTHONPATH=scripts/bench:$PYTHONPATH python3 -m pytest -p pytest_budget --budget-s 300 tests ...

After each test, if more than ``--budget-s`` seconds have passed since the session started, no further test is
started (``session.shouldstop``): pytest still prints its summary line (``N passed, ... in Xs``) and exits with
status 2 ("interrupted"), and this plugin adds how many collected tests were not run, per file. The running test
is not stopped: the caller's ``timeout`` stays the backstop for one that hangs.
"""

from __future__ import annotations

import time
from collections import Counter

_state = {"start": None, "budget": 0.0, "session": None, "collected": [], "ran": set(), "stopped": False}


def pytest_addoption(parser):
    parser.addoption("--budget-s", type=float, default=0.0,
                     help="stop starting tests once this many seconds have passed (0: no budget)")


def pytest_sessionstart(session):
    _state.update(start=time.monotonic(), budget=session.config.getoption("budget_s") or 0.0, session=session)


def pytest_collection_finish(session):
    _state["collected"] = [item.nodeid for item in session.items]


def pytest_runtest_logfinish(nodeid, location):
    _state["ran"].add(nodeid)
    budget, session = _state["budget"], _state["session"]
    if budget > 0 and session is not None and time.monotonic() - _state["start"] > budget:
        left = len(_state["collected"]) - len(_state["ran"])
        if left > 0 and not _state["stopped"]:
            _state["stopped"] = True
            session.shouldstop = f"time budget of {budget:.0f} s spent, {left} tests not run"


def pytest_terminal_summary(terminalreporter):
    if not _state["stopped"]:
        return
    not_run = Counter(n.split("::")[0] for n in _state["collected"] if n not in _state["ran"])
    terminalreporter.write_line(
        f"pytest_budget: {len(_state['ran'])} of {len(_state['collected'])} tests run in the "
        f"{_state['budget']:.0f} s budget; not run: " + ", ".join(f"{f} {c}" for f, c in not_run.items()))
