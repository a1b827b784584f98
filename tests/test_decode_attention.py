import pytest
import torch
from helpers import check_kernel, kernel, poison

from ls_fairseq.ops.decode_attention import DECODE_ATTENTION_ROUTE, decode_attention, decode_attention_reference


def inputs(N, H, D, layers, length, capacity, dtype=torch.float32, device="cpu", slots=None):
    """q [N, H, 1, D] as split_heads leaves it (a view of [3, N, 1, H, D]), a cache of random keys and
    values, and an origin table whose positions come from random slots (and garbage past ``length``)."""
    slots = slots or N + 3
    q = torch.randn(3, N, 1, H, D, dtype=dtype, device=device)[0].permute(0, 2, 1, 3) * D**-0.5
    cache = torch.randn(capacity, 2 * layers, slots, H, D, dtype=dtype, device=device)
    origin = torch.randint(0, slots, (N, capacity), dtype=torch.int32, device=device)
    return q, cache, origin


def independent(q, cache, layer, origin, length):
    """fp64, one hypothesis and head at a time: the keys and values picked position by position."""
    N, H, _, D = q.shape
    out = torch.empty(N, H, 1, D, dtype=torch.float64)
    c = cache.double().cpu()
    for n in range(N):
        slots = origin[n, :length].long().cpu()
        keys = torch.stack([c[p, 2 * layer, slots[p]] for p in range(length)])  # [T, H, D]
        values = torch.stack([c[p, 2 * layer + 1, slots[p]] for p in range(length)])
        for h in range(H):
            w = torch.softmax(keys[:, h] @ q[n, h, 0].double().cpu(), dim=0)
            out[n, h, 0] = w @ values[:, h]
    return out


@pytest.mark.parametrize("N,H,D,layers,layer,length", [(1, 1, 8, 1, 0, 1), (5, 3, 16, 2, 1, 7), (4, 2, 64, 3, 2, 40),
                                                       (3, 4, 12, 1, 0, 129)])
def test_reference_equals_an_independent_formulation(N, H, D, layers, layer, length):
    q, cache, origin = inputs(N, H, D, layers, length, length + 5, torch.float64)
    out = decode_attention(q, cache, layer, origin, length)
    torch.testing.assert_close(out, independent(q, cache, layer, origin, length), rtol=1e-10, atol=1e-10)


def step_keys_values(q):
    """Random k and v laid out as q (views of one [3, N, 1, H, D] buffer, as split_heads leaves them)."""
    N, H, _, D = q.shape
    qkv = torch.randn(3, N, 1, H, D, dtype=q.dtype, device=q.device)
    return qkv[1].permute(0, 2, 1, 3), qkv[2].permute(0, 2, 1, 3)


def test_reference_writes_the_steps_keys_and_values():
    """Given the step's k and v, the cache holds them at position length - 1 of slots 0..N-1 (nothing else
    changes), and the output is the attention over the cache so written."""
    q, cache, origin = inputs(4, 2, 16, 2, 9, 12, torch.float64, slots=6)
    origin[:, 8] = torch.arange(4, dtype=torch.int32)
    k, v = step_keys_values(q)
    written = cache.clone()
    written[8, 2, :4], written[8, 3, :4] = k[:, :, 0], v[:, :, 0]
    out = decode_attention(q, cache, 1, origin, torch.tensor(9), k, v)
    assert torch.equal(cache, written)
    torch.testing.assert_close(out, independent(q, written, 1, origin, 9), rtol=1e-10, atol=1e-10)


def test_rejects_bad_input():
    q, cache, origin = inputs(3, 2, 8, 2, 4, 6)
    with pytest.raises(ValueError, match="q"):
        decode_attention(q[:, :, 0], cache, 0, origin, 4)
    with pytest.raises(ValueError, match="cache"):
        decode_attention(q, cache[..., :4], 0, origin, 4)
    with pytest.raises(ValueError, match="layer 2 of 2"):
        decode_attention(q, cache, 2, origin, 4)
    with pytest.raises(ValueError, match="length 7"):
        decode_attention(q, cache, 0, origin, 7)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, cache, 0, origin.long(), 4)
    with pytest.raises(ValueError, match="origin"):
        decode_attention(q, cache, 0, origin[:2], 4)
    k, v = step_keys_values(q)
    with pytest.raises(ValueError, match="come together"):
        decode_attention(q, cache, 0, origin, 4, k)
    with pytest.raises(ValueError, match="k .* and v"):
        decode_attention(q, cache, 0, origin, 4, k[:2], v[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,H,D,length", [(1, 1, 64, 1), (7, 3, 32, 13), (6, 4, 64, 32), (3, 4, 32, 33),
                                          (13, 16, 64, 201), (5, 5, 128, 1031), (3, 2, 256, 67), (2, 3, 64, 2500)])
def test_kernel_against_fp64(dtype, N, H, D, length):
    """The kernel against the fp64 formulation, by the error rule (fp32 at most 1e-5; fp16/bf16 at most
    twice PyTorch's error in the same precision, its attention over the same gathered keys); lengths
    past one chunk of 32 positions (a lane each) take the online softmax's rescaling."""
    layers, layer = 3, 1
    q, cache, origin = inputs(N, H, D, layers, length, length + 3, dtype, "cuda")
    kernel("decode_attention", q)
    assert DECODE_ATTENTION_ROUTE.pick(q) is not decode_attention_reference
    poison()
    out = decode_attention(q, cache, layer, origin, length)
    ref64 = independent(q, cache, layer, origin, length) if N * length <= 20000 else \
        decode_attention_reference(q.double(), cache.double(), layer, origin, length)
    from ls_fairseq.ops.decode_attention import gather_history

    keys, values = gather_history(cache, layer, origin, length)
    lowp = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=1.0)
    check_kernel(out, ref64, lowp, "decode_attention {} N={} H={} D={} T={}".format(dtype, N, H, D, length))


@pytest.mark.gpu
def test_kernel_reads_only_the_hypotheses_rows_of_a_longer_origin():
    """origin with more rows and positions than asked for (the generator's table after sentences left
    the batch), and a cache with more slots than hypotheses: the same as the reference."""
    q, cache, origin = inputs(6, 4, 64, 2, 20, 64, torch.float16, "cuda", slots=24)
    origin = torch.cat([origin, origin[:3]])
    out = decode_attention(q, cache, 1, origin, 20)
    ref = decode_attention_reference(q.float(), cache.float(), 1, origin, 20)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_kernel_reads_the_length_from_the_device():
    """A length given as a device tensor (a CUDA graph's step): the same output as the same length given
    as an int, at lengths within and past one chunk."""
    q, cache, origin = inputs(9, 4, 64, 2, 1500, 1503, torch.float16, "cuda")
    for length in (1, 37, 1500):
        out = decode_attention(q, cache, 1, origin, torch.tensor(length, device="cuda"))
        assert torch.equal(out, decode_attention(q, cache, 1, origin, length))


@pytest.mark.gpu
def test_kernel_clamps_a_device_length_past_the_capacity():
    """A device length larger than the cache (a bug upstream) reads the whole cache and nothing past it:
    the output equals the one at the capacity, and the positions past it are never read (NaN there)."""
    q, cache, origin = inputs(5, 4, 64, 2, 70, 100, torch.float16, "cuda")
    cache[70:] = float("nan")
    for length in (71, 100, 1 << 40):
        out = decode_attention(q, cache[:70], 1, origin, torch.tensor(length, device="cuda"))
        assert torch.equal(out, decode_attention(q, cache[:70], 1, origin, 70)), length
        assert not out.isnan().any(), length


@pytest.mark.gpu
def test_kernel_weighs_scores_of_minus_infinity_zero_across_chunks():
    """Keys whose score is -inf (an inf in a key) over a whole first chunk of positions, and one inside
    a later chunk: those positions get weight 0 and the rest attend as softmax does (finite outputs,
    the fp64 formulation's values)."""
    q, cache, origin = inputs(3, 2, 64, 1, 80, 80, torch.float32, "cuda", slots=3)
    q = q.abs() + 0.1  # every score with an inf key dimension is +inf x positive: -inf for a -inf key
    keys = cache[:, 0]
    keys[:40, :, :, 5] = -float("inf")  # positions 0..39: the first chunk of 32 and part of the next
    keys[61, :, :, 9] = -float("inf")
    out = decode_attention(q, cache, 0, origin, 80)
    ref = independent(q, cache, 0, origin, 80)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,H,D,length", [(1, 1, 64, 1), (7, 3, 32, 33), (13, 16, 64, 201), (3, 2, 256, 67)])
def test_kernel_writes_and_attends_to_the_steps_keys_and_values(dtype, N, H, D, length):
    """The generator's call: the step's k and v given, the length on the device. The kernel writes them
    into the cache exactly where the reference does (and nothing else), and its output equals its own
    over the cache written beforehand, bit for bit (that path is checked against fp64 above)."""
    q, cache, origin = inputs(N, H, D, 3, length, length + 3, dtype, "cuda")
    origin[:, length - 1] = torch.arange(N, dtype=torch.int32, device="cuda")
    k, v = step_keys_values(q)
    written = cache.clone()
    decode_attention_reference(q, written, 1, origin, length, k, v)
    kernel("decode_attention", q)
    assert DECODE_ATTENTION_ROUTE.pick(q) is not decode_attention_reference
    poison()
    out = decode_attention(q, cache, 1, origin, torch.tensor(length, device="cuda"), k, v)
    assert torch.equal(cache, written)
    assert torch.equal(out, decode_attention(q, written, 1, origin, length))


def projection(N, H, D, dtype=torch.float32, device="cpu"):
    """The step's qkv projection without its bias: q, k, v as views of one [N, 1, 3 x H x D] output
    (what the generator hands over), and a bias."""
    x = torch.randn(N, 1, 3 * H * D, dtype=dtype, device=device)
    bias = torch.randn(3 * H * D, dtype=dtype, device=device)
    return x, x.view(N, 3, H, 1, D).unbind(1), bias


@pytest.mark.parametrize("N,H,D,length", [(1, 1, 8, 1), (5, 3, 16, 7), (4, 2, 12, 33)])
def test_bias_and_scaling_equal_split_heads_first(N, H, D, length):
    """Given the projection's bias and the scaling, the op's output and the cache it writes equal, bit
    for bit, those of split_heads (bias added, q scaled) followed by the op on its outputs."""
    from ls_fairseq import ops

    q, cache, origin = inputs(N, H, D, 2, length, length + 2, slots=N + 1)
    origin[:, length - 1] = torch.arange(N, dtype=torch.int32)
    x, (q, k, v), bias = projection(N, H, D)
    written = cache.clone()
    sq, sk, sv = ops.split_heads(x, bias, H, 3, D**-0.5, token_major=True)
    expected = decode_attention(sq, written, 1, origin, length, sk, sv)
    out = decode_attention(q, cache, 1, origin, length, k, v, bias, D**-0.5)
    assert torch.equal(cache, written)
    assert torch.equal(out, expected)


def test_rejects_a_bad_bias():
    q, cache, origin = inputs(3, 2, 8, 2, 4, 6)
    _, (q, k, v), bias = projection(3, 2, 8)
    with pytest.raises(ValueError, match="comes with the step's k and v"):
        decode_attention(q, cache, 0, origin, 4, bias=bias)
    with pytest.raises(ValueError, match=r"bias \(47,\)"):
        decode_attention(q, cache, 0, origin, 4, k, v, bias[1:])
    with pytest.raises(ValueError, match="bias .* torch.float16"):
        decode_attention(q, cache, 0, origin, 4, k, v, bias.half())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,H,D,length", [(1, 1, 64, 1), (7, 3, 32, 33), (13, 16, 64, 201), (3, 2, 256, 67)])
def test_kernel_adds_the_bias_as_split_heads_does(dtype, N, H, D, length):
    """The generator's call: the qkv GEMM's output as views, its bias and the scaling, the length on
    the device. The cache written and the output equal, bit for bit, those of the split_heads kernel
    followed by the op on its outputs."""
    from ls_fairseq import ops

    _, cache, origin = inputs(N, H, D, 3, length, length + 3, dtype, "cuda")
    origin[:, length - 1] = torch.arange(N, dtype=torch.int32, device="cuda")
    x, (q, k, v), bias = projection(N, H, D, dtype, "cuda")
    kernel("decode_attention", q)
    kernel("qkv", x)
    written = cache.clone()
    sq, sk, sv = ops.split_heads(x, bias, H, 3, D**-0.5, token_major=True)
    expected = decode_attention(sq, written, 1, origin, length, sk, sv)
    poison()
    out = decode_attention(q, cache, 1, origin, torch.tensor(length, device="cuda"), k, v, bias, D**-0.5)
    assert torch.equal(cache, written)
    assert torch.equal(out, expected)
