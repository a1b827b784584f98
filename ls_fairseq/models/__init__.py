"""The fairseq model ls_transformer (ls_fairseq.models.ls_transformer, registered by
ls_fairseq.fairseq_plugin) and its layers built from fairseq's configuration."""
