import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANT = os.path.join(REPO, "scripts", "racecheck_strip", "variant.py")
LAYER_NORM = os.path.join(REPO, "ls_fairseq", "csrc", "layer_norm.cu")


@pytest.mark.parametrize("which,changed", [("asis", 0), ("ownfold", 1), ("rowsync", 7)])
def test_each_probe_build_still_applies_to_layer_norm(which, changed):
    """racecheck_strip.sh's builds edit layer_norm.cu by exact lines: a change to the kernel that
    moves one of them fails here, not on the GPU machine."""
    original = open(LAYER_NORM).read().splitlines()
    out = subprocess.run([sys.executable, VARIANT, which, LAYER_NORM], capture_output=True, text=True, check=True)
    edited = out.stdout.splitlines()
    removed = [line for line in original if line not in edited]
    assert len(removed) == changed, removed
    if which == "rowsync":
        assert "row_group_barrier<SPLIT>(group);" not in "\n".join(edited).split("ln_backward_strip_kernel(")[1]
