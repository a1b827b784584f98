import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "ls_fairseq")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled extension (skipped without a GPU)")
    config.addinivalue_line("markers", "slow: end-to-end runs of fairseq's command-line tools")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


def run(cmd, **kw):
    """Run a command, failing the test with its output when it fails."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(kw.pop("env", {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    return proc


def bin_path(name):
    """A console script of the interpreter running the tests (fairseq-train, ...)."""
    return os.path.join(os.path.dirname(sys.executable), name)


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """A small binarized en-de data set made by the recipe's offline prepare step
    from the first lines of the embedded corpus."""
    import gzip

    root = tmp_path_factory.mktemp("corpus")
    src = root / "text"
    src.mkdir()
    sizes = {"train": 3000, "valid": 200, "test": 200}
    for split, n in sizes.items():
        for lang in ("en", "de"):
            with gzip.open(os.path.join(REPO, "data", "lohelp", "{}.{}.gz".format(split, lang)), "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            (src / "{}.{}".format(split, lang)).write_text("".join(lines), encoding="utf-8")
    work = root / "work"
    proc = run(
        ["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from", str(src), "--work", str(work),
         "--vocab-size", "600", "--ratio", "2.5"],
        env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work
