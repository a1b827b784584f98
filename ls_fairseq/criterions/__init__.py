from ls_fairseq.criterions import ls_label_smoothed_cross_entropy  # noqa: F401 (registers the criterion)
