import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, assert_close, check_kernel, drawn, grads, keep_mask, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_backward_reference, bias_act_dropout_forward_reference


def gelu_accurate(x):
    """fairseq's gelu_accurate (the tanh form; Hugging Face's gelu_new), as torch's tanh-approximate gelu."""
    return F.gelu(x, approximate="tanh")


FAIRSEQ_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_accurate": gelu_accurate}


@pytest.mark.parametrize("activation", list(FAIRSEQ_ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (2, 5, 1030)])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_matches_fairseq_activation(activation, shape, p):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    mask = keep_mask(shape, p) if p else None
    out = ops.bias_act_dropout(x, b, activation, p, True, mask)
    # fairseq's relu, its gelu (F.gelu, the exact erf form) and gelu_accurate (tanh) evaluated in fp64
    ref = FAIRSEQ_ACTIVATIONS[activation](x + b) * (mask.double() / (1 - p) if p else 1)
    assert_close(out, ref)
    dout = torch.randn_like(out)
    for g, e in zip(grads(out, (x, b), dout), grads(ref, (x, b), dout)):
        assert_close(g, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("activation", list(FAIRSEQ_ACTIVATIONS))
def test_gradcheck(activation):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    mask = keep_mask((4, 6), 0.25)
    assert torch.autograd.gradcheck(lambda x, b: ops.bias_act_dropout(x, b, activation, 0.25, True, mask), (x, b))


def test_gelu_accurate_is_fairseqs_formula():
    """The tanh form as fairseq's gelu_accurate writes it (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))))."""
    from fairseq.modules.gelu import gelu_accurate as fairseq_gelu_accurate

    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    assert_close(ops.bias_act_dropout(x[None], torch.zeros(1001, dtype=torch.float64), "gelu_accurate", 0.0, True),
                 fairseq_gelu_accurate(x)[None], rtol=1e-13, atol=1e-14)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_gelu_accurate_takes_the_reference_on_the_gpu(p):
    """No kernel has gelu_accurate: on CUDA tensors its forward and backward are the references' (bit for bit),
    the other activations still the kernels'."""
    from ls_fairseq.ops import bias_act_dropout as module

    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    b = torch.randn(256, device="cuda", requires_grad=True)
    mask = keep_mask((64, 256), p, "cuda") if p else None
    out = ops.bias_act_dropout(x, b, "gelu_accurate", p, True, mask)
    ref, _ = bias_act_dropout_forward_reference(x.detach(), b.detach(), "gelu_accurate", p, mask)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    dx, db = grads(out, (x, b), dout)
    rx, rb = bias_act_dropout_backward_reference(dout, x.detach(), b.detach(), mask, "gelu_accurate", p)
    assert torch.equal(dx, rx) and torch.equal(db, rb)
    assert module._route(x, "gelu") is module.BIAS_ACT_DROPOUT_ROUTE.kernel


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'swish' is not supported"):
        ops.bias_act_dropout(torch.randn(2, 3), torch.randn(3), "swish")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("rows,hidden,p", [(1, 4096, 0.0), (7, 1030, 0.1), (8191, 4096, 0.1)])
def test_kernel_matches_reference(dtype, activation, rows, hidden, p):
    x, dout = (torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(2))
    b = torch.randn(hidden, device="cuda").to(dtype)
    ext = kernel("bias_act_dropout", x)
    poison()
    out, dropout = ext.bias_act_dropout_forward(x, b, activation, p, None)
    poison()
    dx, db = ext.bias_act_dropout_backward(dout, x, b, dropout, activation, p, None)
    mask = drawn(dropout)  # the forward's keep-bits, which the backward drew again
    out64, _ = bias_act_dropout_forward_reference(x.double(), b.double(), activation, p, mask)
    dx64, db64 = bias_act_dropout_backward_reference(dout.double(), x.double(), b.double(), mask, activation, p)
    out_l, _ = bias_act_dropout_forward_reference(x, b, activation, p, mask)
    dx_l, db_l = bias_act_dropout_backward_reference(dout, x, b, mask, activation, p)
    for o, ref, low, name in ((out, out64, out_l, "out"), (dx, dx64, dx_l, "dx"), (db, db64, db_l, "dbias")):
        check_kernel(o, ref, low, name)


@pytest.mark.parametrize("activation,kept", [("relu", 1), ("gelu", 2)])
def test_backward_keeps_only_what_it_needs(activation, kept):
    """relu: only the output (which the FFN's second GEMM keeps anyway); gelu: x and the mask
    (and the bias parameter itself, no copy) on this reference path, x alone on the kernel's, whose
    backward draws the keep-bits again."""
    x = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = ops.bias_act_dropout(x, b, activation, 0.3, True, keep_mask((5, 8), 0.3))
    assert len(saved) == kept
    if activation == "relu":
        assert saved[0] is out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_autograd_path_on_the_gpu_matches_fp64(dtype, activation):
    """The op as the model calls it (relu's backward from the output) against fp64 on the same mask."""
    rows, hidden, p = 1031, 1030, 0.1
    x = torch.randn(rows, hidden, device="cuda").to(dtype).requires_grad_()
    b = torch.randn(hidden, device="cuda").to(dtype).requires_grad_()
    mask = keep_mask((rows, hidden), p, "cuda")
    dout = torch.randn(rows, hidden, device="cuda").to(dtype)
    kernel("bias_act_dropout", x)
    results = []
    for cast in (lambda t: t, lambda t: t.double(), None):
        if cast is None:  # PyTorch's own error in this precision: the reference in dtype
            out, _ = bias_act_dropout_forward_reference(x.detach(), b.detach(), activation, p, mask)
            results.append((out,) + bias_act_dropout_backward_reference(dout, x.detach(), b.detach(), mask, activation, p))
            continue
        xi, bi = cast(x.detach()).requires_grad_(), cast(b.detach()).requires_grad_()
        out = ops.bias_act_dropout(xi, bi, activation, p, True, mask)
        results.append((out,) + grads(out, (xi, bi), cast(dout)))
    for o, ref, low, name in zip(*results, ("out", "dx", "dbias")):
        check_kernel(o, ref, low, name)
