"""scripts/bench_hf.py end to end on the CPU with tiny models (--tiny): every family's rows, a failing
configuration reported in the table instead of stopping the run, the short table last (no speed asserted)."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_hf  # noqa: E402


def run(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["bench_hf.py", "--tiny", "--steps", "2", "--warmup", "1"] + list(argv))
    bench_hf.main()
    return capsys.readouterr().out


def test_every_family_runs_and_a_failing_configuration_is_a_row_of_the_table(monkeypatch, capsys, tmp_path):
    made = bench_hf.make_model

    def broken_for_gpt2_ls(family, attn, tiny):  # a configuration that fails, as a compile error would
        model = made(family, attn, tiny)
        if family == "gpt2" and attn == "sdpa":
            model.forward = lambda **kwargs: (_ for _ in ()).throw(RuntimeError("a broken configuration"))
        return model

    monkeypatch.setattr(bench_hf, "make_model", broken_for_gpt2_ls)
    out = run(monkeypatch, capsys, "--configs", "hf-eager,ls-eager", "--runs", "2", "--json", str(tmp_path / "r.json"))
    rows = {(r["family"], r["config"]): r for r in json.loads((tmp_path / "r.json").read_text())}
    assert set(rows) == {(f, c) for f in bench_hf.FAMILIES for c in ("hf-eager", "ls-eager")}
    for key, row in rows.items():
        if key == ("gpt2", "ls-eager"):
            assert row["status"] == "failed" and "a broken configuration" in row["error"], row
        else:
            assert "error" not in row and len(row["runs_ms"]) == 2 and row["loss"] > 0, row
    short = out.strip().splitlines()[-6:]  # the short table last: header, rule, one row a family
    assert short[0] == "| ms/step | hf-eager | ls-eager |"
    assert short[4].startswith("| gpt2 (32 x 2) | ") and short[4].endswith(" | failed |")


def test_compiled_configurations_run_once_and_the_budget_stops_the_rest(monkeypatch, capsys, tmp_path):
    out = run(monkeypatch, capsys, "--families", "vit", "--configs", "ls-eager,ls-compile", "--compile-backend",
              "aot_eager", "--json", str(tmp_path / "r.json"))
    rows = {r["config"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert len(rows["ls-eager"]["runs_ms"]) == 3 and len(rows["ls-compile"]["runs_ms"]) == 1, rows
    assert out.strip().splitlines()[-1].startswith("| vit (17 x 2) | ")
    run(monkeypatch, capsys, "--families", "vit", "--configs", "hf-sdpa", "--budget-s", "0", "--json",
        str(tmp_path / "r.json"))
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["status"] == "not run", row
