"""Safe, explicit loading of fairseq checkpoints on torch >= 2.6.

torch.load defaults to weights_only=True there, and fairseq's checkpoints
pickle one non-tensor type, ``argparse.Namespace`` (the model's legacy
configuration, and the whole configuration in older checkpoints), which it
refuses: resume, fairseq-generate and fairseq-validate fail. This module
allowlists exactly that type with ``torch.serialization.add_safe_globals``;
weights_only stays on, and a checkpoint that pickles any other type is still
refused.

It also wraps fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` so that a
refused, corrupt or truncated checkpoint fails with a message that names the
file, the cause, and the other checkpoints beside it; the file is never
modified (fairseq itself writes checkpoints to a temporary file and renames).

Under data-parallel training every rank reads the checkpoint file itself
(fairseq's ``--load-checkpoint-on-all-dp-ranks``, turned on by the wrapped
``Trainer.load_checkpoint``): by default rank 0 reads it and pickles the
loaded state to the other ranks, whose torch.load refuses it, since by then
the state holds fairseq's configuration as an omegaconf DictConfig (measured
on two H200s: resuming failed on rank 1). Each rank's load goes through the
same allowlist, which stays as narrow as above.
"""
import argparse
import functools
import os
import pickle
import re
import zipfile

import torch

FAIRSEQ_CHECKPOINT_TYPES = (argparse.Namespace,)


class CheckpointLoadError(RuntimeError):
    pass


def _guarded(load):
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            raise CheckpointLoadError(
                "{}: refused by torch's weights_only loading: it pickles {}, which is not a type that fairseq "
                "checkpoints hold (allowed: {})".format(
                    path,
                    found.group(1) if found else "a type outside the allowlist ({})".format(str(e).splitlines()[-1]),
                    ", ".join(t.__module__ + "." + t.__name__ for t in FAIRSEQ_CHECKPOINT_TYPES),
                )
            ) from e
        except (RuntimeError, OSError, EOFError, zipfile.BadZipFile) as e:
            if not os.path.isfile(path):
                raise
            folder = os.path.dirname(os.path.abspath(path))
            others = sorted(f for f in os.listdir(folder) if f.endswith(".pt") and f != os.path.basename(path))
            raise CheckpointLoadError(
                "checkpoint {} is corrupt or truncated ({}: {}); it was left as it is. Other checkpoints in {}: {}. "
                "Resume from one of them with --restore-file, or move the damaged file away.".format(
                    path, type(e).__name__, e, folder, ", ".join(others) or "none"
                )
            ) from e

    load_checkpoint_to_cpu.ls_fairseq_guarded = True
    return load_checkpoint_to_cpu


def _on_every_rank(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def trainer_load_checkpoint(trainer, *args, **kwargs):
        if trainer.data_parallel_world_size > 1:
            trainer.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        return load_checkpoint(trainer, *args, **kwargs)

    trainer_load_checkpoint.ls_fairseq_guarded = True
    return trainer_load_checkpoint


def install():
    """Allowlist fairseq's checkpoint types and guard fairseq's checkpoint loading (idempotent)."""
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES))
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "ls_fairseq_guarded", False):
        checkpoint_utils.load_checkpoint_to_cpu = _guarded(checkpoint_utils.load_checkpoint_to_cpu)
    if not getattr(Trainer.load_checkpoint, "ls_fairseq_guarded", False):
        Trainer.load_checkpoint = _on_every_rank(Trainer.load_checkpoint)
