"""Checkpoint files appear whole or not at all: in-process checks of the atomic write and copy, and
a short version of scripts/fault_checkpoints.py (training runs SIGKILLed inside a save, inside a
copy and at random moments, each followed by a checked resume)."""
import os
import sys

import pytest
import torch

import ls_fairseq.fairseq_plugin  # noqa: F401 (installs the atomic save and copy)
from conftest import REPO
from fairseq import checkpoint_utils

from ls_fairseq.checkpoint import FAULT_POINTS, replace_atomically

sys.path.insert(0, os.path.join(REPO, "scripts"))
import fault_checkpoints  # noqa: E402


def test_fairseqs_save_and_copy_go_through_the_atomic_replace(tmp_path):
    first, last = str(tmp_path / "checkpoint_1_3.pt"), str(tmp_path / "checkpoint_last.pt")
    checkpoint_utils.torch_persistent_save({"w": torch.arange(5)}, first)
    assert checkpoint_utils.PathManager.copy(first, last, overwrite=True)
    assert torch.equal(torch.load(last)["w"], torch.arange(5))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_3.pt", "checkpoint_last.pt"]
    with pytest.raises(FileExistsError):
        checkpoint_utils.PathManager.copy(first, last)


def test_a_save_removes_the_temporaries_of_interrupted_saves(tmp_path):
    (tmp_path / "checkpoint_3_90.pt.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "checkpoint_last.pt.tmp").write_bytes(b"half a copy")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    checkpoint_utils.torch_persistent_save({"w": torch.arange(3)}, str(tmp_path / "checkpoint_3_93.pt"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_3_93.pt", "notes.tmp"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save({"w": torch.ones(3)}, path)
    before = open(path, "rb").read()

    def write(f):
        f.write(b"partial bytes")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replace_atomically(path, write)
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["checkpoint_last.pt"]


@pytest.mark.parametrize("point", ["copy_partial", "copy_written", "copy_before_rename"])
def test_a_kill_inside_a_copy_leaves_the_old_destination(tmp_path, point):
    """A child process copies a new checkpoint over checkpoint_last.pt and is SIGKILLed by the hook."""
    from conftest import run

    old, new = tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint_1_6.pt"
    torch.save({"w": torch.zeros(1000)}, old)
    torch.save({"w": torch.ones(1000)}, new)
    before = old.read_bytes()
    code = "import ls_fairseq.fairseq_plugin; from fairseq import checkpoint_utils as c; c.PathManager.copy({!r}, {!r}, True)".format(
        str(new), str(old))
    proc = run([sys.executable, "-c", code], env={"LS_FAIRSEQ_TEST_KILL_AT": point})
    assert proc.returncode == -9 and "SIGKILL at " + point in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert old.read_bytes() == before
    assert torch.equal(torch.load(old)["w"], torch.zeros(1000))


@pytest.mark.slow
@pytest.mark.parametrize("cli", fault_checkpoints.CLIS)
def test_killed_runs_resume_from_whole_checkpoints(tmp_path, cli):
    """4 kills of a tiny CPU run (3 from the hook, at three of its points in turn, 1 at a random
    moment), each checked, and a last run to the end (about 30 s)."""
    data_bin = fault_checkpoints.make_data_bin(str(tmp_path))
    result = fault_checkpoints.run_rounds(cli, data_bin, str(tmp_path / "ckpt"), kills=4, hooked=3, seed=1)
    hooked = [where for where, n in result["landed"].items() for _ in range(n) if where in FAULT_POINTS]
    assert len(hooked) == 3 and len(set(hooked)) == 3 and sum(result["landed"].values()) == 4
    assert result["resumes"] >= 2
