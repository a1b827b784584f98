"""ls_fairseq: fused Transformer training for fairseq (a LightSeq2 re-creation).

Importing the package (``import ls_fairseq`` or ``--user-dir .../ls_fairseq``)
registers the ``ls_transformer`` model and its architectures, the
``ls_label_smoothed_cross_entropy`` criterion and the ``ls_adam`` optimizer,
allowlists the types that fairseq checkpoints hold for torch's
weights_only loading (see ``ls_fairseq.checkpoint``), makes fairseq's
checkpoint writing atomic (same module), checks the token ids of the data
fairseq loads against its dictionary (``ls_fairseq.data_checks``), and has
the translation task translate ls models with ``ls_fairseq.generation``
(fairseq-generate, fairseq-interactive: see there), and has fairseq's trainer
pack the training batches with --ls-packed (``ls_fairseq.batching``).
"""
from ls_fairseq import batching, checkpoint, criterions, data_checks, generation, models, optim  # noqa: F401

batching.install()
checkpoint.install()
data_checks.install()
generation.install()

__version__ = "0.1.0"
