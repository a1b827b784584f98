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
- importing this package, which ``ls_fairseq/__init__.py`` does when fairseq imports ls_fairseq for
  ``fairseq-train/-generate/-interactive --user-dir .../ls_fairseq`` (and only then), or
  ``import ls_fairseq.fairseq_plugin`` in Python;
- ``ls-fairseq-train`` (ls_fairseq/train.py), explicitly: ``install()`` before it parses the command
  line (its own import of ls_fairseq came first, so fairseq's ``--user-dir`` import finds the name
  taken and imports nothing) and ``install(ls_trainer=True)`` in the process that trains (each
  spawned worker too).
Installing twice changes nothing the second time.
"""
from ls_fairseq.fairseq_plugin.patches import install, patches  # noqa: F401

install()
