"""scripts/parity.py --seeds: issue 35's one-sided convergence bounds, computed from kept run results."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import parity  # noqa: E402


def keep(out, name, seed, valid, bleu, losses):
    with open(os.path.join(out, "{}-s{}.result.json".format(name, seed)), "w") as f:
        json.dump(dict(valid_loss=valid, bleu=bleu, losses={str(u): v for u, v in losses.items()}), f)


def test_bounds_are_one_sided_and_use_stocks_seed_spread(tmp_path):
    # stock: valid mean 4.05, range 0.10 (above 1% of the mean); BLEU mean 10.2, range 0.4 (below 0.5);
    # losses at 250: mean 5.1, gap 0.2; at 100 (before --compare-from) far apart, not compared
    for seed, valid, bleu, l250 in ((1, 4.00, 10.0, 5.0), (2, 4.10, 10.4, 5.2), (3, 4.05, 10.2, 5.1)):
        keep(tmp_path, "stock-fp16", seed, valid, bleu, {100: 9.0 + seed, 250: l250})
    keep(tmp_path, "ls-ok", 1, 4.12, 9.8, {100: 20.0, 250: 5.25})
    keep(tmp_path, "ls-ok", 2, 4.14, 9.7, {100: 20.0, 250: 5.25})
    keep(tmp_path, "ls-worse", 1, 4.30, 10.0, {100: 9.0, 250: 5.5})
    keep(tmp_path, "ls-better", 1, 3.0, 30.0, {100: 1.0, 250: 1.0})
    report, text = parity.seed_report(str(tmp_path), compare_from=200)
    assert report["stock"] == "stock-fp16"
    assert report["valid_bound"] == pytest.approx(4.15) and report["bleu_bound"] == pytest.approx(9.7)
    ok, worse, better = (report["systems"][n] for n in ("ls-ok", "ls-worse", "ls-better"))
    assert ok["within_bounds"] and ok["seeds"] == [1, 2] and ok["intervals"] == [250]
    assert worse["within"] == dict(valid=False, bleu=True, losses=False) and worse["worst_interval"][0] == 250
    assert worse["worst_interval"][1] == pytest.approx(5.5 - 5.1 - 0.2)
    assert better["within_bounds"]  # better than stock is never a failure
    assert "no: valid, losses" in text and text.count("| ls-") == 3


def test_unscored_bleu_is_not_within_bounds(tmp_path):
    keep(tmp_path, "stock-fp16", 1, 4.0, None, {250: 5.0})
    keep(tmp_path, "ls-bf16-fp8", 1, 4.0, None, {250: 5.0})
    report, _ = parity.seed_report(str(tmp_path), compare_from=200)
    assert report["systems"]["ls-bf16-fp8"]["within"] == dict(valid=True, bleu=False, losses=True)


def test_without_a_stock_run_it_says_so(tmp_path):
    keep(tmp_path, "ls-bf16-fp8", 1, 4.0, 10.0, {250: 5.0})
    with pytest.raises(SystemExit, match="no stock run"):
        parity.seed_report(str(tmp_path), compare_from=200)
