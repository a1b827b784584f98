"""ls_fairseq: LightSeq2's fused Transformer training, as a library and as a fairseq plugin.

The core needs torch alone and changes nothing when imported: ``ls_fairseq.ops`` (the fused ops),
the layers, the workspace Adam (``ls_fairseq.optim.workspace_adam.WorkspaceAdam``, a
torch.optim.Optimizer) and the fused label-smoothed cross-entropy (``ls_fairseq.loss``).

The fairseq plugin is ``ls_fairseq.fairseq_plugin``: ``--user-dir .../ls_fairseq/fairseq_plugin``
(or ``ls-fairseq-train``) installs the ``ls_transformer`` model, the
``ls_label_smoothed_cross_entropy`` criterion, the ``ls_adam`` optimizer and the plugin's hooks
into fairseq, all listed there.
"""
__version__ = "0.1.0"
