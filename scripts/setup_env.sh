#!/usr/bin/env bash
# Create .venv with everything ls_fairseq needs on a fresh machine:
# torch (a CPU build where no GPU toolchain is wanted), fairseq-fixed 0.12.3.1
# built without build isolation, fairseq's runtime needs, and ls_fairseq itself
# (editable; its CUDA extension is built only when torch has CUDA and nvcc exists).
# Idempotent: a finished environment is reused (remove .venv to rebuild).
# LS_FAIRSEQ_VENV=DIR sets it up in DIR instead of .venv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${LS_FAIRSEQ_VENV:-.venv}
TORCH_SPEC=${LS_FAIRSEQ_TORCH:-torch==2.13.0}
# The marker holds requirements.txt's checksum: an environment set up before it changed gets
# the new requirements installed (and nothing else redone).
REQS=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ -f "$VENV/.ls_fairseq_ready" ]; then
  if [ "$(cat "$VENV/.ls_fairseq_ready")" != "$REQS" ]; then
    echo "setup_env: requirements.txt changed since $VENV was set up; installing it"
    "$VENV/bin/python" -m pip install -q -r requirements.txt
    echo "$REQS" > "$VENV/.ls_fairseq_ready"
  fi
  exit 0
fi
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -m pip install -q "$TORCH_SPEC"
"$PY" -m pip install -q "numpy>=1.24,<2.4" "cython>=3" ninja
"$PY" -m pip install -q -r requirements.txt
# fairseq-fixed and ls_fairseq come last and without their declared dependencies (fairseq-fixed's
# torchaudio is not needed and would pull a multi-GB CUDA torch): an install after them would
# check fairseq-fixed's declared dependencies and report the missing torchaudio as an error.
echo "setup_env: building fairseq-fixed 0.12.3.1 (about 2 minutes)"
"$PY" -m pip install -q --no-build-isolation --no-deps fairseq-fixed==0.12.3.1
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
echo "$REQS" > "$VENV/.ls_fairseq_ready"
echo "setup_env: ready ($("$PY" -c 'import torch, fairseq; print("torch", torch.__version__, "fairseq", fairseq.__version__)'))"
