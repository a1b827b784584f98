"""The plugin's hooks into fairseq's checkpoint reading and writing (installed by
``ls_fairseq.fairseq_plugin.install``; the library they use is ls_fairseq/checkpoint.py).

- ``guarded_load`` (fairseq's ``checkpoint_utils.load_checkpoint_to_cpu``): a refused, corrupt or
  truncated checkpoint fails with a message that names the file, the cause and the checkpoints
  beside it; the file is never modified.
- ``atomic_persistent_save`` and ``atomic_copy_path_manager`` (``torch_persistent_save`` and the
  ``PathManager`` that ``save_checkpoint`` copies with): every checkpoint file appears whole or not
  at all (``checkpoint.replace_atomically``).
- ``with_dictionaries`` (``Trainer.state_dict``): checkpoints record the dictionaries' fingerprints.
- ``load_on_every_rank`` (``Trainer.load_checkpoint``): every data-parallel rank reads the file
  itself, a mismatched model or dictionary fails naming the checkpoint.
"""
import functools
import os
import pickle
import re
import zipfile

import torch

from ls_fairseq.checkpoint import (
    FAIRSEQ_CHECKPOINT_TYPES,
    CheckpointLoadError,
    CheckpointMismatchError,
    copy_into,
    remove_stale_temporaries,
    dictionary_fingerprints,
    replace_atomically,
)


def atomic_persistent_save(save):
    """fairseq's ``checkpoint_utils.torch_persistent_save`` through ``replace_atomically``."""

    @functools.wraps(save)
    def torch_persistent_save(obj, filename, async_write=False):
        from fairseq.file_io import PathManager

        if async_write or not PathManager.supports_rename(filename):
            return save(obj, filename, async_write=async_write)
        remove_stale_temporaries(os.path.dirname(os.path.abspath(filename)))
        replace_atomically(filename, lambda f: torch.save(obj, f), kind="save")

    return torch_persistent_save


def atomic_copy_path_manager(PathManager):
    """fairseq's PathManager whose ``copy`` (what ``save_checkpoint`` copies the first file to the
    others with) goes through ``replace_atomically`` for local paths; given to checkpoint_utils only."""

    class AtomicCopyPathManager(PathManager):
        @staticmethod
        def copy(src_path, dst_path, overwrite=False):
            if not (PathManager.supports_rename(src_path) and PathManager.supports_rename(dst_path)):
                return PathManager.copy(src_path, dst_path, overwrite=overwrite)
            if not overwrite and os.path.exists(dst_path):
                raise FileExistsError(dst_path)
            replace_atomically(dst_path, copy_into(src_path, dst_path), kind="copy")
            return True

    return AtomicCopyPathManager


def with_dictionaries(state_dict):
    @functools.wraps(state_dict)
    def trainer_state_dict(trainer):
        state = state_dict(trainer)
        if trainer.task is not None:
            state["extra_state"]["ls_dictionaries"] = dictionary_fingerprints(trainer.task)
        return state

    return trainer_state_dict


def guarded_load(load):
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

    return load_checkpoint_to_cpu


def load_on_every_rank(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def trainer_load_checkpoint(trainer, filename, *args, **kwargs):
        if trainer.data_parallel_world_size > 1:
            trainer.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
        try:
            extra_state = load_checkpoint(trainer, filename, *args, **kwargs)
        except Exception as e:
            # fairseq's trainer replaces any model loading error by "please ensure that the architectures match"
            if isinstance(e.__context__, CheckpointMismatchError):
                raise CheckpointMismatchError("checkpoint {}: {}".format(filename, e.__context__)) from None
            raise
        saved = (extra_state or {}).get("ls_dictionaries", {})
        for side, now in (dictionary_fingerprints(trainer.task) if saved else {}).items():
            if side in saved and saved[side] != now:
                raise CheckpointMismatchError(
                    "checkpoint {} was trained with another {} dictionary than the data-bin's: {} entries, sha256 {} "
                    "there, {} entries, sha256 {} here; its token ids would mean other words. Binarize the data with "
                    "the checkpoint's dictionary (fairseq-preprocess --srcdict/--tgtdict).".format(
                        filename, side, saved[side]["size"], saved[side]["sha256"], now["size"], now["sha256"]
                    )
                )
        return extra_state

    return trainer_load_checkpoint
