#!/usr/bin/env bash
# One GPU session for speed: build the extension in place, run the GPU tests,
# time the fused ops (scripts/bench_ops.py), then run the training-speed
# benchmark (recipes/wmt14_en_de/bench.py) with the given arguments for at most
# $BENCH_SECONDS (default 600). Results (also partial ones) and a tarball of the
# training logs go to $OUT.
#   bash scripts/gpu_bench.sh --systems stock-fp16,ls-fp16
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/ls_fairseq_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -f .device-kit/bootstrap.sh ]; then
  # shellcheck disable=SC1091
  source .device-kit/bootstrap.sh > "$OUT/bootstrap.log" 2>&1 || { cat "$OUT/bootstrap.log"; exit 1; }
fi
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/pytest_gpu.log" 2>&1
tail -1 "$OUT/pytest_gpu.log"
python3 scripts/bench_ops.py --dtype fp16 --json "$OUT/bench_ops_fp16.json" 2>/dev/null | tail -12
work=/tmp/ls_bench
timeout "${BENCH_SECONDS:-600}" python3 recipes/wmt14_en_de/bench.py --out "$work" "$@" > "$OUT/bench_stdout.log" 2>&1
status=$?
cp "$work/results.json" "$work/table.md" "$work/speedup.png" "$OUT/" 2>/dev/null
tar czf "$OUT/bench_logs.tgz" -C "$work" runs --exclude data-bin --exclude tensorboard 2>/dev/null
tail -20 "$OUT/bench_stdout.log"
exit $status
