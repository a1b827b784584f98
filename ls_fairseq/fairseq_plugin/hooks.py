"""The plugin's wrappers of fairseq and torch functions other than checkpointing (checkpoint_hooks.py),
each made from the function it replaces; ``ls_fairseq.fairseq_plugin.install`` puts them in place."""
import functools
import logging

from ls_fairseq import memory
from ls_fairseq.batching import pack_training_batches
from ls_fairseq.data_checks import check_tokens
from ls_fairseq.generation import LSSequenceGenerator, unsupported



def checked_load_indexed_dataset(load):
    """fairseq's ``data_utils.load_indexed_dataset``, whose every dataset loaded with a dictionary
    has its token ids checked against it (ls_fairseq.data_checks)."""

    @functools.wraps(load)
    def load_indexed_dataset(path, dictionary=None, *args, **kwargs):
        dataset = load(path, dictionary, *args, **kwargs)
        if dataset is not None and dictionary is not None:
            check_tokens(dataset, dictionary, path)
        return dataset

    return load_indexed_dataset


def ls_build_generator(stock):
    """``TranslationTask.build_generator`` (and LanguageModelingTask's) that returns ``LSSequenceGenerator``
    where it can stand in for fairseq's generator, else ``stock``'s (ls_fairseq.generation)."""

    @functools.wraps(stock)
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        reason = unsupported(models, args, self.target_dictionary, seq_gen_cls, extra_gen_cls_kwargs,
                             prefix_allowed_tokens_fn)
        if reason is None:
            logging.getLogger("ls_fairseq.generation").info(
                "ls_fairseq: %s on the device (ls_fairseq.generation.LSSequenceGenerator)",
                "sampling" if getattr(args, "sampling", False) else "beam search")
            return LSSequenceGenerator.from_args(models, self.target_dictionary, args)
        logging.getLogger("ls_fairseq.generation").info("ls_fairseq: fairseq's generator (%s)", reason)
        return stock(self, models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                     prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)

    return build_generator


def keep_peak_at_resets(reset):
    """``torch.cuda.reset_peak_memory_stats`` that first keeps the peak so far in ls_fairseq.memory."""

    @functools.wraps(reset)
    def reset_peak_memory_stats(device=None):
        memory.fold_peak_before_reset(device)
        return reset(device)

    return reset_peak_memory_stats


def first_batch_once(first_batch):
    """``EpochBatchIterator.first_batch`` (a property) that collates the data's first batch once.

    fairseq's trainer reads its epoch iterator's ``first_batch`` (its dummy batch) at the start of
    every epoch, and the iterator collates the data's first batch again each time, in the main
    process, while the GPU waits for the epoch's first step. Here the iterator keeps what it
    collated for as long as its first batch (fairseq's frozen batch list) stays the same, and
    collates again when fairseq rebuilds that list (``--update-epoch-batch-itr``)."""
    collate = first_batch.fget

    @functools.wraps(collate)
    def fget(iterator):
        first = iterator.frozen_batches[0] if len(iterator.frozen_batches) else None
        cached = iterator.__dict__.get("_ls_first_batch")
        if cached is None or cached[0] is not first:
            cached = iterator._ls_first_batch = (first, collate(iterator))
        return cached[1]

    return property(fget)


def stop_finished_run(train):
    """fairseq-train's epoch function (``fairseq_cli.train.train``) that trains nothing when the
    loaded checkpoint already holds --max-update updates: fairseq's main loop checks --max-update
    only after a step, so relaunching a finished run trained one more update at each launch."""

    @functools.wraps(train)
    def train_epoch(cfg, trainer, task, epoch_itr):
        max_update = cfg.optimization.max_update
        if max_update and trainer.get_num_updates() >= max_update:
            logging.getLogger("ls_fairseq.train").info("ls_fairseq: the run is finished (the checkpoint is at update %d, --max-update %d); "
                        "nothing to train: raise --max-update to continue it", trainer.get_num_updates(), max_update)
            return [None], True
        return train(cfg, trainer, task, epoch_itr)

    return train_epoch


def packs_training_batches(init):
    """fairseq's ``Trainer.__init__`` that then packs the training split's batches with --ls-packed
    (ls_fairseq.batching.pack_training_batches; nothing changes without it)."""

    @functools.wraps(init)
    def __init__(trainer, *args, **kwargs):
        init(trainer, *args, **kwargs)
        pack_training_batches(trainer)

    return __init__
