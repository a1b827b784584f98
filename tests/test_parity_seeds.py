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
    assert report["baseline"] == "stock-fp16"
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


def fake_runs(monkeypatch):
    """parity's processes replaced: each training's command recorded, its log two intervals and a validation."""
    cmds = []
    log = ("train_inner | epoch 001: loss=6.5, nll_loss=6.0, wpb=3000, num_updates=50\n"
           "train_inner | epoch 001: loss=5.5, nll_loss=5.0, wpb=3100, num_updates=100\n"
           "valid on 'valid' subset | loss 5.25 | nll_loss 4.9\n")
    monkeypatch.setattr(parity, "start", lambda cmd, path: cmds.append(cmd) or cmd)
    monkeypatch.setattr(parity, "finish", lambda proc, path: log)
    monkeypatch.setattr(parity, "keep_hypotheses", lambda *a: None)
    monkeypatch.setattr(parity, "bleu", lambda out, data, name: 12.5)
    monkeypatch.setattr(parity, "sh", lambda cmd, path: pytest.fail("no stock initial weights without stock: "
                                                                       + " ".join(cmd)))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    return cmds


CPU_MAIN = ["--arch", "ls_transformer", "--width", "128", "--ffn", "256", "--layers", "2", "--heads", "4",
            "--max-tokens", "4096", "--lr", "4e-3", "--warmup-updates", "200", "--dropout", "0.1",
            "--clip-norm", "1.0", "--updates", "1200"]


def option(cmd, name):
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]  # the last occurrence's value: argparse's


def test_cpu_systems_by_name_against_a_named_baseline_at_the_given_model(tmp_path, monkeypatch):
    cmds = fake_runs(monkeypatch)
    args = parity.parse(["--out", str(tmp_path), "--seeds", "1", "--systems", "ls-fp32-fp8", "--baseline", "ls-fp32"]
                        + CPU_MAIN)
    parity.train_seeds(args, str(tmp_path / "data"))
    trains = [c for c in cmds if "ls_fairseq.train" in c]
    assert len(trains) == 2 == len(cmds) - 2  # the baseline, missing, first; then the system; 2 generations
    names = [os.path.basename(option(c, "--save-dir")) for c in trains]
    assert names == ["ls-fp32-s1", "ls-fp32-fp8-s1"]
    for c in trains:
        assert "--restore-file" not in c and "--reset-optimizer" not in c  # each from its seed's initialisation
        assert option(c, "--arch") == "ls_transformer" and option(c, "--max-tokens") == "4096"
        for side in ("encoder", "decoder"):
            assert option(c, "--{}-embed-dim".format(side)) == "128" and option(c, "--{}-layers".format(side)) == "2"
            assert option(c, "--{}-ffn-embed-dim".format(side)) == "256"
            assert option(c, "--{}-attention-heads".format(side)) == "4"
        assert (option(c, "--lr"), option(c, "--warmup-updates"), option(c, "--dropout")) == ("0.004", "200", "0.1")
        assert option(c, "--clip-norm") == "1.0" and option(c, "--max-update") == "1200"
        assert c[-2:] == ["--seed", "1"] and "--cpu" in c
    assert "--ls-fp8" not in trains[0] and "--required-seq-len-multiple" not in trains[0]
    assert "--ls-fp8" in trains[1] and option(trains[1], "--required-seq-len-multiple") == "16"
    with open(tmp_path / "ls-fp32-fp8-s1.result.json") as f:
        kept = json.load(f)
    assert kept["valid_loss"] == 5.25 and kept["bleu"] == 12.5 and kept["wpb"] == 3050.0
    # a second call into the folder trains only what it lacks: the control, not the baseline again
    parity.train_seeds(parity.parse(["--out", str(tmp_path), "--seeds", "1", "--systems", "ls-fp32-pad16",
                                     "--baseline", "ls-fp32"] + CPU_MAIN), str(tmp_path / "data"))
    assert [os.path.basename(option(c, "--save-dir")) for c in cmds[4:] if "ls_fairseq.train" in c] == ["ls-fp32-pad16-s1"]
    report, text = parity.seed_report(str(tmp_path), compare_from=50, baseline="ls-fp32")
    assert report["baseline"] == "ls-fp32" and set(report["systems"]) == {"ls-fp32-fp8", "ls-fp32-pad16"}
    assert "| ls-fp32 | 1 |" in text


def test_unknown_or_gpu_only_systems_are_named(tmp_path, monkeypatch):
    fake_runs(monkeypatch)
    for systems, message in (("ls-fp99", "unknown system ls-fp99"), ("ls-bf16-fp8", "ls-bf16-fp8 needs a GPU")):
        with pytest.raises(SystemExit, match=message):
            parity.train_seeds(parity.parse(["--out", str(tmp_path), "--seeds", "1", "--systems", systems]), "data")
    with pytest.raises(SystemExit, match="no ls-fp32 run in"):
        parity.seed_report(str(tmp_path), compare_from=50, baseline="ls-fp32")


def test_defaults_keep_the_gpu_protocol():
    args = parity.parse(["--out", "x", "--seeds", "1"])
    assert parity.chosen_systems(args, gpu=True) == ("stock-fp16", ["ls-fp16-master", "ls-bf16-master"])
    assert parity.chosen_systems(args, gpu=False) == ("stock-fp32", ["ls-fp32"])
    common, stock, ls = parity.run_options(True, args)
    assert option(stock, "--arch") == "transformer_wmt_en_de" and "--fp16" in stock
    assert option(ls, "--arch") == "ls_transformer_wmt_en_de" and "--encoder-layers" not in ls
    assert option(common, "--max-tokens") == "8192" and option(common, "--warmup-updates") == "1000"
