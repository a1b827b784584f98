from ls_fairseq.optim import ls_adam  # noqa: F401 (registers the optimizer)
