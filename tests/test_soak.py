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


def test_wps_stretches_span_epochs_shorter_than_the_report_interval():
    """Epochs of 823 updates and a record every 1,000: each record counts only since the last epoch's
    end, so the stretch from one report to the next adds up the records in between."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import soak

    records = [dict(kind="interval", update=1000, epoch=2, tokens=100, seconds=1.0, captured_in_interval=0),
               dict(kind="epoch_end", update=1646, epoch=2, tokens=600, seconds=2.0, captured_in_interval=1),
               dict(kind="interval", update=2000, epoch=3, tokens=300, seconds=1.0, captured_in_interval=0),
               dict(kind="epoch_end", update=2469, epoch=3, reserved=1),  # an epoch that ended on a report
               dict(kind="interval", update=3000, epoch=4, tokens=500, seconds=2.0, captured_in_interval=0)]
    assert soak.windows(records) == [dict(start=1000, update=2000, epoch=3, wps=300.0, captured=1),
                                     dict(start=2000, update=3000, epoch=4, wps=250.0, captured=0)]
