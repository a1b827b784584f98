#!/usr/bin/env bash
# One GPU session: build the extension in place, print which path each op
# takes, run the GPU tests, then any benchmark commands given as arguments.
# Full logs go to $OUT (default /tmp/ls_fairseq_gpu), bundled into $OUT/logs.tgz at the
# end (the device tool returns only a few files); a summary is printed last.
#   bash scripts/gpu_check.sh "python3 scripts/bench_ops.py --dtype fp16"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/ls_fairseq_gpu}
mkdir -p "$OUT"
# the device tool brings back only a handful of files: everything under $OUT goes into one
# archive, also when the call's time limit stops a command (TERM) before the end
# shellcheck disable=SC2329  # invoked by the EXIT trap
pack() { (cd "$OUT" && tar czf logs.tgz --exclude logs.tgz --exclude data-bin -- * && find . -type f ! -name logs.tgz -delete); }
trap pack EXIT
trap 'exit 143' TERM
export PYTHONUNBUFFERED=1
if [ -f .device-kit/bootstrap.sh ]; then
  # shellcheck disable=SC1091
  source .device-kit/bootstrap.sh > "$OUT/bootstrap.log" 2>&1 || { cat "$OUT/bootstrap.log"; exit 1; }
fi
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
build=$?
echo "build rc=$build in $(( $(date +%s) - t0 ))s"
if [ $build != 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m ls_fairseq.info 2>&1 | grep -v tensorboardX | tee "$OUT/info.log"
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/pytest_gpu.log" 2>&1
tests=$?
echo "gpu tests rc=$tests in $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -40
status=$tests
for cmd in "$@"; do
  echo "== $cmd"
  bash -c "$cmd" || status=1
done
tail -1 "$OUT/pytest_gpu.log"
exit $status
