"""Every change the plugin makes to fairseq and torch, listed in ``patches()`` and
``REGISTRATIONS``, and made by ``install()`` (see the package's docstring for who calls it)."""
import argparse
import inspect
from collections import namedtuple

import torch

from ls_fairseq.fairseq_plugin import checkpoint_hooks, hooks

# owner.name = wrap(owner.name), for the reason in ``why``
Patch = namedtuple("Patch", "owner name wrap why")

# (fairseq registry, name, the module and attribute of the class, the attribute of its dataclass)
REGISTRATIONS = (
    ("model", "ls_transformer", "ls_fairseq.models.ls_transformer", "LSTransformerModel", None),
    ("model", "ls_transformer_lm", "ls_fairseq.models.ls_transformer_lm", "LSTransformerLanguageModel",
     "LSTransformerLanguageModelConfig"),
    ("criterion", "ls_label_smoothed_cross_entropy", "ls_fairseq.criterions.ls_label_smoothed_cross_entropy",
     "LSLabelSmoothedCrossEntropyCriterion", "LSLabelSmoothedCrossEntropyCriterionConfig"),
    ("optimizer", "ls_adam", "ls_fairseq.optim.ls_adam", "LSAdam", "LSAdamConfig"),
)
SAFE_GLOBALS = (argparse.Namespace,)  # the one non-tensor type fairseq checkpoints pickle (ls_fairseq/checkpoint.py)


def patches(ls_trainer=False):
    """The attributes of fairseq and torch that ``install(ls_trainer)`` replaces, each with why."""
    import fairseq_cli.train
    from fairseq import checkpoint_utils
    from fairseq.data import data_utils
    from fairseq.data.iterators import EpochBatchIterator
    from fairseq.tasks.language_modeling import LanguageModelingTask
    from fairseq.tasks.translation import TranslationTask
    from fairseq.trainer import Trainer

    listed = [
        Patch(checkpoint_utils, "load_checkpoint_to_cpu", checkpoint_hooks.guarded_load,
              "a refused, corrupt or truncated checkpoint fails naming the file, the cause and its neighbours"),
        Patch(checkpoint_utils, "torch_persistent_save", checkpoint_hooks.atomic_persistent_save,
              "a save's first file appears whole or not at all (written beside it, synced, renamed)"),
        Patch(checkpoint_utils, "PathManager", checkpoint_hooks.atomic_copy_path_manager,
              "its copies to checkpoint_last.pt, checkpoint_best.pt, ... too: a kill mid-copy truncated them"),
        Patch(Trainer, "state_dict", checkpoint_hooks.with_dictionaries,
              "checkpoints record the dictionaries' fingerprints, so a resume on other data fails clearly"),
        Patch(Trainer, "load_checkpoint", checkpoint_hooks.load_on_every_rank,
              "every data-parallel rank reads the file (the pickled hand-over is refused by weights_only), "
              "and a mismatched model or dictionary fails naming the checkpoint"),
        Patch(Trainer, "__init__", hooks.packs_training_batches,
              "with --ls-packed the training split's batches are packed streams, under fairseq-train too"),
        Patch(data_utils, "load_indexed_dataset", hooks.checked_load_indexed_dataset,
              "token ids outside the dictionary fail at load, naming the file, not inside a GPU gather"),
        Patch(TranslationTask, "build_generator", hooks.ls_build_generator,
              "fairseq-generate/interactive translate an ls_transformer with the device beam search"),
        Patch(LanguageModelingTask, "build_generator", hooks.ls_build_generator,
              "fairseq-generate/interactive --task language_modeling sample an ls_transformer_lm on the device, "
              "its prompt prefilled in one pass"),
        Patch(torch.cuda, "reset_peak_memory_stats", hooks.keep_peak_at_resets,
              "fairseq's trainer resets the peak every update; the logged gpu_peak_gib keeps it first"),
        Patch(EpochBatchIterator, "first_batch", hooks.first_batch_once,
              "the trainer's dummy batch is collated once, not again at every epoch while the GPU waits"),
        Patch(fairseq_cli.train, "train", hooks.stop_finished_run,
              "a relaunched finished run (checkpoint at --max-update) stops before a step, not one update on"),
    ]
    if ls_trainer:
        from ls_fairseq.trainer import LSTrainer

        listed.append(Patch(fairseq_cli.train, "Trainer", lambda _: LSTrainer,
                            "ls-fairseq-train's trainer: ls_adam's mixed-precision step decided on the device"))
    return listed


_installed = {}  # (id(owner), name) -> the replacement install() put there


def _register(kind, name, module, cls_name, dataclass_name):
    import importlib

    from fairseq.models import MODEL_REGISTRY, register_model, register_model_architecture
    from fairseq.registry import REGISTRIES

    m = importlib.import_module(module)
    cls, dataclass = getattr(m, cls_name), getattr(m, dataclass_name) if dataclass_name else None
    if kind == "model":
        if name not in MODEL_REGISTRY:
            register_model(name, dataclass=dataclass)(cls)
            for arch, fn in m.ARCHITECTURES.items():
                register_model_architecture(name, arch)(fn)
    elif name not in REGISTRIES[kind]["registry"]:
        import fairseq.criterions
        import fairseq.optim

        register = {"criterion": fairseq.criterions.register_criterion,
                    "optimizer": fairseq.optim.register_optimizer}[kind]
        register(name, dataclass=dataclass)(cls)


def install(ls_trainer=False):
    """Register the plugin's model (with its architectures), criterion and optimizer with fairseq
    (``REGISTRATIONS``), allowlist ``SAFE_GLOBALS`` for torch's weights_only loading, and make the
    replacements that ``patches(ls_trainer)`` lists. Idempotent: a second call changes nothing."""
    missing = [t for t in SAFE_GLOBALS if t not in torch.serialization.get_safe_globals()]
    if missing:
        torch.serialization.add_safe_globals(missing)
    for registration in REGISTRATIONS:
        _register(*registration)
    for patch in patches(ls_trainer):
        key = (id(patch.owner), patch.name)
        current = inspect.getattr_static(patch.owner, patch.name)  # a property itself, not its value
        if key in _installed and _installed[key] is current:
            continue
        _installed[key] = patch.wrap(current)
        setattr(patch.owner, patch.name, _installed[key])
