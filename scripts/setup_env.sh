#!/usr/bin/env bash
# Create .venv with everything ls_fairseq needs on a fresh machine:
# torch (a CPU build where no GPU toolchain is wanted), fairseq-fixed 0.12.3.1
# built without build isolation, fairseq's runtime needs, and ls_fairseq itself
# (editable; its CUDA extension is built only when torch has CUDA and nvcc exists).
# Idempotent: a finished environment is reused (remove .venv to rebuild).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${LS_FAIRSEQ_VENV:-.venv}
TORCH_SPEC=${LS_FAIRSEQ_TORCH:-torch==2.13.0}
if [ -f "$VENV/.ls_fairseq_ready" ]; then
  exit 0
fi
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q "numpy>=1.24" "cython>=3" ninja
echo "setup_env: building fairseq-fixed 0.12.3.1 (about 2 minutes)"
"$PY" -m pip install -q --no-build-isolation --no-deps fairseq-fixed==0.12.3.1
"$PY" -m pip install -q -r requirements.txt
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
touch "$VENV/.ls_fairseq_ready"
echo "setup_env: ready ($("$PY" -c 'import torch, fairseq; print("torch", torch.__version__, "fairseq", fairseq.__version__)'))"
