#!/usr/bin/env bash
# compute-sanitizer's racecheck and synccheck on LayerNorm's backward strip kernel with SPLIT = 2
# (a row split over a pair of warps that meet at a named barrier of 64 threads), in a standalone
# program (scripts/racecheck_strip/probe.cu), for three builds of layer_norm.cu (variant.py: as it
# is, the fold in its own buffer, a __syncthreads per row). racecheck runs RUNS times a build: its
# reports on this kernel changed from run to run of the same binary. Needs a GPU; ~2 minutes.
#   bash scripts/racecheck_strip.sh OUT [RUNS]   -> OUT/summary.txt and one log per run
set -euo pipefail
out=$1
runs=${2:-3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
csrc=$here/../ls_fairseq/csrc
mkdir -p "$out"
for v in asis ownfold rowsync; do
  mkdir -p "$out/$v"
  python3 "$here/racecheck_strip/variant.py" "$v" "$csrc/layer_norm.cu" > "$out/$v/layer_norm_probe.cu"
  nvcc -O3 -std=c++20 -lineinfo --expt-relaxed-constexpr -arch=sm_90 -I"$csrc" -I"$out/$v" -o "$out/$v/probe" \
    "$here/racecheck_strip/probe.cu" "$csrc/bias_dropout_residual.cu" > "$out/$v/build.log" 2>&1 &
done
wait
: > "$out/summary.txt"
for v in asis ownfold rowsync; do
  compute-sanitizer --tool synccheck "$out/$v/probe" > "$out/$v/synccheck.log" 2>&1 || true
  echo "$v synccheck: $(grep -E 'ERROR SUMMARY' "$out/$v/synccheck.log" || echo 'no summary')" >> "$out/summary.txt"
  for run in $(seq 1 "$runs"); do
    compute-sanitizer --tool racecheck --racecheck-report hazard "$out/$v/probe" > "$out/$v/racecheck$run.log" 2>&1 || true
    echo "$v racecheck run $run: $(grep -E 'RACECHECK SUMMARY' "$out/$v/racecheck$run.log" || echo 'no summary')" \
      >> "$out/summary.txt"
  done
done
cat "$out/summary.txt"
