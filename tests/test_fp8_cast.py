"""The fp8_cast op (delayed-scaling FP8 casts), the FP8 GEMM, their scaling state, and ops.linear's FP8
path: the references against the rules written out, the CUDA kernel bit-equal to the reference (both
layouts, odd sizes, inf and NaN, empty and full histories), torch's FP8 GEMM against fp64 by the error
rule, and a model trained with --ls-fp8."""
import model_utils
import pytest
import torch
from helpers import check_kernel, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.fp8_cast import (
    FP8_CAST_ROUTE,
    LARGEST,
    Fp8Recipe,
    fp8_cast,
    fp8_cast_reference,
    fp8_fits,
    fp8_mm,
    fp8_mm_reference,
    finite_amax,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def state_of(history, amax=0.0, step_amax=0.0, device="cpu"):
    s = torch.zeros(len(history) + 2, device=device)
    s[: len(history)] = torch.tensor(history)
    s[-2] = step_amax
    return s


def test_reference_scales_by_the_history_and_saturates():
    x = torch.tensor([[1.0, -2.0, 1000.0, float("inf")], [float("nan"), 0.5, -1e6, 3.0]])
    state = state_of([10.0, 4.0, 0.0], step_amax=7.0)
    q, qT = fp8_cast(x, state, rowwise=True, transposed=True)
    s = 448.0 / 10.0
    back = q.float()
    assert back[0, 0] == torch.tensor(1.0 * s).to(E4M3).float()
    assert back[0, 2] == 448.0 and back[1, 2] == -448.0  # finite values saturate
    assert back[0, 3].isnan() and back[1, 0].isnan()  # e4m3 has no inf: inf and NaN come out NaN
    assert torch.equal(qT.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert state[-2] == 1e6  # the finite amax, above the step's 7
    assert state[-1] == torch.tensor(1.0) / torch.tensor(s)
    assert state[:3].tolist() == [10.0, 4.0, 0.0]  # the history is begin's to move


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_amax_in_chunks_is_the_whole_tensor_s(dtype):
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(37, 29, generator=g) * 100).to(dtype)
    x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] = float("inf")
    x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] = float("nan")
    finite = x.float()[torch.isfinite(x.float())]
    for chunk in (7, 64, x.numel(), 1 << 24):
        assert finite_amax(x, chunk) == finite.abs().max()
    assert finite_amax(x.t(), 5) == finite.abs().max()  # not contiguous
    assert finite_amax(torch.full((3,), float("nan"), dtype=dtype)) == 0 and finite_amax(x[:0]) == 0


def test_reference_e5m2_keeps_inf_and_an_empty_history_scales_by_one():
    x = torch.tensor([[3.0, float("-inf"), 1e9, 2.0**-20]])
    state = state_of([0.0, 0.0])
    q, empty = fp8_cast(x, state, e5m2=True)
    assert q.dtype == E5M2 and empty.numel() == 0
    back = q.float()[0]
    assert back[0] == 3.0 and back[1] == float("-inf") and back[2] == LARGEST[True] and back[3] == 0.0
    assert state[-1] == 1.0 and state[-2] == 1e9


def test_fp8_mm_reference_is_the_dequantised_product():
    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(32, 48, generator=g), torch.randn(16, 48, generator=g)
    sa, sw = state_of([4.0]), state_of([3.0])
    a8, _ = fp8_cast(a, sa)
    w8, _ = fp8_cast(w, sw)
    out = fp8_mm(a8, sa, w8.t(), sw, torch.float32)
    expected = (a8.double() * sa[-1].double()) @ (w8.double() * sw[-1].double()).t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    rel = (out - a @ w.t()).norm() / (a @ w.t()).norm()
    assert rel < 0.05, rel  # e4m3 keeps 3 mantissa bits: a few percent


def test_bad_input_is_named():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="state"):
        fp8_cast(x, torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[rows, cols\]"):
        fp8_cast(x.view(16), state_of([1.0]))
    with pytest.raises(ValueError, match="neither"):
        fp8_cast(x, state_of([1.0]), rowwise=False)
    a8, _ = fp8_cast(x, state_of([1.0]))
    with pytest.raises(ValueError, match="column-major"):
        fp8_mm(a8, state_of([1.0]), a8, state_of([1.0]), torch.float32)
    with pytest.raises(ValueError, match="history"):
        Fp8Recipe(history=0)
    assert fp8_fits(16, 32, 1024) and not fp8_fits(16, 24) and not fp8_fits(0)


@pytest.mark.parametrize("history", [1, 2, 3, 4, 16])
def test_recipe_puts_each_inverse_scale_on_a_16_byte_boundary(history):
    recipe = Fp8Recipe(history=history)
    recipe.reserve(5)
    recipe.begin(torch.device("cpu"))
    for i in range(5):
        row = recipe.row(i)
        assert row.numel() == history + 2 and row.is_contiguous() and row[-1].data_ptr() % 16 == 0


def test_recipe_moves_step_amaxes_into_the_history():
    recipe = Fp8Recipe(history=3)
    first = recipe.reserve(2)
    assert first == 0 and recipe.reserve(1) == 2
    recipe.begin(torch.device("cpu"))
    assert recipe.calibrating and recipe.state.shape == (3, 5)
    recipe.observe(0, torch.tensor([1.0, -5.0, float("inf")]))
    recipe.state[2, 3] = 2.0
    recipe.begin(torch.device("cpu"))
    assert not recipe.calibrating
    assert recipe.state[:, :4].tolist() == [[5.0, 0, 0, 0], [0, 0, 0, 0], [2.0, 0, 0, 0]]
    recipe.state[0, 3] = 6.0
    recipe.begin(torch.device("cpu"))
    assert recipe.state[:, :4].tolist() == [[6.0, 5.0, 0, 0], [0, 0, 0, 0], [2.0, 0, 0, 0]]


def _linear_case(seed, dtype=torch.float32, device="cpu", tokens=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, 64, generator=g).to(dtype).to(device).requires_grad_()
    w = (torch.randn(96, 64, generator=g) * 0.1).to(dtype).to(device).requires_grad_()
    dy = torch.randn(2, tokens // 2, 96, generator=g).to(dtype).to(device)
    return x, w, dy


def _run(x, w, dy, fp8):
    y = ops.linear(x, w, fp8=fp8)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@pytest.mark.parametrize("forward,dgrad", [(True, False), (False, True), (True, True)])
def test_linear_calibrates_then_runs_fp8_with_its_weight_gradient_unchanged(forward, dgrad):
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    x, w, dy = _linear_case(seed)
    recipe = Fp8Recipe(history=4, forward=["l"] * forward, dgrad=["l"] * dgrad)
    gemm = recipe.gemm("l")
    plain = _run(x, w, dy, None)
    recipe.begin(x.device)
    calibrating = _run(x, w, dy, gemm)
    for a, b in zip(calibrating, plain):
        assert torch.equal(a, b)  # the first pass only records amaxes
    amax = recipe.state[:, -2]
    assert amax[0] == (x.abs().max() if forward else 0) and amax[1] == w.abs().max()
    assert amax[2] == (dy.abs().max() if dgrad else 0)
    recipe.begin(x.device)
    y, dx, dw = _run(x, w, dy, gemm)
    assert torch.equal(dw, plain[2])  # the weight gradient stays in the run's dtype
    for got, ref, fp8, what in ((y, plain[0], forward, "y"), (dx, plain[1], dgrad, "dx")):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert (0 < rel < 0.08) if fp8 else rel == 0, (what, rel)
    # the same by hand: both operands quantised with the history's scales
    if forward:
        xs, ws = recipe.state[0].clone(), recipe.state[1].clone()
        x8, _ = fp8_cast_reference(x.detach().reshape(-1, 64), xs)
        w8, _ = fp8_cast_reference(w.detach(), ws)
        assert torch.equal(y.reshape(-1, 96), fp8_mm_reference(x8, xs, w8.t(), ws, torch.float32))


def test_linear_keeps_unfit_shapes_in_the_run_dtype():
    x, w, dy = _linear_case(3, tokens=20)  # 20 rows: not a multiple of 16
    recipe = Fp8Recipe(forward=["l"], dgrad=["l"])
    gemm = recipe.gemm("l")
    recipe.begin(x.device)
    recipe.begin(x.device)
    for a, b in zip(_run(x, w, dy, gemm), _run(x, w, dy, None)):
        assert torch.equal(a, b)


def test_first_pass_logs_each_gemms_shape_and_why_it_does_not_fit_once(caplog):
    recipe = Fp8Recipe(forward=["fits", "vocab", "tokens"], dgrad=["fits", "vocab"])
    g = torch.Generator().manual_seed(2)
    cases = {"fits": (48, 96), "vocab": (48, 2008), "tokens": (20, 96)}  # name: (tokens M, outputs N)
    gemms = {name: recipe.gemm(name) for name in cases}
    caplog.set_level("INFO", logger="ls_fairseq.ops.fp8_cast")
    for step in range(3):
        recipe.begin(torch.device("cpu"))
        for name, (m, n) in cases.items():
            x = torch.randn(2, m // 2, 64, generator=g, requires_grad=True)
            w = torch.randn(n, 64, generator=g, requires_grad=True)
            ops.linear(x, w, fp8=gemms[name]).sum().backward()
        if step == 0:
            assert not caplog.records  # the shapes are logged when the first step is done
    lines = {r.getMessage().split(":")[1].strip(): r.getMessage() for r in caplog.records}
    assert len(caplog.records) == 3 and set(lines) == set(cases)  # once, one line a name
    assert lines["fits"] == ("--ls-fp8: fits: forward x W^T in FP8 at [M x K x N] 48x64x96; "
                             "dgrad dY W in FP8 at [M x K x N] 48x96x64")
    assert "forward x W^T asked for FP8 but in the run's dtype: N = 2008 not a multiple of 16 (the dictionary's " \
        "size: fairseq-preprocess --padding-factor 16 makes it fit) ([M x K x N] 48x64x2008)" in lines["vocab"]
    assert "dgrad dY W asked for FP8 but in the run's dtype: K = 2008 not a multiple of 16" in lines["vocab"]
    assert "forward x W^T in FP8 where the batch's token count M is a multiple of 16" in lines["tokens"]
    assert "not the first batch's M = 20): [M x K x N] 20x64x96" in lines["tokens"]
    assert "dgrad" not in lines["tokens"]  # not asked for


def test_model_with_ls_fp8_trains_and_evaluates_in_the_run_dtype():
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    torch.manual_seed(seed)
    every = "qkv,out,q,kv,fc1,fc2,vocab"
    _, model, task = model_utils.build_pair(ls_fp8=True, ls_fp8_forward=every, ls_fp8_dgrad=every)
    net_input, target = model_utils.batch(task, B=4, S=8, T=8, seed=seed)  # 32 tokens a side: all GEMMs FP8
    # but the vocabulary's (44 words)
    assert model.fp8.rows == 3 * (2 * 4 + 3 * 6 + 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    model.train()
    for _ in range(6):
        out, _ = model(**net_input)
        loss = torch.nn.functional.cross_entropy(out.view(-1, out.shape[-1]), target.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert (model.fp8.state[:, 0] > 0).all()  # every tensor has a history
    model.eval()
    with torch.no_grad():
        a, _ = model(**net_input)
        model.fp8 = None
        b, _ = model(**net_input)
    assert torch.equal(a, b)


def test_unknown_gemm_names_are_a_clear_error():
    with pytest.raises(ValueError, match="ls-fp8-forward names unknown"):
        model_utils.build_pair(ls_fp8=True, ls_fp8_forward="qkv,ffn")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("rows,cols,layouts", [(1, 8, "r"), (37, 53, "r"), (4096, 1024, "r"), (3, 5, "rt"),
                                               (130, 67, "rt"), (1024, 4096, "t"), (64, 64, "rt")])
def test_kernel_is_bit_equal_to_the_reference(dtype, e5m2, rows, cols, layouts):
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * torch.rand(1, generator=g) * 50).to(dtype)
    flat = x.view(-1)
    flat[:: 97] *= 1e4  # beyond the scale: saturates
    if flat.numel() > 8:
        flat[3], flat[5], flat[7] = float("inf"), float("-inf"), float("nan")
    x = x.cuda()
    rowwise, transposed = "r" in layouts, "t" in layouts
    for history in ([0.0, 0.0], [3.5, 40.0, 1.0]):
        state = state_of(history, step_amax=0.25, device="cuda")
        ref_state = state.clone()
        kernel("fp8_cast", x)
        poison()
        q, qT = fp8_cast(x, state, e5m2, rowwise, transposed)
        rq, rqT = fp8_cast_reference(x, ref_state, e5m2, rowwise, transposed)
        for got, ref in ((q, rq), (qT, rqT)):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got.float().isnan(), ref.float().isnan())
            finite = ~ref.float().isnan()
            assert torch.equal(got.view(torch.uint8)[finite], ref.view(torch.uint8)[finite])
        assert torch.equal(state, ref_state), (state, ref_state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(16, 32, 48), (1024, 1024, 3072), (4096, 4096, 1024)])
def test_fp8_gemm_against_fp64(dtype, m, k, n):
    """torch's FP8 GEMM on the quantised operands against their product in fp64: within twice the
    error of the reference (fp32 accumulation, then the run's dtype)."""
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=g).to(dtype).cuda(), torch.randn(n, k, generator=g).to(dtype).cuda()
    sa, sw = state_of([a.abs().max().item()], device="cuda"), state_of([w.abs().max().item()], device="cuda")
    a8, _ = fp8_cast(a, sa)
    w8, _ = fp8_cast(w, sw)
    assert FP8_CAST_ROUTE.pick(sa)[1] is not fp8_mm_reference
    out = fp8_mm(a8, sa, w8.t(), sw, dtype)
    ref64 = (a8.double() * sa[-1].double()) @ (w8.double() * sw[-1].double()).t()
    check_kernel(out, ref64, fp8_mm_reference(a8, sa, w8.t(), sw, dtype), "fp8_mm")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_linear_on_the_gpu_matches_the_reference_path(dtype, monkeypatch):
    """ops.linear's FP8 forward and input gradient: the GPU path (kernel casts, torch's FP8 GEMM)
    against the reference path on the same GPU tensors, within twice the reference's error against fp64."""
    seed = torch.randint(0, 2**31, ()).item()
    print("seed", seed)
    x, w, dy = _linear_case(seed, dtype, "cuda", tokens=1024)
    results = []
    for forced in ("", "fp8_cast"):
        monkeypatch.setenv("LS_FAIRSEQ_REFERENCE", forced)
        recipe = Fp8Recipe(history=4, forward=["l"], dgrad=["l"])
        gemm = recipe.gemm("l")
        recipe.begin(x.device)
        _run(x, w, dy, gemm)
        recipe.begin(x.device)
        results.append((_run(x, w, dy, gemm), recipe.state.clone()))
    (got, state), (ref, ref_state) = results
    assert torch.equal(state, ref_state)
    x8, _ = fp8_cast_reference(x.detach().reshape(-1, 64), state[0].clone())
    w8, _ = fp8_cast_reference(w.detach(), state[1].clone())
    y64 = (x8.double() * state[0, -1].double()) @ (w8.double() * state[1, -1].double()).t()
    check_kernel(got[0].reshape(-1, 96), y64, ref[0].reshape(-1, 96), "y")
    dy8, _ = fp8_cast_reference(dy.reshape(-1, 96), state[2].clone(), e5m2=True)
    dx64 = (dy8.double() * state[2, -1].double()) @ (w8.double() * state[1, -1].double())
    check_kernel(got[1].reshape(-1, 64), dx64, ref[1].reshape(-1, 64), "dx")
    assert torch.equal(got[2], ref[2])
