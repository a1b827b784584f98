"""``ls-fairseq-train``: fairseq-train with the plugin loaded, and bf16 on GPUs.

The same command line as fairseq-train. Six differences:
- ``--help`` lists every option that the command line's components take: those
  of the architecture (``--arch``), task, criterion, optimizer and learning-rate
  scheduler (fairseq's help stops before it adds them), then the options of the
  plugin's own components that the command line did not choose (``print_help``);
- ``--user-dir`` pointing at this package is added when it is not given;
- the trainer is ``ls_fairseq.trainer.LSTrainer`` (fairseq's, with ls_adam's
  mixed-precision step decided on the device: no host sync inside an update):
  ``main`` installs the plugin with it (``install(ls_trainer=True)``);
- ``--bf16`` / ``--memory-efficient-bf16`` train in bf16 on the GPU (or CPU):
  fairseq's option parsing turns ``--bf16`` into ``--tpu``, which fails on a
  GPU, so unless ``--tpu`` is on the command line the flag is taken back after
  parsing. fairseq's trainer then casts the model to bf16 and, with
  ``--memory-efficient-bf16``, hands ls_adam the bf16 workspace (no loss
  scaling is needed in bf16);
- training stops fairseq's batch-prefetch threads before the interpreter exits
  (``stop_prefetch_threads``), so a run that ends mid-epoch exits with its own
  status instead of an abort;
- with ``--cpu`` under torchrun, each process joins the launcher's group
  (``from_cpu_launcher``): fairseq reads torchrun's environment only for GPUs.
"""
import argparse
import logging
import os
import queue
import sys
import threading
import time

PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))


def with_user_dir(argv):
    if any(a == "--user-dir" or a.startswith("--user-dir=") for a in argv):
        return list(argv)
    return list(argv) + ["--user-dir", PLUGIN_DIR]


def plugin_components():
    """(registry, name, class, dataclass) of each model, criterion, optimizer, ... that the plugin registers
    with fairseq (the plugin must be imported: ``--user-dir``)."""
    from fairseq.models import MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY
    from fairseq.registry import REGISTRIES

    registries = [("model", MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY)]
    registries += [(kind, r["registry"], r["dataclass_registry"]) for kind, r in REGISTRIES.items()]
    return [
        (kind, name, cls, dataclasses.get(name))
        for kind, registry, dataclasses in registries
        for name, cls in registry.items()
        if cls.__module__.split(".")[0] == __package__
    ]


class _ComponentsAdded(Exception):
    pass


def print_help(argv, file=None):
    """fairseq-train's help for the command line ``argv`` (``--help`` left out) with the options of its
    components, which fairseq's own ``--help`` stops before adding: fairseq's parser is taken at the
    point where it has them all (its ``modify_parser`` hook, called again just before the final parse).
    Then, under a heading each, the options of the plugin's components that ``argv`` did not choose."""
    from fairseq import options
    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.models import ARCH_MODEL_REGISTRY

    parser = options.get_training_parser()
    command_line = []  # its choices, read at the hook's first call, before fairseq adds their options

    def stop_when_complete(p):
        if command_line:  # the second call: the chosen components' options are in
            raise _ComponentsAdded
        command_line.append(p.parse_known_args(argv)[0])
        if command_line[0].arch is None:  # without --arch fairseq adds no component's options
            raise _ComponentsAdded

    try:
        options.parse_args_and_arch(parser, input_args=argv, modify_parser=stop_when_complete)
    except _ComponentsAdded:
        pass
    parser.print_help(file)
    args = command_line[0]
    chosen = {"model": ARCH_MODEL_REGISTRY.get(args.arch)}
    for kind, name, cls, dataclass in plugin_components():
        if chosen.get(kind, getattr(args, kind, None)) in (name, cls):
            continue
        flag = "--arch {}*".format(name) if kind == "model" else "--{} {}".format(kind.replace("_", "-"), name)
        section = argparse.ArgumentParser(add_help=False, usage=argparse.SUPPRESS,
                                          formatter_class=parser.formatter_class)
        group = section.add_argument_group("{} {} ({}, not chosen here)".format(kind, name, flag))
        if hasattr(cls, "add_args"):
            cls.add_args(group)
        elif dataclass is not None:
            gen_parser_from_dataclass(group, dataclass())
        print("\n" + section.format_help(), end="", file=file)


def parse_args(argv):
    """fairseq-train's parsed options for ``argv``, with bf16 kept off the TPU path. With ``-h`` or
    ``--help`` in ``argv``: prints every option (``print_help``) and exits. Installs the plugin first:
    the options name its registrations, and fairseq's import for ``--user-dir`` finds ls_fairseq
    imported already (this module is in it) and imports nothing."""
    from fairseq import options

    from ls_fairseq.fairseq_plugin import install

    install()
    if "-h" in argv or "--help" in argv:
        print_help([a for a in argv if a not in ("-h", "--help")])
        sys.exit(0)
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    if args.bf16 and "--tpu" not in argv:
        args.tpu = False
    return args


def log_as_fairseq_train():
    """fairseq-train's log format (importing fairseq already configured logging otherwise)."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stdout,
        force=True,
    )


def stop_prefetch_threads(timeout=60.0):
    """Stops fairseq's batch-prefetch threads (``--data-buffer-size``: a daemon thread per epoch
    iterator that collates, and pins, the next batches). When training stops mid-epoch
    (``--max-update``, an error), one may still be inside torch's C++ code as the interpreter shuts
    down, and the thread's forced exit then aborts the process ("terminate called without an active
    exception", exit status 134, after a successful run or in place of the error's status 1).
    Each thread is told to stop after the batch in hand, and its queue drained so that it can."""
    from fairseq.data.iterators import BackgroundConsumer

    deadline = time.monotonic() + timeout
    for thread in [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer)]:
        thread._max_len = 0  # checked after each batch it queues
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                thread._queue.get(timeout=0.01)
            except queue.Empty:
                thread.join(0.01)


def from_cpu_launcher(cfg):
    """Under torchrun (or torch.distributed.launch) with ``--cpu``: this process's place in the
    launcher's group, from its environment, as fairseq takes it on GPUs (whose version divides the
    rank by the GPU count, zero here), over gloo (NCCL needs GPUs). ``cfg``: fairseq's
    distributed_training config, changed in place; nothing changes outside a launcher."""
    from omegaconf import open_dict

    launched = all(key in os.environ for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))
    if not launched or cfg.distributed_init_method is not None or int(os.environ["WORLD_SIZE"]) < 2:
        return
    with open_dict(cfg):
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        cfg.distributed_rank = int(os.environ["RANK"])
        cfg.device_id = int(os.environ.get("LOCAL_RANK", 0))
        cfg.distributed_no_spawn = True
        if cfg.distributed_backend == "nccl":
            logging.getLogger("ls_fairseq.train").info("--cpu under a launcher: --distributed-backend gloo")
            cfg.distributed_backend = "gloo"


def cli_main():
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    log_as_fairseq_train()
    args = parse_args(with_user_dir(sys.argv[1:]))
    cfg = convert_namespace_to_omegaconf(args)
    if cfg.common.cpu:
        from_cpu_launcher(cfg.distributed_training)
    distributed_utils.call_main(cfg, main)


def main(cfg, **kwargs):
    """fairseq-train's main() with the plugin installed with its trainer. call_main runs it in this
    process or, for several GPUs, in each spawned worker (a fresh interpreter: installed there too)."""
    from fairseq_cli import train

    from ls_fairseq.fairseq_plugin import install

    log_as_fairseq_train()  # again in a spawned worker, whose imports configured logging their way
    install(ls_trainer=True)
    try:
        return train.main(cfg, **kwargs)
    finally:
        stop_prefetch_threads()


if __name__ == "__main__":
    cli_main()
