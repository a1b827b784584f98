"""ls_fairseq's fairseq plugin: the one place where ls_fairseq changes fairseq and torch.

The rest of ls_fairseq (the ops, the layers, the workspace Adam, the fused loss, the fairseq model,
criterion and optimizer classes, the trainer class) changes nothing when imported. ``install()``
(ls_fairseq/fairseq_plugin/patches.py) makes every change, listed there: it registers the
``ls_transformer`` model and its architectures, the ``ls_label_smoothed_cross_entropy`` criterion
and the ``ls_adam`` optimizer; allowlists ``argparse.Namespace`` for torch's weights_only loading;
and wraps, each for the reason written beside it in ``patches()``, fairseq's checkpoint loading and
writing, its data loading, the trainer's batches (packed with --ls-packed), the translation task's
generator, torch's peak-memory reset, the epoch iterator's first batch, and fairseq-train's epoch
function (a relaunched finished run stops before a step). ``install(ls_trainer=True)`` also makes fairseq-train's trainer ``ls_fairseq.trainer.LSTrainer``.

Who calls ``install()``:
- importing this package: ``fairseq-train/-generate/-interactive --user-dir .../ls_fairseq/fairseq_plugin``
  (fairseq imports the folder as the top-level module ``fairseq_plugin``), or
  ``import ls_fairseq.fairseq_plugin`` in Python;
- ``ls-fairseq-train`` (ls_fairseq/train.py), explicitly, as ``install(ls_trainer=True)`` in the
  process that trains (each spawned worker too). It passes the same ``--user-dir``, whose import
  then finds everything installed. fairseq imports a ``--user-dir`` package only when its name is
  not in ``sys.modules`` yet, so a plugin whose ``--user-dir`` were ls_fairseq itself would install
  nothing once the core was imported: this folder's own name keeps the two apart.
Installing twice changes nothing the second time.
"""
from ls_fairseq.fairseq_plugin.patches import install, patches  # noqa: F401

install()
