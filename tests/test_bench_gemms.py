"""scripts/bench_gemms.py: the step's GEMM list and the table built from a CPU smoke run (no speed asserted)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_gemms  # noqa: E402

from ls_fairseq.flops import training_flops_per_target_token

NAMES = ["enc.qkv", "enc.out", "enc.fc1", "enc.fc2", "dec.self_qkv", "dec.self_out", "dec.cross_q", "dec.cross_kv",
         "dec.cross_out", "dec.fc1", "dec.fc2", "vocab"]


def test_step_gemms_are_the_model_s_linears_with_its_layouts_and_counts():
    tokens, src = 8192, 7648
    gemms = bench_gemms.step_gemms(tokens, src)
    by = {(g.name, g.phase): g for g in gemms}
    assert len(by) == len(gemms) == 3 * len(NAMES)
    assert sorted({g.name for g in gemms}) == sorted(NAMES)
    # forward x [M, in] @ W [out, in]^T; dgrad dy [M, out] @ W; wgrad dy^T @ x, contracting the tokens
    assert (by["enc.qkv", "fwd"].m, by["enc.qkv", "fwd"].n, by["enc.qkv", "fwd"].k) == (src, 3072, 1024)
    assert (by["dec.fc2", "dgrad"].m, by["dec.fc2", "dgrad"].n, by["dec.fc2", "dgrad"].k) == (tokens, 4096, 1024)
    assert (by["vocab", "wgrad"].m, by["vocab", "wgrad"].n, by["vocab", "wgrad"].k) == (32000, 1024, tokens)
    # every decoder layer's cross-attention keys and values: one GEMM on the encoder's output
    kv = by["dec.cross_kv", "fwd"]
    assert (kv.m, kv.n, kv.k, kv.count) == (src, 2 * 6 * 1024, 1024, 1)
    assert by["vocab", "fwd"].count == 1 and by["enc.fc1", "fwd"].count == by["dec.cross_q", "wgrad"].count == 6
    # post-LN: each block's first GEMM accumulates the residual's gradient (beta = 1); every wgrad accumulates
    starts = {"enc.qkv", "enc.fc1", "dec.self_qkv", "dec.cross_q", "dec.fc1"}
    for g in gemms:
        assert g.accumulates == (g.phase == "wgrad" or (g.phase == "dgrad" and g.name in starts)), (g.name, g.phase)
    # three GEMMs of equal FLOPs a linear; the sum is ls_fairseq.flops's count without attention's products
    # (with source lengths 0 and 1 its attention terms vanish; per target token, times the tokens)
    flops = sum(g.count * g.flops for g in gemms)
    expected = training_flops_per_target_token(1024, 4096, 6, 6, 32000, 0, 0, src / tokens) * tokens
    assert flops == pytest.approx(expected, rel=1e-12)


def test_cpu_tiny_run_builds_the_table(tmp_path):
    result = bench_gemms.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    assert [s["tokens"] for s in result["sizes"]] == [64, 128]
    with open(tmp_path / "gemms.json") as f:
        assert json.load(f)["sizes"][1]["tokens"] == 128
    md = (tmp_path / "gemms.md").read_text()
    for size in result["sizes"]:
        rows, summary = size["rows"], size["summary"]
        assert len(rows) == 3 * len(NAMES)
        for r in rows:
            assert r["bf16_ms"] > 0 and r["fp16_ms"] > 0 and r["bf16_tflops"] > 0
            assert r["e4m3_ms"] > 0 and r["e4m3_prep_ms"] > 0  # this torch has _scaled_mm on CPU
            assert (r.get("e5m2_ms") is not None) == (r["phase"] != "fwd")
            assert r["bf16_step_ms"] == pytest.approx(r["count"] * r["bf16_ms"])
            assert "| {} | {} | ({}, {}, {}) |".format(r["name"], r["phase"], r["m"], r["n"], r["k"]) in md
        assert sum(r["bf16_share"] for r in rows) == pytest.approx(1.0)
        assert summary["bf16_step_ms"] == pytest.approx(sum(r["bf16_step_ms"] for r in rows))
        fc1 = [r for r in rows if "bf16_bias_relu_epilogue_ms" in r]
        assert sorted(r["name"] for r in fc1) == ["dec.fc1", "enc.fc1"] and all(r["phase"] == "fwd" for r in fc1)
        # the scenarios: every GEMM of the named passes at its FP8 time, the others at bf16's / fp16's
        sc = summary["scenarios"]["fwd+dgrad fp8 (grads e5m2) vs bf16"]
        fp8 = sum(r["count"] * (r["e4m3_ms"] if r["phase"] == "fwd" else r["e5m2_ms"]) for r in rows if r["phase"] != "wgrad")
        wgrad = sum(r["bf16_step_ms"] for r in rows if r["phase"] == "wgrad")
        assert sc["step_ms"] == pytest.approx(fp8 + wgrad)
        assert sc["saved_ms"] == pytest.approx(summary["bf16_step_ms"] - fp8 - wgrad)
        assert len(summary["scenarios"]) == 8
        assert "{} target tokens".format(size["tokens"]) in md


def test_cpu_needs_tiny():
    with pytest.raises(SystemExit, match="add --tiny"):
        bench_gemms.main(["--device", "cpu"])
