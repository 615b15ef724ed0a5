"""The benchmark and its helpers, as a package: run them from the checkout root as modules
(``python -m scripts.benchmark``, ``python -m scripts.bench.gpu_check``, ...), so they import each other and
``glmasr`` without sys.path patches. benchmark.sh and scripts/device.sh do that."""
