#!/usr/bin/env bash
# compute-sanitizer's memcheck and racecheck over one pass of every op's GPU tests
# (pytest -m gpu tests/test_<op>.py), all (tool, file) pairs side by side on the one GPU.
# Run from the repository root with the extension built in place. Full logs go to
# $OUT/sanitize (default /tmp/ls_fairseq_sanitize), bundled into $OUT/sanitize.tgz; a table
# per (tool, test file) is printed last: errors found / clean / timed out / tests failed.
#   bash scripts/sanitize.sh
# Settings (environment):
#   SANITIZER  compute-sanitizer to use (default /usr/local/cuda/bin/compute-sanitizer, else PATH's)
#   TOOLS      sanitizer tools (default "memcheck racecheck")
#   FILES      test files (default: the ten op files with GPU tests)
#   JOBS       processes side by side (default 20: every pair at once)
#   TIMEOUT    seconds per (tool, file) before it counts as timed out (default 270)
#   SANITIZE_K a pytest -k expression to run fewer cases (default: every GPU case)
# The caching allocator is turned off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that every tensor is
# an allocation of its own: an access past a tensor's end inside a cached block is invisible to
# memcheck. Exit status 0 only when every pair is clean.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-/tmp/ls_fairseq_sanitize}
LOGS="$OUT/sanitize"
mkdir -p "$LOGS"
SANITIZER=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
if [ ! -x "$SANITIZER" ]; then
  if command -v compute-sanitizer > /dev/null; then
    SANITIZER=$(command -v compute-sanitizer)
  else
    echo "sanitize: compute-sanitizer not found (neither $SANITIZER nor on PATH): nothing checked"
    exit 2
  fi
fi
echo "sanitize: $SANITIZER ($("$SANITIZER" --version | grep -i version | head -1))"
TOOLS=${TOOLS:-memcheck racecheck}
FILES=${FILES:-tests/test_embedding.py tests/test_qkv.py tests/test_softmax.py tests/test_attention.py
  tests/test_bias_dropout_residual.py tests/test_bias_dropout_residual_layer_norm.py tests/test_bias_act_dropout.py
  tests/test_layer_norm.py tests/test_cross_entropy.py tests/test_adam.py}
JOBS=${JOBS:-20}
TIMEOUT=${TIMEOUT:-270}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
export SANITIZER TIMEOUT LOGS SANITIZE_K=${SANITIZE_K:-}

# one (tool, file) pair: the sanitizer's report in $LOGS/<tool>_<name>.sanitizer.log, pytest's
# output in $LOGS/<tool>_<name>.log, the exit status in $LOGS/<tool>_<name>.rc
# shellcheck disable=SC2329  # invoked by xargs through bash -c
one() {
  local tool=$1 file=$2 name
  name="${tool}_$(basename "$file" .py)"
  local k=()
  if [ -n "$SANITIZE_K" ]; then k=(-k "$SANITIZE_K"); fi
  local extra=()
  if [ "$tool" = memcheck ]; then extra=(--leak-check no); fi
  if [ "$tool" = racecheck ]; then extra=(--racecheck-report all); fi
  local t0=$SECONDS
  timeout -k 10 "$TIMEOUT" "$SANITIZER" --tool "$tool" "${extra[@]}" --target-processes all --error-exitcode 86 \
    --log-file "$LOGS/$name.sanitizer.log" \
    python3 -m pytest -v -p no:cacheprovider -m gpu "${k[@]}" "$file" > "$LOGS/$name.log" 2>&1
  echo "$? $((SECONDS - t0))" > "$LOGS/$name.rc"
}
export -f one

t0=$SECONDS
for tool in $TOOLS; do
  for file in $FILES; do
    [ -f "$file" ] || { echo "sanitize: no such test file $file" >&2; exit 2; }
    printf '%s %s\n' "$tool" "$file"
  done
done | xargs -P "$JOBS" -L 1 bash -c 'one "$@"' _
echo "sanitize: $(( SECONDS - t0 ))s wall, $JOBS side by side, ${TIMEOUT}s each at most"

# the table: a sanitizer error count from its summary line ("ERROR SUMMARY: N errors",
# racecheck's "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"), pytest's last line
status=0
printf '%-10s %-44s %-12s %6s %5s  %s\n' tool file result errors secs pytest
for tool in $TOOLS; do
  for file in $FILES; do
    name="${tool}_$(basename "$file" .py)"
    read -r rc secs < "$LOGS/$name.rc"
    slog="$LOGS/$name.sanitizer.log"
    errors=$(grep -ohE "ERROR SUMMARY: [0-9]+ error|\([0-9]+ errors" "$slog" 2>/dev/null | grep -oE "[0-9]+" \
      | awk '{s += $1} END {print s + 0}')
    summary=$(grep -cE "ERROR SUMMARY|RACECHECK SUMMARY" "$slog" 2>/dev/null)
    last=$(grep -E "passed|failed|error|skipped|no tests ran" "$LOGS/$name.log" | tail -1 | tr -s '= ' ' ')
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      result="timed out"
      last="$(grep -cE ' PASSED| FAILED' "$LOGS/$name.log") cases done before the limit"
    elif [ "$errors" -gt 0 ] || [ "$rc" = 86 ]; then
      result="ERRORS"
    elif [ "$rc" != 0 ]; then
      result="tests failed"
    elif [ "${summary:-0}" = 0 ]; then
      result="no summary"
    else
      result="clean"
    fi
    printf '%-10s %-44s %-12s %6s %5s  %s\n' "$tool" "$file" "$result" "$errors" "$secs" "$last"
  done
done | tee "$LOGS/summary.txt"
grep -q -vE "^tool| clean " "$LOGS/summary.txt" && status=1
(cd "$OUT" && tar czf sanitize.tgz sanitize)
exit $status
