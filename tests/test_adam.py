"""The adam op: the workspace update kernel against its reference (GPU), and the
reference's own contract (CPU: see also test_ls_adam.py for fairseq parity)."""
import pytest
import torch
from helpers import DTYPES, kernel, rel_error

from ls_fairseq import ops
from ls_fairseq.ops.adam import adam_step_reference, grad_norm_reference


def state(n, dtype, device, master):
    p = torch.randn(n, device=device).to(dtype)
    return dict(
        param=p, grad=(torch.randn(n, device=device) * 100).to(dtype), exp_avg=torch.randn(n, device=device) * 0.1,
        exp_avg_sq=torch.rand(n, device=device) * 0.1, master=p.float().clone() if master else None,
    )


ARGS = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, step=7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 4097, 1000003])
@pytest.mark.parametrize("master,decoupled,wd", [(False, True, 0.0), (True, True, 0.01), (False, False, 0.01)])
def test_kernel_matches_reference(dtype, n, master, decoupled, wd):
    a = state(n, dtype, "cuda", master)
    b = {k: (v.clone() if v is not None else None) for k, v in a.items()}
    ext = kernel("adam", a["param"])
    scale = torch.tensor(1 / 100.0, device="cuda")  # a device scalar: no host sync
    ext.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["master"], ARGS["lr"], ARGS["beta1"],
                  ARGS["beta2"], ARGS["eps"], wd, ARGS["step"], scale, decoupled, None)
    adam_step_reference(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], b["master"], ARGS["lr"], ARGS["beta1"],
                        ARGS["beta2"], ARGS["eps"], wd, ARGS["step"], 1 / 100.0, decoupled, None)
    for key in ("exp_avg", "exp_avg_sq", "master"):
        if a[key] is not None:
            assert rel_error(a[key], b[key]) < 1e-5, key
    # parameters: at most one rounding step apart in the storage precision
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert ((a["param"].float() - b["param"].float()).abs() <= ulp * b["param"].float().abs() + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_noop_flag_leaves_everything_untouched(dtype):
    a = state(10001, dtype, "cuda", True)
    before = {k: v.clone() for k, v in a.items()}
    ext = kernel("adam", a["param"])
    ext.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["master"], 1e-3, 0.9, 0.98, 1e-8, 0.01, 3,
                  1.0, True, torch.ones((), device="cuda"))
    for k in a:
        assert torch.equal(a[k], before[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4097, 10_000_019])
def test_kernel_grad_norm(dtype, n):
    g = torch.randn(n, device="cuda").to(dtype)
    ext = kernel("adam", g)
    assert rel_error(ext.grad_norm(g), grad_norm_reference(g.double())) < 1e-5
    g[n // 2] = float("inf")
    assert torch.isinf(ext.grad_norm(g))


def test_reference_noop_flag_and_sizes_on_cpu():
    a = state(33, torch.float16, "cpu", False)
    before = {k: v.clone() for k, v in a.items() if v is not None}
    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], weight_decay=0.0, noop_flag=torch.ones(()), **ARGS)
    for k in before:
        assert torch.equal(a[k], before[k])
    with pytest.raises(ValueError, match="exp_avg has 3 elements"):
        ops.adam_step(a["param"], a["grad"], torch.zeros(3), a["exp_avg_sq"], weight_decay=0.0, **ARGS)
