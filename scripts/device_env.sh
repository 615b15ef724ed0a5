# Sourced by scripts/device.sh (device tool, carry [".whl"]; also by benchmark.sh where .whl/ exists and
# nvidia-mathdx is not importable): installs the carried wheels
# (nvidia-mathdx, nvidia-cuda-cccl, soundfile, soxr, ...) and sets the environment and $OUT. The checkout is
# not pip-installed there: glmasr imports from $PWD, and kernels/ is linked in as its import name glmasr_kernels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ln -sfn "$PWD/kernels" /tmp/site/glmasr_kernels
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 GLMASR_CACHE_DIR=${GLMASR_CACHE_DIR:-/tmp/glmasr_cubins}
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
