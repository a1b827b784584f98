"""scripts/soak.py's smoke mode: a tiny model on the CPU through ls-fairseq-train's training path,
its records (intervals, an epoch's end, the last partial interval) and summary."""
import json
import os
import sys

from conftest import REPO, run


def test_soak_smoke_run_records_and_summarizes(tmp_path):
    proc = run([sys.executable, os.path.join(REPO, "scripts", "soak.py"), "--cpu", "--updates", "40",
                "--report-every", "8", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("interval") == 5 and "epoch_end" in kinds, kinds
    intervals = [r for r in records if r["kind"] == "interval"]
    assert [r["update"] for r in intervals] == [8, 16, 24, 32, 40]
    assert all(r["wps"] > 0 and r["nonfinite_losses"] == 0 and r["steps"] > 0 for r in intervals)
    assert records[0]["epoch"] == 1 and max(r["epoch"] for r in records) >= 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["updates"] == 40 and summary["epochs_done"] >= 1 and summary["distinct_shapes"] > 1
    assert summary["checks"] == {"no_nonfinite_loss": True, "trained": True}
    assert "captured graphs 0" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("checks:")
