#!/usr/bin/env bash
# The main job on the embedded corpus (LibreOffice help, en->de), from a fresh
# machine: set up .venv, prepare the data, train ls_transformer with the ls
# criterion and ls_adam through fairseq-train --user-dir (GPU when there is
# one, CPU otherwise) for a fixed number of updates, log to TensorBoard,
# translate the 1,200-sentence test set with fairseq-generate and score it
# with sacrebleu. At the end it prints where everything is and the command
# that translates your own sentences.
#
#   bash scripts/run_example.sh             # a new run under runs/example/ (the last one's checkpoints are removed)
#   RESUME=1 bash scripts/run_example.sh    # go on from the last run's checkpoint_last.pt up to UPDATES
#   UPDATES=N bash scripts/run_example.sh   # train N updates instead of the default below
#   OUT_DIR=DIR bash scripts/run_example.sh # results under DIR instead of runs/example
#   LS_FAIRSEQ_VENV=DIR ...                 # the environment in DIR instead of .venv (scripts/setup_env.sh)
set -euo pipefail
if [ -n "${MINUTES:-}" ]; then
  echo "run_example: MINUTES is not read any more: the job trains a fixed number of updates (UPDATES=N)" >&2
  exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
VENV=$(realpath "${LS_FAIRSEQ_VENV:-.venv}")
# shellcheck disable=SC1091
source "$VENV/bin/activate"
ROOT=$PWD
OUT=$(realpath -m "${OUT_DIR:-runs/example}")
if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  WHERE="a GPU"
  VOCAB=8000
  DEFAULT_UPDATES=4000
  EXPECT="17.6 on one H200, after about 6 minutes of training"
  WHAT="ls_transformer_wmt_en_de (512 wide, 6+6 layers) in fp16"
  MODEL=(--arch ls_transformer_wmt_en_de --max-tokens 8192 --dropout 0.3 --lr 1e-3 --warmup-updates 1000)
  DEVICE=(--fp16)
else
  WHERE="the CPU"
  VOCAB=2000  # a small output layer: on CPU it dominates the step
  # Chosen from a learning curve measured on a 2-core CPU (docs/perf-log.md, "The main job's
  # model and length on CPU"): the best BLEU that ~10 minutes of training reached there.
  DEFAULT_UPDATES=1200
  EXPECT="14.7-15.3 on a 2-core CPU, after 5-10.5 minutes of training"
  WHAT="ls_transformer 128 wide (FFN 256), 2+2 layers, 4 heads (0.92M parameters)"
  MODEL=(--arch ls_transformer --encoder-embed-dim 128 --encoder-ffn-embed-dim 256 --encoder-layers 2
         --decoder-layers 2 --encoder-attention-heads 4 --decoder-attention-heads 4
         --max-tokens 4096 --dropout 0.1 --lr 4e-3 --warmup-updates 200)
  DEVICE=(--cpu --num-workers 0)
fi
UPDATES=${UPDATES:-$DEFAULT_UPDATES}
if ! [[ $UPDATES =~ ^[1-9][0-9]*$ ]]; then
  echo "run_example: UPDATES must be a positive whole number of updates, not '$UPDATES'" >&2
  exit 2
fi
WORK=$OUT/data-$VOCAB
CKPT=$OUT/checkpoints
mkdir -p "$OUT"
job_start=$SECONDS
bash recipes/wmt14_en_de/prepare.sh --from data/lohelp --work "$WORK" --vocab-size "$VOCAB" --ratio 2.5

DONE=0
if [ "${RESUME:-0}" = 1 ] && [ -f "$CKPT/checkpoint_last.pt" ]; then
  DONE=$(python -c 'import sys, ls_fairseq; from fairseq import checkpoint_utils
print(checkpoint_utils.load_checkpoint_to_cpu(sys.argv[1])["optimizer_history"][-1]["num_updates"])' "$CKPT/checkpoint_last.pt")
  echo "run_example: RESUME=1: going on from $CKPT/checkpoint_last.pt (update $DONE)"
else
  # A new run: fairseq-train would otherwise resume silently from the last run's checkpoint.
  [ "${RESUME:-0}" = 1 ] && echo "run_example: RESUME=1, but $CKPT holds no checkpoint_last.pt: a new run"
  rm -rf "$CKPT" "$OUT/tensorboard" "$OUT/train.log"
fi
echo "run_example: training $WHAT on $WHERE for $UPDATES updates (test BLEU at the default $DEFAULT_UPDATES updates: $EXPECT)"
progress() {  # fairseq's log on stdin -> a line of progress a log interval, and the validations
  local start=$SECONDS line n loss e
  while IFS= read -r line; do
    case $line in
      *" train_inner "*)
        [[ $line =~ \ num_updates=([0-9]+) ]] && n=${BASH_REMATCH[1]}
        [[ $line =~ \ loss=([^,]*) ]] && loss=${BASH_REMATCH[1]}
        e=$(( SECONDS - start ))
        printf 'run_example: update %5d / %d, %d:%02d elapsed, loss %s\n' "$n" "$UPDATES" $(( e / 60 )) $(( e % 60 )) "$loss" ;;
      *" valid on "*)
        [[ $line =~ \ num_updates\ ([0-9]+) ]] && n=${BASH_REMATCH[1]}
        [[ $line =~ \|\ loss\ ([^ ]*) ]] && loss=${BASH_REMATCH[1]}
        printf 'run_example: validation at update %s: loss %s\n' "$n" "$loss" ;;
    esac
  done
}
start=$SECONDS
# fairseq's log goes whole to train.log; the terminal gets one line of progress a log interval
# (PYTHONUNBUFFERED: as it is written, not in blocks of a pipe's buffer).
# A checkpoint at --max-update already is not given to fairseq-train, which would take one more update.
if [ "$DONE" -ge "$UPDATES" ]; then
  echo "run_example: the checkpoint has $DONE updates already; nothing to train"
elif ! PYTHONUNBUFFERED=1 fairseq-train "$WORK/data-bin" --user-dir "$ROOT/ls_fairseq/fairseq_plugin" "${MODEL[@]}" "${DEVICE[@]}" \
  --share-all-embeddings --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 \
  --optimizer ls_adam --adam-betas '(0.9,0.98)' --lr-scheduler inverse_sqrt \
  --clip-norm 1.0 --max-update "$UPDATES" \
  --save-dir "$CKPT" --no-epoch-checkpoints --tensorboard-logdir "$OUT/tensorboard" \
  --log-format simple --log-interval 50 --seed 1 2>&1 | tee -a "$OUT/train.log" | progress; then
  echo "run_example: fairseq-train failed; the end of $OUT/train.log:" >&2
  tail -20 "$OUT/train.log" >&2
  exit 1
fi
echo "run_example: training to update $UPDATES took $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s; translating the test set (fairseq-generate, beam 4)"

start=$SECONDS
fairseq-generate "$WORK/data-bin" --user-dir "$ROOT/ls_fairseq/fairseq_plugin" --path "$CKPT/checkpoint_last.pt" \
  --gen-subset test --beam 4 --lenpen 0.6 --batch-size 128 --remove-bpe sentencepiece --scoring sacrebleu \
  "${DEVICE[@]}" > "$OUT/generate.log" 2>&1 || { tail -20 "$OUT/generate.log"; exit 1; }
grep '^H-' "$OUT/generate.log" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$OUT/test.hyp"
BLEU=$(sacrebleu "$WORK/raw/test.de" -i "$OUT/test.hyp" -m bleu -b -w 2)
echo "run_example: translated $(wc -l < "$OUT/test.hyp") sentences in $(( SECONDS - start ))s"
echo "run_example: test BLEU (sacrebleu) = $BLEU after $UPDATES updates (at the default $DEFAULT_UPDATES updates: $EXPECT)"
if [ "${BLEU%%.*}" -lt 1 ]; then
  echo "run_example: a BLEU near 0 means the model is not trained enough: give it more updates (UPDATES=N)"
fi
echo "run_example: done in $(( (SECONDS - job_start) / 60 ))m$(( (SECONDS - job_start) % 60 ))s (data, training, translation)"
cat <<EOF
run_example: where things are
  data-bin (binarized data, dictionaries)  $WORK/data-bin
  SentencePiece model                      $WORK/spm.model
  untouched test text (BLEU reference)     $WORK/raw/test.de
  checkpoints                              $CKPT/checkpoint_last.pt, checkpoint_best.pt
  training log                             $OUT/train.log
  TensorBoard logs                         $OUT/tensorboard  (tensorboard --logdir $OUT/tensorboard)
  test hypotheses (detokenized)            $OUT/test.hyp  (fairseq-generate's output: $OUT/generate.log)
run_example: translate your own English sentences (one a line on standard input):
  source $VENV/bin/activate
  echo "Click the OK button." | fairseq-interactive $WORK/data-bin --user-dir $ROOT/ls_fairseq/fairseq_plugin \\
    --path $CKPT/checkpoint_last.pt --source-lang en --target-lang de \\
    --bpe sentencepiece --sentencepiece-model $WORK/spm.model --beam 4 --lenpen 0.6 ${DEVICE[*]} | grep '^D-'
EOF
