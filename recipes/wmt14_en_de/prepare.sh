#!/usr/bin/env bash
# WMT14 en-de data for fairseq: download (Europarl v7, Common Crawl, News
# Commentary v9; newstest2013 valid, newstest2014 test), clean, learn a joint
# SentencePiece model, encode, fairseq-preprocess --joined-dictionary.
#
#   bash prepare.sh [--work DIR] [--vocab-size N]          # download WMT14 (needs a network)
#   bash prepare.sh --from DIR [--work DIR] [--vocab-size N] # offline: DIR/{train,valid,test}.{en,de}[.gz]
#
# The dictionary is padded to a multiple of 16 types (--padding-factor, fairseq's default is 8), so
# that the output projection's GEMM fits --ls-fp8 (its N must be a multiple of 16).
#
# Every step leaves a marker in WORK/.done/ and is skipped when run again, so a
# failed run resumes where it stopped. Result: WORK/data-bin (binarized) and
# WORK/raw/test.{en,de} (the untouched test text that BLEU is scored against).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${WORK:-data/wmt14_en_de}
FROM=""
VOCAB=32000
RATIO=1.5
MAXLEN=250
PADDING=16
while [ $# -gt 0 ]; do
  case "$1" in
    --from) FROM=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --vocab-size) VOCAB=$2; shift 2 ;;
    --ratio) RATIO=$2; shift 2 ;;
    --padding-factor) PADDING=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "prepare.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
mkdir -p "$WORK/raw" "$WORK/.done"
done_() { touch "$WORK/.done/$1"; }
is_done() { [ -f "$WORK/.done/$1" ]; }
log() { echo "prepare: $*" >&2; }

fetch() {  # URL -> WORK/downloads/FILE, resumable
  local url=$1 file
  file="$WORK/downloads/$(basename "$url")"
  mkdir -p "$WORK/downloads"
  if [ ! -f "$file.ok" ]; then
    log "downloading $url"
    if ! wget -c -q -O "$file" "$url"; then
      echo "prepare: download failed: $url" >&2
      echo "prepare: run the same command again to resume (finished steps are skipped)" >&2
      exit 1
    fi
    touch "$file.ok"
  fi
  tar -xzf "$file" -C "$WORK/downloads"
}

strip_sgm() { grep '<seg id' "$1" | sed -e 's/<seg id="[0-9]*">\s*//' -e 's/\s*<\/seg>\s*//'; }

if ! is_done raw; then
  if [ -n "$FROM" ]; then
    for split in train valid test; do
      for l in en de; do
        if [ -f "$FROM/$split.$l.gz" ]; then gzip -dc "$FROM/$split.$l.gz" > "$WORK/raw/$split.$l"
        elif [ -f "$FROM/$split.$l" ]; then cp "$FROM/$split.$l" "$WORK/raw/$split.$l"
        else echo "prepare: missing $FROM/$split.$l (or .gz)" >&2; exit 1; fi
      done
    done
  else
    fetch http://statmt.org/wmt13/training-parallel-europarl-v7.tgz
    fetch http://statmt.org/wmt13/training-parallel-commoncrawl.tgz
    fetch http://statmt.org/wmt14/training-parallel-nc-v9.tgz
    fetch http://statmt.org/wmt14/dev.tgz
    fetch http://statmt.org/wmt14/test-full.tgz
    D=$WORK/downloads
    for l in en de; do
      cat "$D/training/europarl-v7.de-en.$l" "$D/commoncrawl.de-en.$l" "$D/training/news-commentary-v9.de-en.$l" > "$WORK/raw/train.$l"
      cp "$D/dev/newstest2013.$l" "$WORK/raw/valid.$l"
    done
    strip_sgm "$D/test-full/newstest2014-deen-src.en.sgm" > "$WORK/raw/test.en"
    strip_sgm "$D/test-full/newstest2014-deen-ref.de.sgm" > "$WORK/raw/test.de"
  fi
  done_ raw
fi

if ! is_done spm; then
  log "learning a joint SentencePiece model ($VOCAB pieces)"
  $PY "$HERE/spm.py" train --model "$WORK/spm" --vocab-size "$VOCAB" "$WORK/raw/train.en" "$WORK/raw/train.de" > "$WORK/spm.log" 2>&1 \
    || { tail -20 "$WORK/spm.log" >&2; exit 1; }
  done_ spm
fi

if ! is_done encode; then
  mkdir -p "$WORK/spm_text"
  for split in train valid test; do
    for l in en de; do
      $PY "$HERE/spm.py" encode --model "$WORK/spm.model" < "$WORK/raw/$split.$l" > "$WORK/spm_text/$split.$l"
    done
  done
  $PY "$HERE/spm.py" clean --max-len "$MAXLEN" --ratio "$RATIO" \
    "$WORK/spm_text/train.en" "$WORK/spm_text/train.de" "$WORK/spm_text/train.clean.en" "$WORK/spm_text/train.clean.de"
  done_ encode
fi

if ! is_done binarize; then
  rm -rf "$WORK/data-bin"
  fairseq-preprocess --source-lang en --target-lang de \
    --trainpref "$WORK/spm_text/train.clean" --validpref "$WORK/spm_text/valid" --testpref "$WORK/spm_text/test" \
    --destdir "$WORK/data-bin" --joined-dictionary --padding-factor "$PADDING" --workers "${WORKERS:-2}" > "$WORK/preprocess.log" 2>&1 \
    || { tail -20 "$WORK/preprocess.log" >&2; exit 1; }
  done_ binarize
fi
log "ready: $WORK/data-bin"
