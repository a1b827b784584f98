#!/usr/bin/env bash
# Train a language model with the ls_fairseq plugin (or stock fairseq with --baseline) on
# prepare.sh's data, then fairseq-eval-lm's perplexity on the test split.
#
#   bash train.sh [--baseline] [--work DIR] [--save DIR] [--arch NAME] [-- extra fairseq-train options]
#
# Defaults: the CPU corpus's size (prepare.sh --lohelp): ls_transformer_lm_gpt2_tiny (transformer_lm_gpt2_tiny
# with --baseline), 128 tokens per sample with --sample-break-mode none (no padding), Adam lr 1e-3
# inverse_sqrt with 100 warm-up updates, 300 updates, dropout 0.1, label smoothing 0 (the plugin's
# criterion; stock's cross-entropy with --baseline). On a GPU pass e.g. -- --bf16 (ls-fairseq-train keeps
# it off fairseq's TPU path) and a larger --arch (ls_transformer_lm_gpt) with --tokens-per-sample 1024.
set -euo pipefail
WORK=${WORK:-data/lm_lohelp}
SAVE=""
BASELINE=0
ARCH=transformer_lm_gpt2_tiny
while [ $# -gt 0 ]; do
  case "$1" in
    --baseline) BASELINE=1; shift ;;
    --work) WORK=$2; shift 2 ;;
    --save) SAVE=$2; shift 2 ;;
    --arch) ARCH=${2#ls_}; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
USER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/ls_fairseq
SAVE=${SAVE:-$WORK/checkpoints-$([ $BASELINE = 1 ] && echo baseline || echo ls)}
DEVICE=()
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=(--cpu); fi
COMMON=(--task language_modeling --tokens-per-sample 128 --sample-break-mode none --max-tokens 2048
        --adam-betas "(0.9,0.98)" --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 100 --max-update 300
        --dropout 0.1 --seed 1 --save-dir "$SAVE" --log-format simple --log-interval 50 --no-epoch-checkpoints
        "${DEVICE[@]}")
if [ "$BASELINE" = 1 ]; then
  "$PY" -m fairseq_cli.train "$WORK/data-bin" --arch "$ARCH" --criterion cross_entropy --optimizer adam \
    "${COMMON[@]}" "$@"
else
  "$PY" -m ls_fairseq.train "$WORK/data-bin" --arch "ls_$ARCH" --criterion ls_label_smoothed_cross_entropy \
    --label-smoothing 0 --optimizer ls_adam "${COMMON[@]}" "$@"
fi
# with the plugin either way: stock fairseq cannot load its own checkpoints on torch >= 2.6 (weights_only)
"$PY" -m fairseq_cli.eval_lm "$WORK/data-bin" --path "$SAVE/checkpoint_best.pt" --task language_modeling \
  --tokens-per-sample 128 --sample-break-mode none --gen-subset test --max-tokens 2048 --user-dir "$USER_DIR" \
  "${DEVICE[@]}"
