#!/usr/bin/env bash
# LightSeq2's speed experiment on one GPU (see bench.py): stock fairseq --fp16
# vs ls_fairseq on synthetic WMT14-like data, swept over --max-tokens.
#   bash recipes/wmt14_en_de/bench.sh            # core points: big, 4096/8192/16384 (about 10 minutes)
#   bash recipes/wmt14_en_de/bench.sh --full     # 512 .. 16384, big and base
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT_DIR:-$HERE/results/$(date +%Y-%m-%d)}
exec "${PYTHON:-python3}" "$HERE/bench.py" --out "$OUT" "$@"
