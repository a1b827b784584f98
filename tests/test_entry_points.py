"""The two entry points, ``fairseq-train --user-dir ls_fairseq`` and ``ls-fairseq-train``, end to end on
the same checkpoints: each resumes the other's; their logs; ``ls-fairseq-train --help``."""
import re
import shutil

import pytest
import torch
from conftest import USER_DIR, bin_path, run
from helpers import rel_error
from test_cli import ONE_GPU, TRAIN

import ls_fairseq.fairseq_plugin  # noqa: F401 (allowlists the checkpoint types for torch.load below)

pytestmark = pytest.mark.slow

STOCK, PLUGIN = "fairseq-train", "ls-fairseq-train"


def train(entry, data_bin, save_dir, *args):
    cmd = [bin_path(entry), str(data_bin / "data-bin")] + (["--user-dir", USER_DIR] if entry == STOCK else [])
    proc = run(cmd + list(args) + ["--save-dir", str(save_dir)])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return log


def logged(log, kind):
    """The figures of each ``kind`` line (train_inner, valid, train) of fairseq's simple log format, as
    name -> text."""
    lines = []
    for line in re.findall(r"\| INFO \| {} \| (.*)".format(kind), log):
        if kind == "train_inner":  # epoch 001:      5 / 183 loss=9.993, nll_loss=9.983, ...
            lines.append(dict(re.findall(r"(\w+)=([^,\s]+)", line)))
        else:  # epoch 001 | valid on 'valid' subset | loss 9.724 | nll_loss 9.691 | ...
            lines.append(dict(field.split(" ", 1) for field in line.split(" | ")))
    assert lines, "no {} line in the log:\n{}".format(kind, log[-3000:])
    return lines


def assert_same_figures(plugin, stock, what, kind):
    """The same figures, each a number: the plugin's training lines add the ``skipped`` count, its
    validation lines nothing. Figures of speed, wall time and memory are left out of the comparison
    (the two optimizers keep different buffers)."""
    assert len(plugin) == len(stock), what
    for p, s in zip(plugin, stock):
        assert set(p) - set(s) <= ({"skipped"} if kind != "valid" else set()) and set(s) <= set(p), (what, p, s)
        for key in set(s) - {"wps", "ups", "wpb", "bsz", "train_wall", "wall", "mfu", "gb_free", "gpu_peak_gib"}:
            if key in ("epoch", "valid"):
                assert p[key] == s[key], (what, key)
                continue
            # the two optimizers' clip coefficients differ by fairseq's 1e-6 in the norm
            assert abs(float(p[key]) - float(s[key])) <= 2e-3 + 1e-3 * abs(float(s[key])), (what, key, p, s)


def assert_same_checkpoint(plugin, stock, what, fp16):
    """The plugin's checkpoint holds what fairseq-train's holds for the same flags and training: the
    optimizer's name, update count, learning-rate schedule, the optimizer's state (the plugin adds its
    fp32 master copy and its scaler's good-step count) and the model, to the two optimizers' rounding
    (their clip coefficients differ by fairseq's 1e-6 in the norm; in fp16 that moves the gradients,
    and the moments, by a few parts in 10,000). Moments that were not resumed would differ by tens of
    percent."""
    a, b = torch.load(plugin, weights_only=True), torch.load(stock, weights_only=True)
    ha, hb = a["optimizer_history"][-1], b["optimizer_history"][-1]
    assert ha == hb, what  # optimizer and criterion names, lr scheduler state, num_updates
    sa, sb = a["last_optimizer_state"], b["last_optimizer_state"]
    assert set(sb) <= set(sa) <= set(sb) | {"good_steps"}, what
    assert set(sb["state"]) <= set(sa["state"]) <= set(sb["state"]) | {"master"}, what
    assert sa["param_groups"] == sb["param_groups"] and sa.get("loss_scale") == sb.get("loss_scale"), what
    assert sa["state"]["step"] == sb["state"]["step"] == hb["num_updates"], what
    assert set(a["model"]) == set(b["model"]), what
    assert all(a["model"][k].dtype == v.dtype and a["model"][k].shape == v.shape for k, v in b["model"].items()), what
    err = rel_error(*(torch.cat([m["model"][k].float().reshape(-1) for k in b["model"]]) for m in (a, b)))
    assert err <= (1e-3 if fp16 else 1e-5), (what, "model", err)
    for k in ("exp_avg", "exp_avg_sq"):
        assert sa["state"][k].dtype == sb["state"][k].dtype == torch.float32, (what, k)
        assert sa["state"][k].shape == sb["state"][k].shape, (what, k)
        err = rel_error(sa["state"][k], sb["state"][k])
        assert err <= (1e-2 if fp16 else 1e-5), (what, k, err)


# the loss scale doubles every 2 updates: a scale not resumed shows in the logs and checkpoints
SCALE = ["--fp16-init-scale", "4", "--fp16-scale-window", "2"]
PRECISIONS = {
    "fp32": [],
    "memory-efficient-fp16": ["--memory-efficient-fp16"] + SCALE,
    # fairseq's FP16Optimizer keeps its flat fp32 copy on a GPU (torch.cuda.current_device()): on the CPU it
    # runs only with a copy per parameter
    "fp16-no-flatten-grads": ["--fp16", "--fp16-no-flatten-grads"] + SCALE,
    "fp16": ["--fp16"] + SCALE,
}


@pytest.mark.parametrize(
    "device,precision",
    [("cpu", p) for p in PRECISIONS if p != "fp16"] + [pytest.param("cuda", "fp16", marks=pytest.mark.gpu)],
)
def test_each_entry_point_resumes_the_others_checkpoints(data_bin, tmp_path, device, precision):
    """4 updates under fairseq-train, resumed to 8 under ls-fairseq-train, go on as under fairseq-train;
    that checkpoint of ls-fairseq-train's, resumed to 12 under fairseq-train, goes on as under
    ls-fairseq-train. The same logged figures (update count, learning rate, loss, gnorm, clip,
    loss scale) in the interval lines, the epoch's and validation's (ls-fairseq-train's validation
    lines carry validation figures only), and the same checkpoint: optimizer name and state, moments,
    loss scale, schedule, model. On a GPU, --fp16: fairseq's FP16Optimizer with its flat fp32 copy."""
    args = (TRAIN if device == "cpu" else ONE_GPU) + PRECISIONS[precision]
    args += ["--log-interval", "2", "--no-epoch-checkpoints"]
    fp16 = precision != "fp32"

    def resume(entry, save, source, updates):
        shutil.copytree(tmp_path / source, tmp_path / save)
        log = train(entry, data_bin, tmp_path / save, *args, "--max-update", str(updates))
        assert re.search(r"Loaded checkpoint .*\(epoch 1 @ {} updates\)".format(updates - 4), log), log[-3000:]
        return log

    def compare(plugin, stock, what):
        for kind in ("train_inner", "valid", "train"):
            assert_same_figures(logged(plugin[1], kind), logged(stock[1], kind), "{}: {}".format(what, kind), kind)
        assert_same_checkpoint(tmp_path / plugin[0] / "checkpoint_last.pt", tmp_path / stock[0] / "checkpoint_last.pt",
                               what, fp16)

    train(STOCK, data_bin, tmp_path / "stock", *args, "--max-update", "4")
    stock = "stock_stock", resume(STOCK, "stock_stock", "stock", 8)
    plugin = "plugin", resume(PLUGIN, "plugin", "stock", 8)
    compare(plugin, stock, "fairseq-train's checkpoint resumed by ls-fairseq-train")
    if fp16:  # doubled every 2 updates from 4, across the resume
        assert [float(line["loss_scale"]) for line in logged(plugin[1], "train_inner")] == [4 * 2**3, 4 * 2**4]

    stock = "from_plugin_stock", resume(STOCK, "from_plugin_stock", "plugin", 12)
    plugin = "from_plugin_plugin", resume(PLUGIN, "from_plugin_plugin", "plugin", 12)
    compare(plugin, stock, "ls-fairseq-train's checkpoint resumed by fairseq-train")


def ls_options():
    """(option, component, default, help) of every --ls-* option of the plugin's components, from their
    dataclasses."""
    from dataclasses import fields

    from fairseq.models import MODEL_DATACLASS_REGISTRY
    from fairseq.registry import REGISTRIES

    from ls_fairseq.models.ls_transformer import LSTransformerConfig

    configs = [("model ls_transformer", LSTransformerConfig)]
    configs += [("{} {}".format(kind, name), dc) for kind, r in REGISTRIES.items()
                for name, dc in r["dataclass_registry"].items() if dc.__module__.startswith("ls_fairseq.")]
    configs += [("model " + name, dc) for name, dc in MODEL_DATACLASS_REGISTRY.items()
                if dc.__module__.startswith("ls_fairseq.") and dc is not LSTransformerConfig]
    return [("--" + f.name.replace("_", "-"), component, f.default, f.metadata["help"])
            for component, dc in configs for f in fields(dc) if f.name.startswith("ls_")]


@pytest.mark.parametrize("command_line", [
    ["--arch", "ls_transformer_tiny"],
    ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy", "--optimizer", "adam"],
])
def test_help_lists_the_architectures_and_every_plugin_option(command_line):
    """fairseq's --help stops before it adds the model's, criterion's and optimizer's options;
    ls-fairseq-train --help lists them, and every --ls-* option with its help, chosen or not."""
    proc = run([bin_path(PLUGIN), "--help"] + command_line)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    options = ls_options()
    assert {o[1].split()[0] for o in options} >= {"model", "criterion", "optimizer"}
    for option, component, _, help_text in options:
        assert re.search(re.escape(option) + r"\b", text), (option, component)
        assert " ".join(help_text.split()) in text, (option, help_text)
    # the architecture's own options, with fairseq's help strings
    assert "--encoder-layers ENCODER_LAYERS num encoder layers" in text
    assert "--label-smoothing LABEL_SMOOTHING" in text and "--adam-betas ADAM_BETAS" in text
    if "adam" in command_line:  # the stock optimizer's options, and the plugin's ls_adam's under its own heading
        assert "--use-old-adam" in text and "optimizer ls_adam (--optimizer ls_adam, not chosen here)" in text
