"""Safe, explicit loading of fairseq checkpoints on torch >= 2.6: the library; the fairseq plugin
installs it (ls_fairseq/fairseq_plugin: checkpoint_hooks.py holds its wrappers of fairseq).

torch.load defaults to weights_only=True there, and fairseq's checkpoints
pickle one non-tensor type, ``argparse.Namespace`` (the model's legacy
configuration, and the whole configuration in older checkpoints), which it
refuses: resume, fairseq-generate and fairseq-validate fail. The plugin
allowlists exactly that type (``FAIRSEQ_CHECKPOINT_TYPES``) with
``torch.serialization.add_safe_globals``; weights_only stays on, and a checkpoint
that pickles any other type is still refused.

The plugin also wraps fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` so that a
refused, corrupt or truncated checkpoint fails with a message that names the
file, the cause, and the other checkpoints beside it; the file is never
modified.

Every checkpoint file a run writes appears whole or not at all. fairseq writes
the first file of a save (``checkpoint_1_500.pt``, ``checkpoint3.pt``) to a
temporary file and renames it, but copies it to the others
(``checkpoint_best.pt``, ``checkpoint_last.pt``, ...) in place, so a kill during
a copy left a truncated ``checkpoint_last.pt``, the file a resume reads. With the
plugin both go through ``replace_atomically``: the bytes go to ``<name>.tmp`` in the
same folder, are flushed to the disk (fsync), and ``os.replace`` puts the file
in place in one step; the folder is synced after it. A kill at any moment leaves
every ``.pt`` file either its old or its new whole content, and at most a stale
``.tmp`` file, which the next save removes (one process, rank 0, writes a run's
checkpoints, so any ``*.pt.tmp`` beside them was left by an interrupted save). Paths that only
fairseq's PathManager can reach (no local rename) and
``--write-checkpoints-asynchronously`` keep fairseq's own writing.

A checkpoint that does not fit the model the command line builds fails with a
message that says how (``check_model_state``, called by ls_transformer's
``load_state_dict``): a stock fairseq transformer checkpoint (convert it first),
another architecture (the missing, unexpected or differently shaped parameters),
an embedding table whose size is not the data-bin's dictionary's. The plugin's
checkpoints also record a fingerprint of the source and target dictionaries
(``extra_state["ls_dictionaries"]``), and resuming or fine-tuning from one on a
data-bin whose dictionary has the same size but other tokens fails too.

Under data-parallel training every rank reads the checkpoint file itself
(fairseq's ``--load-checkpoint-on-all-dp-ranks``, turned on by the plugin's wrapper of
``Trainer.load_checkpoint``): by default rank 0 reads it and pickles the
loaded state to the other ranks, whose torch.load refuses it, since by then
the state holds fairseq's configuration as an omegaconf DictConfig (measured
on two H200s: resuming failed on rank 1). Each rank's load goes through the
same allowlist, which stays as narrow as above.
"""
import argparse
import hashlib
import logging
import os
import shutil
import signal

import torch

logger = logging.getLogger(__name__)

FAIRSEQ_CHECKPOINT_TYPES = (argparse.Namespace,)


def fairseq_types_allowed():
    """A context in which torch's weights_only loading allows FAIRSEQ_CHECKPOINT_TYPES: those not allowed
    already are added and, at its end, taken away again. Only those: torch's ``safe_globals`` context
    takes its types away at the end even when they were allowed before, which would undo the plugin's
    ``install()`` for the rest of the process."""
    allowed = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals([t for t in FAIRSEQ_CHECKPOINT_TYPES if t not in allowed])

FAULT_VARIABLE = "LS_FAIRSEQ_TEST_KILL_AT"
FAULT_POINTS = (
    "save_written", "save_before_rename", "save_renamed",
    "copy_partial", "copy_written", "copy_before_rename", "copy_renamed",
)
_fault_hits = {}


def fault_point(point, path, f=None):
    """The fault tests' hook (tests/test_fault_checkpoints.py, scripts/fault_checkpoints.py).

    ``LS_FAIRSEQ_TEST_KILL_AT=<point>:<n>`` SIGKILLs this process the n-th time (default the first)
    it reaches ``point`` of ``replace_atomically`` (writing ``path``), one of ``FAULT_POINTS``: ``save_*`` in the write
    of a save's first file, ``copy_*`` in a copy of it to another name; ``*_written``: every byte in
    the temporary file, not yet synced; ``*_before_rename``: synced, not renamed; ``*_renamed``: in
    place, the next file not begun; ``copy_partial``: half of the bytes in the temporary file.
    ``f``, the temporary file, is flushed first, so that the bytes written are on disk as a crash
    leaves them. Unset (always, outside those tests) it does nothing."""
    armed = os.environ.get(FAULT_VARIABLE)
    if not armed or armed.partition(":")[0] != point:
        return
    _fault_hits[point] = _fault_hits.get(point, 0) + 1
    if _fault_hits[point] == int(armed.partition(":")[2] or 1):
        if f is not None:
            f.flush()
        print("ls_fairseq fault hook: SIGKILL at {} {}".format(point, path), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_folder(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path, write, kind="save"):
    """Make ``path`` hold what ``write(f)`` writes to a binary file, whole or not at all: written to
    ``path + ".tmp"`` beside it, synced, renamed over ``path`` (``os.replace``), folder synced.
    ``kind``, "save" or "copy", names the fault hook's points (``fault_point``)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            fault_point(kind + "_written", path, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        # a failed write (a full disk, an error in torch.save) leaves the old file and frees the space
        os.remove(tmp)
        raise
    fault_point(kind + "_before_rename", path)
    os.replace(tmp, path)
    _fsync_folder(os.path.dirname(os.path.abspath(path)))
    fault_point(kind + "_renamed", path)


def copy_into(src, dst):
    def write(f):
        with open(src, "rb") as s:
            left = os.fstat(s.fileno()).st_size // 2
            while left > 0:
                chunk = s.read(min(1 << 20, left))
                f.write(chunk)
                left -= len(chunk) or left
            fault_point("copy_partial", dst, f)
            shutil.copyfileobj(s, f, 1 << 20)

    return write


def remove_stale_temporaries(folder):
    for name in os.listdir(folder):
        if name.endswith(".pt.tmp"):
            os.remove(os.path.join(folder, name))
            logger.info("removed %s, left by an interrupted checkpoint save", os.path.join(folder, name))


class CheckpointLoadError(RuntimeError):
    pass


class CheckpointMismatchError(ValueError):
    pass


STOCK_TRANSFORMER_KEY = "encoder.layers.0.self_attn.q_proj.weight"  # fairseq's transformer; ls_transformer: qkv_proj


def check_model_state(model, state_dict):
    """Raise CheckpointMismatchError saying how ``state_dict`` does not fit ``model``: another
    architecture (missing, unexpected or differently shaped parameters), a stock fairseq transformer,
    or embedding tables of another dictionary's size."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if STOCK_TRANSFORMER_KEY in state_dict:
        raise CheckpointMismatchError(
            "this is a checkpoint of fairseq's transformer (separate q_proj, k_proj, v_proj), not of ls_transformer: "
            "convert it first with python -m ls_fairseq.convert from-fairseq IN.pt OUT.pt"
        )
    for side in ("encoder", "decoder"):
        key, dictionary = side + ".embed_tokens.weight", getattr(getattr(model, side, None), "dictionary", None)
        if key in state_dict and dictionary is not None and state_dict[key].shape[0] != len(dictionary):
            raise CheckpointMismatchError(
                "its {} has {} rows, the data-bin's {} dictionary {} entries: the checkpoint was trained with another "
                "dictionary (binarize the data with the checkpoint's: fairseq-preprocess --srcdict/--tgtdict)".format(
                    key, state_dict[key].shape[0], "source" if side == "encoder" else "target", len(dictionary)
                )
            )
    shapes = ["{} {} (this model: {})".format(k, list(state_dict[k].shape), list(v.shape)) for k, v in own.items()
              if k in state_dict and torch.is_tensor(v) and tuple(state_dict[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        parts = [
            "{} {}{}".format(len(names), what, ": " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
            for names, what in ((missing, "parameters missing"), (unexpected, "unexpected parameters"),
                                (shapes, "of other shapes"))
            if names
        ]
        raise CheckpointMismatchError(
            "it holds another architecture than the one the command line builds ({}); give the options it was "
            "trained with (--arch, --encoder-layers, --encoder-embed-dim, ...)".format("; ".join(parts))
        )


def dictionary_fingerprints(task):
    """{"source"/"target": {"size", "sha256"}} of the task's dictionaries (those it has)."""
    found = {}
    for side in ("source", "target") if task is not None else ():
        d = getattr(task, side + "_dictionary", None)
        if d is not None:
            found[side] = {"size": len(d), "sha256": hashlib.sha256("\n".join(d.symbols).encode()).hexdigest()[:16]}
    return found
