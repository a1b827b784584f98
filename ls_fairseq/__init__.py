"""ls_fairseq: fused Transformer training for fairseq (a LightSeq2 re-creation).

Importing the package (``import ls_fairseq`` or ``--user-dir .../ls_fairseq``)
registers the ``ls_transformer`` model and its architectures, the
``ls_label_smoothed_cross_entropy`` criterion and the ``ls_adam`` optimizer,
allowlists the types that fairseq checkpoints hold for torch's
weights_only loading (see ``ls_fairseq.checkpoint``), and has the translation
task translate ls models with ``ls_fairseq.generation`` (fairseq-generate,
fairseq-interactive: see there).
"""
from ls_fairseq import checkpoint, criterions, generation, models, optim  # noqa: F401

checkpoint.install()
generation.install()

__version__ = "0.1.0"
