"""scripts/fuzz_ops.py on the CPU, where both sides run the references: the script runs every op,
writes its results and exits 0; a replay runs the one case; an unknown op is refused by name."""
import json
import os
import sys

from conftest import REPO, run

SCRIPT = os.path.join(REPO, "scripts", "fuzz_ops.py")


def test_every_op_runs_and_reports(tmp_path):
    proc = run([sys.executable, SCRIPT, "--device", "cpu", "--cases", "3", "--seed", "11", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    from ls_fairseq.ops import dispatch

    assert list(results["ops"]) == list(dispatch.OPS) and results["seed"] == 11
    exact = {"beam_select", "beam_advance", "fp8_cast"}  # equalities (and, on the CPU, identical sums): a ratio of 0 or inf
    for op, r in results["ops"].items():
        assert r["cases"] == 3 and r["mismatches"] == 0, (op, r)
        assert r["worst_ratio"] == 0 if op in exact else 0 < r["worst_ratio"] <= 1, (op, r)
    cases = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    assert len(cases) == 3 * len(dispatch.OPS) and all(c["checks"] for c in cases)
    assert proc.stdout.strip().splitlines()[-1].startswith(dispatch.OPS[-1] + " ")  # the table comes last


def test_a_replay_runs_the_one_case_with_the_same_draws(tmp_path):
    params = []
    for sub in ("a", "b"):
        proc = run([sys.executable, SCRIPT, "--device", "cpu", "--seed", "11", "--ops", "softmax", "--case", "2",
                    "--out", str(tmp_path / sub)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        (case,) = [json.loads(line) for line in (tmp_path / sub / "cases.jsonl").read_text().splitlines()]
        params.append((case["case"], case["params"], case["checks"]))
    assert params[0] == params[1] and params[0][0] == 2


def test_workers_run_the_same_cases_as_one_process(tmp_path):
    """--jobs splits the ops over processes; the cases drawn, their checks and the table are those of
    one process, in the order the ops were asked for."""
    found = {}
    for jobs in (1, 2):
        out = tmp_path / "jobs{}".format(jobs)
        proc = run([sys.executable, SCRIPT, "--device", "cpu", "--cases", "2", "--seed", "5", "--jobs", str(jobs),
                    "--ops", "softmax,layer_norm,beam_select", "--out", str(out)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        cases = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
        found[jobs] = sorted((c["op"], c["case"], json.dumps(c["params"], sort_keys=True)) for c in cases)
        assert list(json.loads((out / "results.json").read_text())["ops"]) == ["softmax", "layer_norm", "beam_select"]
        assert [line.split()[0] for line in proc.stdout.strip().splitlines()[-3:]] == ["softmax", "layer_norm",
                                                                                     "beam_select"]
    assert found[1] == found[2] and len(found[1]) == 6


def test_an_unknown_op_is_named(tmp_path):
    proc = run([sys.executable, SCRIPT, "--device", "cpu", "--ops", "softmax,gemm", "--out", str(tmp_path)])
    assert proc.returncode == 2 and "unknown op(s) gemm" in proc.stderr
