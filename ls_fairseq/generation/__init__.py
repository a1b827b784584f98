"""Translation with ls models through fairseq-generate and fairseq-interactive, unchanged.

fairseq takes the task from the command line (default ``translation``), so a task of our own would
need ``--task`` on every command. Instead, the fairseq plugin (ls_fairseq.fairseq_plugin) wraps
``TranslationTask.build_generator``, which fairseq-generate, fairseq-interactive, the hub interface
and --eval-bleu all call (and ``LanguageModelingTask.build_generator`` likewise, for ls_transformer_lm:
--task language_modeling): when the one model is an ls model and every generation option is
one that ``LSSequenceGenerator`` implements, it returns that generator (logging one line saying
so: beam search or sampling); otherwise fairseq's own generator, with one line naming the reason. Tasks derived from
TranslationTask that define their own build_generator are left as they are.
"""
from ls_fairseq.generation.sequence_generator import LSSequenceGenerator

__all__ = ["LSSequenceGenerator", "unsupported"]

# generation options (fairseq's GenerationConfig) that only fairseq's generators implement, with
# the value that means "off"
_OFF = {
    "diverse_beam_groups": -1,
    "diversity_rate": -1.0,
    "match_source_len": False,
    "constraints": None,
    "print_alignment": None,
    "retain_dropout": False,
    "score_reference": False,
}


def unsupported(models, args, tgt_dict, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
    """Why LSSequenceGenerator cannot stand in for fairseq's generator here (None: it can)."""
    from ls_fairseq.models.ls_transformer import LSTransformerModel
    from ls_fairseq.models.ls_transformer_lm import LSTransformerLanguageModel

    if len(models) != 1:
        return "an ensemble of {} models".format(len(models))
    if not isinstance(models[0], (LSTransformerModel, LSTransformerLanguageModel)):
        return "the model is {}, not ls_transformer or ls_transformer_lm".format(type(models[0]).__name__)
    for name, off in _OFF.items():
        value = getattr(args, name, off)
        if value != off and value is not None:
            return "--{} {}".format(name.replace("_", "-"), value)
    ngram = getattr(args, "no_repeat_ngram_size", 0)
    if ngram == 1:
        return "--no-repeat-ngram-size 1"
    if seq_gen_cls is not None:
        return "the caller asks for {}".format(seq_gen_cls.__name__)
    if prefix_allowed_tokens_fn is not None or getattr(args, "prefix_allowed_tokens_fn", None) is not None:
        return "a prefix_allowed_tokens_fn"
    extra = dict(extra_gen_cls_kwargs or {})
    if extra.pop("lm_model", None) is not None:
        return "a language model (--lm-path)"
    extra.pop("lm_weight", None)
    if extra:
        return "generator arguments {}".format(sorted(extra))
    beam = min(getattr(args, "beam", 5), len(tgt_dict) - 1)
    if 2 * beam > len(tgt_dict) - 1 and not getattr(args, "sampling", False):
        return "--beam {} with a vocabulary of {} symbols".format(beam, len(tgt_dict))
    if getattr(args, "temperature", 1.0) <= 0:
        return "--temperature {}".format(args.temperature)
    return None
