#!/usr/bin/env bash
# The GPU check in one go: build the extension in place, print which path each op
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
# four processes side by side on the one GPU: the three fairseq-train tests that take 30-60 s
# each, and everything else (serially ~3 minutes, side by side ~1)
pt() { python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 "$@"; }
pt tests/test_cli.py -k "resume_continues and bf16" > "$OUT/pytest_gpu_resume_bf16.log" 2>&1 &
pt tests/test_cli.py -k "resume_continues and fp16" > "$OUT/pytest_gpu_resume_fp16.log" 2>&1 &
pt tests/test_cli.py -k "not resume_continues" > "$OUT/pytest_gpu_cli.log" 2>&1 &
pt tests --ignore=tests/test_cli.py > "$OUT/pytest_gpu.log" 2>&1 &
tests=0
for job in $(jobs -p); do wait "$job" || tests=1; done
echo "gpu tests rc=$tests in $(( $(date +%s) - t0 ))s"
for log in "$OUT"/pytest_gpu*.log; do
  grep -E "^(FAILED|ERROR)" "$log" | head -20
  echo "$(basename "$log"): $(tail -1 "$log")"
done
status=$tests
for cmd in "$@"; do
  echo "== $cmd"
  bash -c "$cmd" || status=1
done
exit $status
