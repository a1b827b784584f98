"""Optimizers: ``WorkspaceAdam`` (a torch.optim.Optimizer, no fairseq needed) and its fairseq
wrapper ``ls_adam`` (ls_fairseq.optim.ls_adam, registered by ls_fairseq.fairseq_plugin)."""
