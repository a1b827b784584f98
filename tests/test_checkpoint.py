import argparse
import fractions

import pytest
import torch

import ls_fairseq.fairseq_plugin  # noqa: F401 (installs the allowlist and the guarded loader)
from fairseq import checkpoint_utils

from ls_fairseq.checkpoint import CheckpointLoadError


def test_fairseq_namespace_loads_with_weights_only(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"args": argparse.Namespace(arch="ls_transformer"), "model": {"w": torch.ones(2)}}, path)
    state = torch.load(path, weights_only=True)
    assert state["args"].arch == "ls_transformer"


def test_a_foreign_type_is_still_refused_and_named(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save({"cfg": None, "model": {}, "evil": fractions.Fraction(1, 3)}, path)
    with pytest.raises(Exception, match="fractions.Fraction"):
        torch.load(path, weights_only=True)
    with pytest.raises(CheckpointLoadError, match="fractions.Fraction"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def test_weights_only_default_is_untouched(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save(fractions.Fraction(1, 3), path)
    with pytest.raises(Exception):
        torch.load(path)


def test_truncated_checkpoint_names_the_file_and_its_neighbours(tmp_path):
    good = tmp_path / "checkpoint1.pt"
    torch.save({"model": {"w": torch.randn(1000)}}, good)
    bad = tmp_path / "checkpoint_last.pt"
    bad.write_bytes(good.read_bytes()[:500])
    before = bad.read_bytes()
    with pytest.raises(CheckpointLoadError, match=r"checkpoint_last\.pt is corrupt or truncated.*checkpoint1\.pt"):
        checkpoint_utils.load_checkpoint_to_cpu(str(bad))
    assert bad.read_bytes() == before


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_data_parallel_rank_reads_the_checkpoint_itself(tmp_path, world_size):
    """fairseq's default has rank 0 pickle the loaded state (its configuration an omegaconf DictConfig)
    to the other ranks, whose weights_only torch.load refuses it; under data-parallel training the
    plugin makes every rank load the file through the allowlist instead."""
    from types import SimpleNamespace

    from fairseq.trainer import Trainer
    from omegaconf import OmegaConf

    trainer = SimpleNamespace(data_parallel_world_size=world_size,
                              cfg=OmegaConf.create({"checkpoint": {"load_checkpoint_on_all_dp_ranks": False}}))
    assert Trainer.load_checkpoint(trainer, str(tmp_path / "none.pt")) is None
    assert trainer.cfg.checkpoint.load_checkpoint_on_all_dp_ranks == (world_size > 1)
