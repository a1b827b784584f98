import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

# Without a GPU, Triton's kernels run in its interpreter on CPU tensors (numpy), so that the tests check
# the very kernel code the GPU runs; the variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "ls_fairseq")

# Every test draws its random inputs from a seed of its own: a fresh one per test, or the value of
# this variable for every test, which replays a failure (a failing test's report names its seed).
SEED_ENV = "LS_FAIRSEQ_TEST_SEED"


def fixed_seed():
    """The seed that LS_FAIRSEQ_TEST_SEED sets for every test, or None when it is unset or empty."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return None
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**32:
        raise pytest.UsageError("{} must be an integer in [0, 2**32), got {!r}".format(SEED_ENV, value))
    return seed


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled extension (skipped without a GPU)")
    config.addinivalue_line("markers", "slow: end-to-end runs of fairseq's command-line tools")
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs the group's tests in one worker, so "
                                       "that the fixtures they share are built once")
    fixed_seed()  # a malformed value stops the run before any test
    share_the_cores()


def share_the_cores():
    """Under pytest-xdist (scripts/test.sh runs one worker per core), each worker and the commands it
    starts get their share of the cores as torch threads (OMP_NUM_THREADS, unless set): every worker
    with every core's threads oversubscribes the machine, and torch's idle threads spin."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))
    torch.set_num_threads(int(threads))


def pytest_report_header(config):
    seed = fixed_seed()
    if seed is None:
        return "random seeds: a new one per test, named in its report when it fails ({}=N replays it)".format(
            SEED_ENV)
    return "random seeds: {}={} for every test".format(SEED_ENV, seed)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    """Seeds torch (CPU and CUDA), numpy and random for the test, and records the seed on the test's
    item (a failure's report shows it; JUnit XML gets it as a property)."""
    seed = fixed_seed()
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    request.node.ls_seed = seed
    request.node.user_properties.append(("seed", seed))
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "ls_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", "seed {}; to replay: {}={} python -m pytest '{}'".format(
            seed, SEED_ENV, seed, item.nodeid)))


def run(cmd, **kw):
    """Run a command, failing the test with its output when it fails."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(kw.pop("env", {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    return proc


def bin_path(name):
    """A console script of the interpreter running the tests (fairseq-train, ...), else the one on PATH
    (where fairseq is importable without being installed, its scripts live elsewhere)."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else shutil.which(name) or beside


def to_stock(checkpoint, folder):
    """checkpoint converted to stock fairseq's transformer by ``python -m ls_fairseq.convert to-fairseq``,
    written as folder/stock.pt."""
    path = folder / "stock.pt"
    proc = run([bin_path("python"), "-m", "ls_fairseq.convert", "to-fairseq", str(checkpoint), str(path)])
    assert proc.returncode == 0, proc.stderr
    return path


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
