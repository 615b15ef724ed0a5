"""``glmasr serve`` with every prompt's token budget forced to ceil(3 x its seconds), for load benchmarks on random
weights.

    python -m scripts.bench.forced_serve [--tokens-per-s 3] SERVE-ARGS...

A random-weight model almost never emits EOS, so each prompt decodes its whole default budget
(``pipeline.default_max_new_tokens``: 32 + 6 per second of audio), several times what speech gives (GLM-ASR
writes ~3 tokens per second of English speech). The offline benchmarks force ~3 tokens per second
(``segments_cost.forced_budgets``); this does the same for a server process, live finals and drafts included, so
that a load test on random weights decodes what real speech would. Nothing of the product changes: the budget
function of ``glmasr.pipeline`` is replaced in this process (``segments_cost.forced_budgets``) before
``glmasr.cli.serve.main`` runs.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    rate = 3.0
    if argv[:1] == ["--tokens-per-s"]:
        rate, argv = float(argv[1]), argv[2:]
    from glmasr.cli.serve import main as serve

    from .segments_cost import forced_budgets

    forced_budgets(rate)  # for the life of this process
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
