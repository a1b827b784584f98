#!/usr/bin/env bash
# Train transformer-big on WMT14 en-de with the scaling_nmt hyper-parameters
# (shared embeddings, Adam (0.9, 0.98), lr 5e-4 inverse_sqrt with 4,000
# warm-up updates, label smoothing 0.1, dropout 0.3), with the ls_fairseq plugin
# (or stock fairseq with --baseline), log to TensorBoard, average the last 5
# epoch checkpoints, translate newstest2014 (beam 4, lenpen 0.6) and print
# sacrebleu's BLEU.
#
#   bash train.sh [--baseline] [--work DIR] [--save DIR] [--max-tokens N] [-- extra fairseq-train options]
#
# WORK is prepare.sh's folder (data-bin, raw/test.de). The plugin trains
# through ls-fairseq-train (fairseq-train with ls_adam's mixed-precision step
# decided on the device). On GPUs: --fp16 (fp32 master weights: the plugin's
# in ls_adam, stock's in FP16Optimizer), --max-tokens 8192 per GPU and
# --update-freq ceil(16 / GPUs) (about 130k tokens per update whatever the GPU
# count; fairseq-train uses every visible GPU); with several GPUs
# --grouped-shuffling for both systems (the GPUs of an update take neighbouring
# batches of fairseq's length-sorted list, so none waits long for another at
# the all-reduce; --update-epoch-batch-itr False keeps one batch iterator and
# its data loader's workers for the whole run, as with one GPU) and the plugin
# adds --ddp-backend legacy_ddp (one all-reduce over ls_adam's gradient
# workspace per update); without a GPU: fp32 on the CPU.
set -euo pipefail
WORK=${WORK:-data/wmt14_en_de}
SAVE=""
BASELINE=0
MAX_TOKENS=8192
while [ $# -gt 0 ]; do
  case "$1" in
    --baseline) BASELINE=1; shift ;;
    --work) WORK=$2; shift 2 ;;
    --save) SAVE=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
SAVE=${SAVE:-$WORK/checkpoints-$([ $BASELINE = 1 ] && echo baseline || echo ls)}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -gt 0 ]; then
  DEVICE=(--update-freq $(( (16 + GPUS - 1) / GPUS )))
  DEVICE+=(--fp16)
  [ "$GPUS" -gt 1 ] && DEVICE+=(--grouped-shuffling --update-epoch-batch-itr False)
  GEN_DEVICE=(--fp16)
else
  DEVICE=(--cpu)
  GEN_DEVICE=(--cpu)
fi
if [ $BASELINE = 1 ]; then
  MODEL=(--arch transformer_vaswani_wmt_en_de_big --criterion label_smoothed_cross_entropy --optimizer adam)
  PLUGIN=()
  TRAIN=(fairseq-train)
else
  MODEL=(--arch ls_transformer_vaswani_wmt_en_de_big --criterion ls_label_smoothed_cross_entropy --optimizer ls_adam)
  [ "$GPUS" -gt 1 ] && MODEL+=(--ddp-backend legacy_ddp)
  PLUGIN=(--user-dir "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/ls_fairseq/fairseq_plugin")
  TRAIN=("$PY" -m ls_fairseq.train)
fi
mkdir -p "$SAVE"
"${TRAIN[@]}" "$WORK/data-bin" "${PLUGIN[@]}" "${MODEL[@]}" "${DEVICE[@]}" \
  --share-all-embeddings --adam-betas '(0.9,0.98)' --clip-norm 0.0 --lr 5e-4 --lr-scheduler inverse_sqrt \
  --warmup-updates 4000 --dropout 0.3 --weight-decay 0.0 --label-smoothing 0.1 --max-tokens "$MAX_TOKENS" \
  --save-dir "$SAVE" --tensorboard-logdir "$SAVE/tensorboard" --log-format simple --log-interval 100 \
  "$@" 2>&1 | tee "$SAVE/train.log"

mapfile -t LAST < <(find "$SAVE" -maxdepth 1 -name 'checkpoint[0-9]*.pt' | sort -V | tail -n 5)
[ ${#LAST[@]} -gt 0 ] || LAST=("$SAVE/checkpoint_last.pt")
$PY -m ls_fairseq.average_checkpoints "$SAVE/averaged.pt" "${LAST[@]}"
fairseq-generate "$WORK/data-bin" "${PLUGIN[@]}" "${GEN_DEVICE[@]}" --path "$SAVE/averaged.pt" --gen-subset test \
  --beam 4 --lenpen 0.6 --batch-size 128 --remove-bpe sentencepiece > "$SAVE/generate.log" 2>&1 \
  || { tail -20 "$SAVE/generate.log" >&2; exit 1; }
grep '^H-' "$SAVE/generate.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$SAVE/test.hyp"
echo "train.sh: BLEU on $(wc -l < "$SAVE/test.hyp") test sentences (averaged ${#LAST[@]} checkpoints):"
sacrebleu "$WORK/raw/test.de" -i "$SAVE/test.hyp" -m bleu -b -w 2 | sed 's/^/BLEU = /'
