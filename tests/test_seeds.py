"""The tests' random seeds (conftest.py): a failing test's report names its seed, and
LS_FAIRSEQ_TEST_SEED=N replays it, the same random inputs as in the failed run."""
import os
import re
import shutil
import sys

from conftest import SEED_ENV, run

# A test that fails and prints its first random draws of torch, numpy and random.
FAILING = '''
import random

import numpy as np
import torch


def test_draws():
    print("draws", torch.rand(3).tolist(), np.random.rand(), random.random())
    assert False
'''


def pytest_in(tmp_path, seed):
    """Runs the failing test in its own pytest process under this repository's conftest.py."""
    if not (tmp_path / "conftest.py").exists():
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py"), tmp_path)
        (tmp_path / "test_draws.py").write_text(FAILING)
    env = {SEED_ENV: "" if seed is None else str(seed)}
    # (not -q: the run's header names the seeds)
    proc = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_draws.py"], cwd=tmp_path, env=env)
    return proc.stdout + proc.stderr


def draws(output):
    found = re.findall(r"^draws .*$", output, re.M)
    assert len(found) == 1, output[-3000:]
    return found[0]


def test_a_failure_names_its_seed_and_the_variable_replays_it(tmp_path):
    first = pytest_in(tmp_path, None)
    assert "random seeds: a new one per test" in first, first[-3000:]
    named = re.findall(r"seed (\d+); to replay: {}=(\d+) python -m pytest".format(SEED_ENV), first)
    assert len(named) == 1 and named[0][0] == named[0][1], first[-3000:]
    seed = int(named[0][0])
    replay = pytest_in(tmp_path, seed)
    assert "random seeds: {}={} for every test".format(SEED_ENV, seed) in replay, replay[-3000:]
    assert "seed {};".format(seed) in replay, replay[-3000:]
    assert draws(replay) == draws(first)
    # another seed draws other inputs
    assert draws(pytest_in(tmp_path, (seed + 1) % 2**32)) != draws(first)


def test_a_malformed_seed_stops_the_run_with_a_message_naming_the_variable(tmp_path):
    output = pytest_in(tmp_path, "twelve")
    assert "{} must be an integer in [0, 2**32), got 'twelve'".format(SEED_ENV) in output, output[-3000:]
    assert "draws" not in output
