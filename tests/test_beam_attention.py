import pytest
import torch
from helpers import check_kernel, kernel, poison

from ls_fairseq import ops
from ls_fairseq.ops.beam_attention import BEAM_ATTENTION_ROUTE, beam_attention, beam_attention_reference, scaled_query


def inputs(B, H, beams, D, S, dtype=torch.float32, device="cpu", padded=True, seed=None):
    """q as the generator hands it over (a view of the query projection's [B, beams, H x D] output, no
    bias), its bias, the encoder's keys and values [B, H, S, D], and a key padding mask that pads the
    first keys of every other sentence (fairseq pads the source on the left)."""
    seed = torch.randint(0, 2**31, ()).item() if seed is None else seed
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, beams, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
    bias = torch.randn(H * D, generator=g).to(dtype).to(device)
    k, v = (torch.randn(B, H, S, D, generator=g).to(dtype).to(device) for _ in range(2))
    pad = torch.zeros(B, S, dtype=torch.bool, device=device)
    if padded and S > 1:
        pad[1::2, : (S - 1) // 2 + 1] = True
    return q, bias, k, v, ops.AttentionMask(pad)


def independent(q, bias, k, v, pad, scaling):
    """fp64, one (sentence, head, beam) at a time, the padded keys left out."""
    B, H, beams, D = q.shape
    out = torch.empty(B, H, beams, D, dtype=torch.float64)
    q = (q.double().cpu() + bias.double().cpu().view(1, H, 1, D)) * scaling
    k, v, pad = k.double().cpu(), v.double().cpu(), pad.cpu()
    for b in range(B):
        keep = ~pad[b]
        for h in range(H):
            for j in range(beams):
                w = torch.softmax(k[b, h][keep] @ q[b, h, j], dim=0)
                out[b, h, j] = w @ v[b, h][keep]
    return out


@pytest.mark.parametrize("B,H,beams,D,S", [(1, 1, 1, 8, 1), (3, 2, 4, 16, 7), (2, 3, 5, 12, 33)])
def test_reference_equals_an_independent_formulation(B, H, beams, D, S):
    q, bias, k, v, mask = inputs(B, H, beams, D, S, torch.float64)
    out = beam_attention(q, k, v, mask, bias, D**-0.5)
    torch.testing.assert_close(out, independent(q, bias, k, v, mask.key_padding_mask, D**-0.5), rtol=1e-10,
                               atol=1e-10)


def test_bias_and_scaling_equal_split_heads_first():
    """Given the projection's bias and the scaling, the output equals, bit for bit, that of split_heads
    (bias added, q scaled) followed by the op on its output (the generator's path before)."""
    B, H, beams, D, S = 3, 2, 4, 16, 9
    q, bias, k, v, mask = inputs(B, H, beams, D, S)
    x = q.transpose(1, 2).reshape(B * beams, 1, H * D)
    (sq,) = ops.split_heads(x, bias, H, 1, D**-0.5, token_major=True)
    sq = sq.transpose(1, 2).reshape(B, beams, H, D).transpose(1, 2)
    assert torch.equal(beam_attention(q, k, v, mask, bias, D**-0.5), beam_attention(sq, k, v, mask))


def test_rejects_bad_input():
    q, bias, k, v, mask = inputs(2, 2, 4, 8, 5)
    with pytest.raises(ValueError, match="q"):
        beam_attention(q[0], k, v, mask)
    with pytest.raises(ValueError, match="k .* and v"):
        beam_attention(q, k[:1], v[:1], mask)
    with pytest.raises(ValueError, match="k .* and v"):
        beam_attention(q, k, v[:, :, :3], mask)
    with pytest.raises(ValueError, match=r"bias \(15,\)"):
        beam_attention(q, k, v, mask, bias[1:], 0.5)
    with pytest.raises(ValueError, match="bias .* torch.float16"):
        beam_attention(q, k, v, mask, bias.half(), 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,beams,D,S", [(1, 1, 1, 64, 1), (7, 3, 4, 32, 13), (128, 16, 4, 64, 21),
                                           (5, 4, 5, 64, 33), (3, 2, 9, 128, 100), (2, 3, 3, 256, 67),
                                           (2, 2, 4, 64, 1030)])
def test_kernel_against_fp64(dtype, B, H, beams, D, S):
    """The kernel against the fp64 formulation by the error rule (fp32 at most 1e-5; fp16/bf16 at most
    twice PyTorch's error in the same precision: its attention over the same scaled query); beams past
    one warp's four, sources past one chunk of 32 keys (the online softmax's rescaling), left padding."""
    q, bias, k, v, mask = inputs(B, H, beams, D, S, dtype, "cuda")
    kernel("beam_attention", q)
    assert BEAM_ATTENTION_ROUTE.pick(q) is not beam_attention_reference
    poison()
    out = beam_attention(q, k, v, mask, bias, D**-0.5)
    pad = mask.key_padding_mask
    ref64 = independent(q, bias, k, v, pad, D**-0.5) if B * H * beams * S <= 40000 else \
        beam_attention_reference(q.double(), k.double(), v.double(), mask, bias.double(), D**-0.5)
    sq = scaled_query(q, bias, D**-0.5)
    lowp = torch.nn.functional.scaled_dot_product_attention(sq, k, v, attn_mask=~pad[:, None, None, :], scale=1.0)
    check_kernel(out, ref64, lowp, "beam_attention {} B={} H={} beams={} D={} S={}".format(dtype, B, H, beams, D, S))


@pytest.mark.gpu
def test_kernel_output_merges_heads_without_a_copy():
    """The output is a view of token-major storage: merging its heads for the out projection is a view."""
    q, bias, k, v, mask = inputs(4, 16, 4, 64, 20, torch.float16, "cuda")
    out = beam_attention(q, k, v, mask, bias, 0.125)
    assert ops.merge_heads(out).data_ptr() == out.data_ptr() and ops.merge_heads(out).is_contiguous()


@pytest.mark.gpu
def test_padded_keys_do_not_reach_the_output():
    """Keys and values at padded positions hold NaN: the output is finite and equal to the one before
    (the kernel skips padded keys and does not add padded values)."""
    q, bias, k, v, mask = inputs(6, 4, 4, 64, 40, torch.float16, "cuda")
    pad = mask.key_padding_mask
    clean = beam_attention(q, k, v, mask, bias, 0.125)
    k[pad[:, None, :].expand(-1, 4, -1)] = float("nan")
    v[pad[:, None, :].expand(-1, 4, -1)] = float("nan")
    out = beam_attention(q, k, v, mask, bias, 0.125)
    assert out.isfinite().all()
    assert torch.equal(out, clean)


@pytest.mark.gpu
def test_other_head_dims_take_the_attention_op():
    """A d_head the kernel does not have (48) runs ops.attention with the beams as query rows: the same
    values as the reference within fp16's error."""
    q, bias, k, v, mask = inputs(3, 2, 4, 48, 17, torch.float16, "cuda")
    out = beam_attention(q, k, v, mask, bias, 48**-0.5)
    ref = beam_attention_reference(q.float(), k.float(), v.float(), mask, bias.float(), 48**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_adds_the_bias_as_split_heads_does(dtype):
    """The generator's call (the query projection's output, its bias, the scaling) against the
    split_heads kernel followed by the op on its output: equal bit for bit."""
    B, H, beams, D, S = 9, 16, 4, 64, 23
    q, bias, k, v, mask = inputs(B, H, beams, D, S, dtype, "cuda")
    kernel("beam_attention", q)
    kernel("qkv", q)
    x = q.transpose(1, 2).reshape(B * beams, 1, H * D)
    (sq,) = ops.split_heads(x, bias, H, 1, D**-0.5, token_major=True)
    sq = sq.transpose(1, 2).reshape(B, beams, H, D).transpose(1, 2)
    assert torch.equal(beam_attention(q, k, v, mask, bias, D**-0.5), beam_attention(sq, k, v, mask))


@pytest.mark.gpu
def test_kernel_without_a_mask_or_a_bias():
    """No key padding mask (the kernel reads no padding) and a scaling without a bias: the fp64
    formulation's values by the error rule."""
    q, _, k, v, _ = inputs(5, 4, 4, 64, 37, torch.float16, "cuda", padded=False)
    zero = torch.zeros(4 * 64, dtype=torch.float16, device="cuda")
    out = beam_attention(q, k, v, None, None, 0.125)
    ref64 = independent(q, zero, k, v, torch.zeros(5, 37, dtype=torch.bool), 0.125)
    sq = scaled_query(q, None, 0.125)
    check_kernel(out, ref64, torch.nn.functional.scaled_dot_product_attention(sq, k, v, scale=1.0), "no mask, no bias")


@pytest.mark.gpu
def test_a_sentence_of_only_padding_gets_zeros():
    """A sentence whose keys are all padding: zeros, as ops.attention gives; the other sentences as
    the reference."""
    q, bias, k, v, mask = inputs(4, 2, 5, 64, 40, torch.float16, "cuda")
    mask.key_padding_mask[2] = True
    out = beam_attention(q, k, v, mask, bias, 0.125)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    ref = beam_attention_reference(q.float(), k.float(), v.float(), mask, bias.float(), 0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
