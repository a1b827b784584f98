"""What `import ls_fairseq` (and so --user-dir) registers, and the op dispatch switches."""
import pytest
import torch

import ls_fairseq.fairseq_plugin  # noqa: F401
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.optim import OPTIMIZER_REGISTRY

from ls_fairseq.ops import dispatch

ARCHS = [
    "ls_transformer", "ls_transformer_tiny", "ls_transformer_iwslt_de_en", "ls_transformer_wmt_en_de",
    "ls_transformer_vaswani_wmt_en_de_big", "ls_transformer_vaswani_wmt_en_fr_big", "ls_transformer_wmt_en_de_big",
    "ls_transformer_wmt_en_de_big_t2t",
]


def test_everything_is_registered():
    assert "ls_transformer" in MODEL_REGISTRY
    for arch in ARCHS:
        assert ARCH_MODEL_REGISTRY[arch] is MODEL_REGISTRY["ls_transformer"], arch
    assert "ls_label_smoothed_cross_entropy" in CRITERION_REGISTRY
    assert "ls_adam" in OPTIMIZER_REGISTRY


@pytest.mark.parametrize("arch", ARCHS[1:])
def test_architectures_take_their_fairseq_namesakes_hyper_parameters(arch):
    import argparse

    from fairseq.models import ARCH_CONFIG_REGISTRY

    ours, stock = argparse.Namespace(), argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](ours)
    ARCH_CONFIG_REGISTRY[arch[len("ls_"):]](stock)
    shared = set(vars(ours)) & set(vars(stock))  # stock sets max positions from the task, not the arch
    assert {"encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_layers", "encoder_attention_heads", "dropout",
            "attention_dropout", "activation_dropout", "encoder_normalize_before", "decoder_normalize_before",
            "decoder_embed_dim", "decoder_layers", "activation_fn"} <= shared
    for key in shared:
        assert getattr(stock, key) == getattr(ours, key), (arch, key)


def test_reference_can_be_forced_for_all_or_named_ops(monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_REFERENCE", raising=False)
    assert not dispatch.forced_reference("layer_norm")
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "layer_norm, softmax")
    assert dispatch.forced_reference("layer_norm") and dispatch.forced_reference("softmax")
    assert not dispatch.forced_reference("adam")
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "all")
    assert all(dispatch.forced_reference(op) for op in dispatch.OPS)
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "layernorm")
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.forced_reference("layer_norm")


def test_cpu_tensors_and_fp64_take_the_reference():
    assert not dispatch.use_kernel("layer_norm", torch.zeros(2))
    if torch.cuda.is_available():
        assert not dispatch.use_kernel("layer_norm", torch.zeros(2, dtype=torch.float64, device="cuda"))


def routes():
    """Every ``dispatch.Route`` the op modules define, by module and name."""
    import importlib
    import pkgutil

    import ls_fairseq.ops

    found = {}
    for info in pkgutil.iter_modules(ls_fairseq.ops.__path__):
        module = importlib.import_module("ls_fairseq.ops." + info.name)
        found.update({(info.name, name): v for name, v in vars(module).items() if isinstance(v, dispatch.Route)})
    return found


def test_every_op_has_a_route_to_kernels_that_bindings_cpp_binds():
    """A reader follows an op from its Route in ops/ by name to csrc/bindings.cpp: every op has one,
    and every ``_C.name`` an op module calls is a name the extension binds."""
    import pathlib
    import re

    assert {route.op for route in routes().values()} == set(dispatch.OPS)
    root = pathlib.Path(dispatch.__file__).parents[1]
    bindings = (root / "csrc" / "bindings.cpp").read_text()
    bound = set(re.findall(r'm\.(?:def|attr)\("(\w+)"', bindings))
    bound |= set(re.findall(r'py::class_<\w+>\(m, "(\w+)"', bindings))
    called = {name for path in (root / "ops").glob("*.py") for name in re.findall(r"\b_C\.(\w+)", path.read_text())}
    assert called and called <= bound, sorted(called - bound)


def test_a_route_takes_the_kernel_for_cuda_tensors_unless_forced(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(dispatch, "_C", SimpleNamespace())  # as if the extension were loaded
    monkeypatch.delenv("LS_FAIRSEQ_REFERENCE", raising=False)
    route = dispatch.Route("layer_norm", kernel="kernel", reference="reference")
    cuda = SimpleNamespace(is_cuda=True, dtype=torch.float16)
    assert route.pick(cuda) == "kernel"
    assert route.pick(SimpleNamespace(is_cuda=True, dtype=torch.float64)) == "reference"
    assert route.pick(torch.zeros(2, dtype=torch.float16)) == "reference"
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "softmax")
    assert route.pick(cuda) == "kernel"
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "layer_norm")
    assert route.pick(cuda) == "reference"
    monkeypatch.setattr(dispatch, "_C", None)
    monkeypatch.delenv("LS_FAIRSEQ_REFERENCE")
    assert route.pick(cuda) == "reference"
    with pytest.raises(ValueError, match="unknown op 'layernorm'"):
        dispatch.Route("layernorm", kernel=None, reference=None)


@pytest.mark.gpu
def test_every_route_has_its_kernels_where_the_extension_is_loaded():
    assert dispatch.extension() is not None, dispatch.extension_error()
    for where, route in routes().items():
        kernels = route.kernel if isinstance(route.kernel, tuple) else (route.kernel,)
        assert all(callable(k) for k in kernels), where


def reference_section(start, end):
    """The text of docs/reference.md between two of its lines."""
    import os

    from conftest import REPO

    with open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8") as f:
        text = f.read()
    assert start in text and end in text, (start, end)
    return text.split(start, 1)[1].split(end, 1)[0]


def test_the_reference_lists_every_plugin_option_with_its_component_and_default():
    """docs/reference.md's options table (between its ls-options markers) has one row for each --ls-*
    option of the plugin's dataclasses, with its component's kind and its default (off for a flag),
    and no other row: an option added, renamed or given another default fails here until the table
    says so."""
    from test_entry_points import ls_options

    rows = {}
    for line in reference_section("<!-- ls-options -->", "<!-- /ls-options -->").strip().splitlines()[2:]:
        option, component, default = [cell.strip() for cell in line.strip().strip("|").split("|")][:3]
        assert option.strip("`") not in rows, option
        rows[option.strip("`")] = (component, default)
    expected = {}
    for option, component, default, _ in ls_options():
        shown = "off" if default is False else "{:g}".format(default) if isinstance(default, (int, float)) else default
        expected[option] = (component.split()[0], str(shown))
    assert rows == expected


def test_the_reference_names_every_registered_architecture():
    table = reference_section("## Registered names", "## Options")
    for name in ARCHS + ["ls_label_smoothed_cross_entropy", "ls_adam", "LSSequenceGenerator", "ls-fairseq-train"]:
        assert "`{}`".format(name) in table, name


LM_ARCHS = [
    "ls_transformer_lm_big", "ls_transformer_lm_gpt", "ls_transformer_lm_gpt2_tiny", "ls_transformer_lm_gpt2_small",
    "ls_transformer_lm_gpt2_medium", "ls_transformer_lm_gpt2_big", "ls_transformer_lm_gpt3_small",
    "ls_transformer_lm_gpt3_medium", "ls_transformer_lm_gpt3_large", "ls_transformer_lm_gpt3_xl",
    "ls_transformer_lm_gpt3_2_7", "ls_transformer_lm_gpt3_6_7", "ls_transformer_lm_gpt3_13", "ls_transformer_lm_gpt3_175",
]


@pytest.mark.parametrize("arch", LM_ARCHS)
def test_language_model_architectures_take_their_fairseq_namesakes_hyper_parameters(arch):
    """Every option both set, equal (pre-LN always, as stock's base_lm_architecture sets it)."""
    import argparse

    from fairseq.models import ARCH_CONFIG_REGISTRY

    assert ARCH_MODEL_REGISTRY[arch] is MODEL_REGISTRY["ls_transformer_lm"]
    ours, stock = argparse.Namespace(), argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](ours)
    ARCH_CONFIG_REGISTRY[arch[len("ls_"):]](stock)
    shared = set(vars(ours)) & set(vars(stock))
    assert {"decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads", "dropout",
            "attention_dropout", "activation_fn", "decoder_normalize_before", "decoder_learned_pos",
            "share_decoder_input_output_embed", "decoder_input_dim", "decoder_output_dim", "no_decoder_final_norm",
            "layernorm_embedding", "no_scale_embedding", "adaptive_input", "decoder_layerdrop"} <= shared
    for key in shared:
        assert getattr(stock, key) == getattr(ours, key), (arch, key)
    assert ours.decoder_normalize_before is True


def test_the_model_named_arch_takes_the_dataclass_defaults_as_stocks():
    """--arch ls_transformer_lm / transformer_lm: the model's own name, the dataclass's defaults (fairseq's
    registration), the same on both sides for every option both have."""
    from fairseq.models import MODEL_DATACLASS_REGISTRY

    ours, stock = MODEL_DATACLASS_REGISTRY["ls_transformer_lm"](), MODEL_DATACLASS_REGISTRY["transformer_lm"]()
    names = {f for f in ours.__dataclass_fields__} & {f for f in stock.__dataclass_fields__}
    assert {"decoder_embed_dim", "decoder_normalize_before", "activation_fn", "dropout"} <= names
    for name in names:
        mine, theirs = getattr(ours, name), getattr(stock, name)
        assert str(mine) == str(theirs), (name, mine, theirs)
