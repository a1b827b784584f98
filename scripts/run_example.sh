#!/usr/bin/env bash
# The main job on the embedded corpus (LibreOffice help, en->de), from a fresh
# machine: set up .venv, prepare the data, train ls_transformer with the ls
# criterion and ls_adam through fairseq-train --user-dir (GPU when there is
# one, CPU otherwise), log to TensorBoard, translate the 1,200-sentence test
# set with fairseq-generate and score it with sacrebleu.
#
#   bash scripts/run_example.sh            # results under runs/example/
#   MINUTES=10 bash scripts/run_example.sh # train for longer (default: 5 on CPU, 15 on GPU)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source .venv/bin/activate
OUT=${OUT_DIR:-runs/example}
WORK=$OUT/data
if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  VOCAB=8000
  MINUTES=${MINUTES:-15}
  MODEL=(--arch ls_transformer_wmt_en_de --fp16 --max-tokens 8192 --dropout 0.3)
  DEVICE=(--fp16)
else
  VOCAB=2000  # a small output layer: on CPU it dominates the step
  MINUTES=${MINUTES:-5}
  MODEL=(--arch ls_transformer_tiny --max-tokens 4096 --dropout 0.1 --cpu --num-workers 0)
  DEVICE=(--cpu)
fi
WORK=$WORK-$VOCAB
bash recipes/wmt14_en_de/prepare.sh --from data/lohelp --work "$WORK" --vocab-size "$VOCAB" --ratio 2.5
echo "run_example: training ${MODEL[1]} for $MINUTES minutes"
fairseq-train "$WORK/data-bin" --user-dir ls_fairseq "${MODEL[@]}" \
  --share-all-embeddings --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 \
  --optimizer ls_adam --adam-betas '(0.9,0.98)' --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 200 \
  --clip-norm 1.0 --stop-time-hours "$(python -c "print($MINUTES / 60)")" --max-epoch 100 \
  --save-dir "$OUT/checkpoints" --no-epoch-checkpoints --tensorboard-logdir "$OUT/tensorboard" \
  --log-format simple --log-interval 50 --seed 1 2>&1 | tee "$OUT/train.log" | grep -E "train_inner|valid on|done training"

fairseq-generate "$WORK/data-bin" --user-dir ls_fairseq --path "$OUT/checkpoints/checkpoint_last.pt" \
  --gen-subset test --beam 4 --lenpen 0.6 --batch-size 128 --remove-bpe sentencepiece \
  "${DEVICE[@]}" > "$OUT/generate.log" 2>&1 || { tail -20 "$OUT/generate.log"; exit 1; }
grep '^H-' "$OUT/generate.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$OUT/test.hyp"
echo "run_example: test BLEU (sacrebleu, $(wc -l < "$OUT/test.hyp") sentences):"
sacrebleu "$WORK/raw/test.de" -i "$OUT/test.hyp" -m bleu -b -w 2 | sed 's/^/BLEU = /'
