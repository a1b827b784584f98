#!/usr/bin/env bash
# Language-model data for fairseq's language_modeling task: WikiText-103 (download, a
# SentencePiece model learned on its training text, encode, fairseq-preprocess --only-source), or
# offline the embedded corpus's target side (data/lohelp/*.de.gz), a small LM corpus for the CPU.
#
#   bash prepare.sh [--work DIR] [--vocab-size N]             # download WikiText-103 (needs a network)
#   bash prepare.sh --lohelp [--work DIR] [--vocab-size N]    # offline: the embedded corpus's German side
#   bash prepare.sh --from DIR [--work DIR] [--vocab-size N]  # offline: DIR/{train,valid,test}.txt[.gz]
#
# WikiText-103 comes raw (wikitext-103-raw-v1, untokenized); its article titles and blank lines are
# kept as they are (fairseq's --sample-break-mode none reads the text as one stream). The dictionary
# is padded to a multiple of 16 types, as the translation recipe's. Every step leaves a marker in
# WORK/.done/ and is skipped when run again. Result: WORK/data-bin (dict.txt, train/valid/test).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-data/wikitext-103}
FROM=""
LOHELP=0
VOCAB=32000
PADDING=16
URL=https://wikitext.smerity.com/wikitext-103-raw-v1.zip
while [ $# -gt 0 ]; do
  case "$1" in
    --from) FROM=$2; shift 2 ;;
    --lohelp) LOHELP=1; shift ;;
    --work) WORK=$2; shift 2 ;;
    --vocab-size) VOCAB=$2; shift 2 ;;
    --padding-factor) PADDING=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "prepare.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$LOHELP" = 1 ]; then
  [ -z "$FROM" ] || { echo "prepare.sh: --lohelp and --from exclude each other" >&2; exit 2; }
  FROM=$REPO/data/lohelp
fi
PY=${PYTHON:-python3}
mkdir -p "$WORK/raw" "$WORK/.done"
done_() { touch "$WORK/.done/$1"; }
is_done() { [ -f "$WORK/.done/$1" ]; }
log() { echo "prepare: $*" >&2; }

if ! is_done raw; then
  if [ "$LOHELP" = 1 ]; then
    for split in train valid test; do gzip -dc "$FROM/$split.de.gz" > "$WORK/raw/$split.txt"; done
  elif [ -n "$FROM" ]; then
    for split in train valid test; do
      if [ -f "$FROM/$split.txt.gz" ]; then gzip -dc "$FROM/$split.txt.gz" > "$WORK/raw/$split.txt"
      elif [ -f "$FROM/$split.txt" ]; then cp "$FROM/$split.txt" "$WORK/raw/$split.txt"
      else echo "prepare: missing $FROM/$split.txt (or .gz)" >&2; exit 1; fi
    done
  else
    mkdir -p "$WORK/downloads"
    zip=$WORK/downloads/$(basename "$URL")
    if [ ! -f "$zip.ok" ]; then
      log "downloading $URL"
      if ! wget -c -q -O "$zip" "$URL"; then
        echo "prepare: download failed: $URL" >&2
        echo "prepare: run the same command again to resume (finished steps are skipped)" >&2
        exit 1
      fi
      touch "$zip.ok"
    fi
    "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$zip" "$WORK/downloads"
    for split in train valid test; do cp "$WORK/downloads/wikitext-103-raw/wiki.$split.raw" "$WORK/raw/$split.txt"; done
  fi
  done_ raw
fi

if ! is_done spm; then
  log "learning a SentencePiece model ($VOCAB pieces)"
  "$PY" "$REPO/recipes/wmt14_en_de/spm.py" train --model "$WORK/spm" --vocab-size "$VOCAB" "$WORK/raw/train.txt" \
    > "$WORK/spm.log" 2>&1 || { tail -20 "$WORK/spm.log" >&2; exit 1; }
  done_ spm
fi

if ! is_done encode; then
  mkdir -p "$WORK/spm_text"
  for split in train valid test; do
    "$PY" "$REPO/recipes/wmt14_en_de/spm.py" encode --model "$WORK/spm.model" < "$WORK/raw/$split.txt" > "$WORK/spm_text/$split.txt"
  done
  done_ encode
fi

if ! is_done binarize; then
  rm -rf "$WORK/data-bin"
  fairseq-preprocess --only-source --trainpref "$WORK/spm_text/train.txt" --validpref "$WORK/spm_text/valid.txt" \
    --testpref "$WORK/spm_text/test.txt" --destdir "$WORK/data-bin" --padding-factor "$PADDING" \
    --workers "${WORKERS:-2}" > "$WORK/preprocess.log" 2>&1 || { tail -20 "$WORK/preprocess.log" >&2; exit 1; }
  done_ binarize
fi
log "ready: $WORK/data-bin"
