from ls_fairseq.models import ls_transformer  # noqa: F401 (registers the model and its architectures)
