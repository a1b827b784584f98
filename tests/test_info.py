"""``python -m ls_fairseq.info`` in each state: no extension, extension loaded (a stand-in module and
GPU on the CPU; the real ones under the gpu mark), ops forced onto their references, a bad
LS_FAIRSEQ_REFERENCE, a built extension that does not load."""
import importlib.util
import sys
import types

import pytest
import torch

from conftest import REPO, run
from ls_fairseq import info
from ls_fairseq.ops import dispatch

# dispatch.OPS, then the ops of ls_fairseq.ops without a kernel of their own
EVERY_OP = list(dispatch.OPS) + ["linear", "linear_bias_act", "residual"]


def op_lines(lines):
    """{op: path} from the op rows, checking that the path column starts at one offset."""
    start = lines.index("ops (the path each takes in training here):")
    rows = lines[start + 1:]
    assert rows and all(r.startswith("  ") for r in rows), rows
    paths = {}
    columns = set()
    for r in rows:
        name = r.split()[0]
        assert name not in paths, "{} listed twice".format(name)
        paths[name] = r[len("  ") + len(name):].strip()
        columns.add(r.index(paths[name]))
    assert len(columns) == 1, "the path column is misaligned:\n" + "\n".join(rows)
    return paths


def field(lines, key):
    found = [line[len(key):].strip() for line in lines if line.split(" ", 1)[0] == key]
    assert len(found) == 1, (key, lines)
    return found[0]


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU and a loaded extension as info sees them: torch.cuda.is_available() true, a device name,
    and dispatch holding a stand-in module for ls_fairseq._C."""
    ext = types.ModuleType("ls_fairseq._C")
    ext.__file__ = "/somewhere/ls_fairseq/_C.so"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(info, "gpu_name", lambda: "Test GPU")
    monkeypatch.setattr(dispatch, "_C", ext)
    monkeypatch.setattr(dispatch, "_C_ERROR", None)
    monkeypatch.delenv("LS_FAIRSEQ_REFERENCE", raising=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU state")
def test_cli_without_extension_is_readable_and_lists_every_op():
    proc = run([sys.executable, "-m", "ls_fairseq.info"], cwd=REPO,
               env={"LS_FAIRSEQ_REFERENCE": ""})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == "", "info wrote to stderr (tensorboardX missing? run scripts/setup_env.sh):\n" + proc.stderr
    lines = proc.stdout.splitlines()
    assert field(lines, "gpu") == "none"
    ext = field(lines, "extension")
    if torch.version.cuda is None:
        assert ext == "not built (this torch has no CUDA): every op runs its PyTorch reference"
    else:
        assert ext.startswith(("not built", "loaded")), ext
    assert "ImportError" not in ext and "cannot import" not in ext
    paths = op_lines(lines)
    assert list(paths) == EVERY_OP
    for op in dispatch.OPS:
        assert paths[op] == "reference (no GPU)"
    assert paths["linear"] == paths["residual"] == info.NO_KERNEL


def test_every_module_of_ops_is_listed():
    import pkgutil

    import ls_fairseq.ops

    modules = {m.name for m in pkgutil.iter_modules(ls_fairseq.ops.__path__)} - set(info.NOT_OPS)
    assert set(info.ops()) == modules | set(dispatch.OPS)
    assert info.ops()[:len(dispatch.OPS)] == list(dispatch.OPS)


def test_extension_loaded(fake_gpu):
    lines = info.report()
    assert field(lines, "gpu") == "Test GPU"
    assert field(lines, "extension") == "loaded (/somewhere/ls_fairseq/_C.so)"
    assert not any(line.startswith("forced") for line in lines)
    paths = op_lines(lines)
    assert list(paths) == EVERY_OP
    assert all(paths[op] == "kernel" for op in dispatch.OPS), paths
    assert paths["linear"] == paths["residual"] == info.NO_KERNEL


def test_forced_references(fake_gpu, monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", " softmax,layer_norm ")
    lines = info.report()
    assert field(lines, "forced") == "LS_FAIRSEQ_REFERENCE=softmax,layer_norm"
    paths = op_lines(lines)
    for op in dispatch.OPS:
        want = "reference (forced by LS_FAIRSEQ_REFERENCE)" if op in ("softmax", "layer_norm") else "kernel"
        assert paths[op] == want, (op, paths[op])
    monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", "all")
    paths = op_lines(info.report())
    assert all(paths[op] == "reference (forced by LS_FAIRSEQ_REFERENCE)" for op in dispatch.OPS), paths


def test_gpu_without_extension(fake_gpu, monkeypatch):
    monkeypatch.setattr(dispatch, "_C", None)
    monkeypatch.setattr(dispatch, "_C_ERROR", "cannot import name '_C' from 'ls_fairseq'")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ls_fairseq._C" else real(name, *a))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    lines = info.report()
    assert field(lines, "extension").startswith("not built: every op runs its PyTorch reference (setup.py")
    paths = op_lines(lines)
    assert all(paths[op] == "reference (no extension)" for op in dispatch.OPS), paths


def test_built_but_not_loadable(fake_gpu, monkeypatch):
    monkeypatch.setattr(dispatch, "_C", None)
    monkeypatch.setattr(dispatch, "_C_ERROR", "libcudart.so.12: cannot open shared object file")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "ls_fairseq._C" else real(name, *a))
    lines = info.report()
    assert field(lines, "extension") == "built but not loadable: libcudart.so.12: cannot open shared object file"


def test_unknown_forced_op_is_a_clear_error():
    proc = run([sys.executable, "-m", "ls_fairseq.info"], cwd=REPO, env={"LS_FAIRSEQ_REFERENCE": "softmax,sofmax"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "LS_FAIRSEQ_REFERENCE names unknown op(s) ['sofmax']" in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.gpu
def test_cli_on_a_gpu_with_the_extension():
    proc = run([sys.executable, "-m", "ls_fairseq.info"], cwd=REPO, env={"LS_FAIRSEQ_REFERENCE": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert field(lines, "gpu") == torch.cuda.get_device_name()
    assert field(lines, "extension").startswith("loaded ("), lines
    paths = op_lines(lines)
    assert list(paths) == EVERY_OP
    assert all(paths[op] == "kernel" for op in dispatch.OPS), paths
