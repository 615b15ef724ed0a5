"""``glmasr serve`` with every prompt's token budget forced to ceil(3 x its seconds), for load benchmarks on random
weights.

    python -m scripts.bench.forced_serve [--tokens-per-s 3 | --tokens N] SERVE-ARGS...

A random-weight model almost never emits EOS, so each prompt decodes its whole default budget
(``pipeline.default_max_new_tokens``: 32 + 6 per second of audio), several times what speech gives (GLM-ASR
writes ~3 tokens per second of English speech). The offline benchmarks force ~3 tokens per second
(``segments_cost.forced_budgets``); this does the same for a server process, live finals and drafts included, so
that a load test on random weights decodes what real speech would; ``--tokens N`` forces exactly N per prompt
(issue 13's mixed workload: 40). Nothing of the product changes: the budget function of ``glmasr.pipeline`` is
replaced in this process before ``glmasr.cli.serve.main`` runs, and in the processes the server spawns
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


_apply_from_env()  # in a process the server spawned, before it plans anything


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
