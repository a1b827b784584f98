"""The fairseq criterion ls_label_smoothed_cross_entropy (registered by ls_fairseq.fairseq_plugin)."""
