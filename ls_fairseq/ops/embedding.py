"""Token embedding x scale + positional embedding + dropout, padding rows zero.

tokens [B, T] and positions [B, T] (fairseq's make_positions: padding_idx + 1
onwards for real tokens, padding_idx for padding) -> [B, T, d]. Positions come
from a learned table, or, when ``pos_weight`` is None, from fairseq's
sinusoidal formula (on the kernel path: a table of it in the storage dtype,
as fairseq keeps one, grown on demand; it has no gradient). The table must
hold a row for every position, which the host knows without reading the
positions back: by default the largest position make_positions gives T
tokens, padding_idx + T; a caller whose positions go further (incremental
decoding embeds one token at position padding_idx + 1 + step) passes
``max_position``.
Backward accumulates the table gradients in fp32 (no half-precision atomics)
and casts once; padding tokens give no gradient.
"""
import math
from typing import Optional

import torch

from ls_fairseq.ops import dispatch, workspace
from ls_fairseq.ops.dispatch import _C


def make_positions(tokens, padding_idx):
    """fairseq's make_positions: 1-based positions offset by padding_idx, pads -> padding_idx. The
    running count of a bool mask is int64 already (fairseq's int32 round trip costs three casts more:
    kernels inside every graphed step)."""
    mask = tokens.ne(padding_idx)
    return torch.cumsum(mask, dim=1).mul_(mask).add_(padding_idx)


def sinusoidal(positions, dim, padding_idx):
    """fairseq's sinusoidal embedding of ``positions`` (fp32): [sin | cos], zero row at padding_idx."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float, device=positions.device) * -(math.log(10000) / (half - 1)))
    angle = dispatch.upcast(positions).unsqueeze(-1) * freq
    emb = torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)
    if dim % 2 == 1:
        emb = torch.cat([emb, emb.new_zeros(emb.shape[:-1] + (1,))], dim=-1)
    return emb.masked_fill(positions.eq(padding_idx).unsqueeze(-1), 0.0)


_sinusoid_tables = {}
_tables_made = [0]


def sinusoid_table(rows, dim, padding_idx, dtype, device):
    """fairseq's sinusoid table (fp32 values cast to ``dtype``) with at least ``rows`` rows, cached."""
    key = (dim, padding_idx, dtype, device)
    table = _sinusoid_tables.get(key)
    if table is None or table.shape[0] < rows:
        n = max(rows, 2 * table.shape[0] if table is not None else 1024)
        table = sinusoidal(torch.arange(n, device=device), dim, padding_idx).to(dtype)
        _sinusoid_tables[key] = table
        _tables_made[0] += 1
    return table


def sinusoid_tables_made():
    """How many sinusoid tables were made so far: a table it replaced is freed, so a CUDA graph that
    read the old one must not be replayed once this count has changed."""
    return _tables_made[0]


def position_bound(tokens, padding_idx, max_position=None):
    """The largest position id the embedding of ``tokens`` [B, T] may read: ``max_position`` when the
    caller gives it, else padding_idx + T (make_positions' largest for T tokens)."""
    return padding_idx + tokens.shape[-1] if max_position is None else max_position


def embedding_forward_kernel(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position=None):
    """The kernel ``_C.embedding_forward``, given fairseq's sinusoid table when positions are not learned
    (rows up to ``position_bound``)."""
    if pos_weight is None:
        rows = position_bound(tokens, padding_idx, max_position) + 1
        pos_weight = sinusoid_table(rows, weight.shape[1], padding_idx, weight.dtype, weight.device)
    return _C.embedding_forward(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask)


def embedding_forward_reference(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position=None):
    x = dispatch.upcast(weight[tokens]) * scale
    if pos_weight is None:
        x = x + dispatch.upcast(sinusoidal(positions, weight.shape[1], padding_idx).to(weight.dtype))
    else:
        x = x + dispatch.upcast(pos_weight[positions])
    x = x.masked_fill(tokens.eq(padding_idx).unsqueeze(-1), 0.0)
    if p > 0 and mask is None:
        mask = dispatch.dropout_mask(x.shape, p, x.device)
    return dispatch.apply_dropout(x, mask, p).to(weight.dtype), mask


def embedding_backward_reference(dout, tokens, positions, mask, scale, padding_idx, p, num_embeddings, num_positions,
                                 dweight_into=None, dpos_into=None):
    # d table[t] = sum over (b, i) with tokens[b, i] = t != pad of scale * dropout'(dout)[b, i]
    # d pos_table[q] likewise without the scale; accumulated in fp32
    d = dispatch.apply_dropout(dispatch.upcast(dout), mask, p)
    keep = tokens.ne(padding_idx).reshape(-1)
    d = d.reshape(-1, d.shape[-1])[keep]
    dweight = torch.zeros(num_embeddings, d.shape[-1], dtype=d.dtype, device=d.device)
    dweight.index_add_(0, tokens.reshape(-1)[keep], d * scale)
    dpos = None
    if num_positions > 0:
        dpos = torch.zeros(num_positions, d.shape[-1], dtype=d.dtype, device=d.device)
        dpos.index_add_(0, positions.reshape(-1)[keep], d)
        dpos = dispatch.gradient(dpos, dout.dtype, dpos_into)
    return dispatch.gradient(dweight, dout.dtype, dweight_into), dpos


EMBEDDING_ROUTE = dispatch.Route(
    "embedding",
    kernel=(embedding_forward_kernel, _C.embedding_backward) if _C else None,
    reference=(embedding_forward_reference, embedding_backward_reference),
)


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position):
        fwd, bwd = EMBEDDING_ROUTE.pick(weight)
        out, dropout = fwd(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position)
        ctx.bwd, ctx.weight, ctx.pos_weight = bwd, weight, pos_weight
        ctx.args = (scale, padding_idx, p, weight.shape[0], 0 if pos_weight is None else pos_weight.shape[0])
        dispatch.save_with_dropout(ctx, (tokens, positions), dropout)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 9
        (tokens, positions), dropout = dispatch.saved_with_dropout(ctx)
        into = workspace.grad_in_place(ctx.weight)
        pos_into = None if ctx.pos_weight is None else workspace.grad_in_place(ctx.pos_weight)
        dweight, dpos = ctx.bwd(dout.contiguous(), tokens, positions, dropout, *ctx.args, into, pos_into)
        return (None, None, workspace.for_autograd(dweight, into), workspace.for_autograd(dpos, pos_into),
                None, None, None, None, None)


def embedding(tokens, positions, weight, pos_weight, scale, padding_idx, p=0.0, training=True, mask=None,
              max_position=None):
    """scale * weight[tokens] + positions' embedding, dropout ``p``; [B, T] -> [B, T, d].
    ``max_position``: the largest entry of ``positions`` or a bound on it (default padding_idx + T,
    see the module docstring)."""
    if tokens.shape != positions.shape or tokens.dim() != 2:
        raise ValueError(
            "embedding: tokens {} and positions {} must both be [batch, len]".format(
                tuple(tokens.shape), tuple(positions.shape)
            )
        )
    bound = position_bound(tokens, padding_idx, max_position)
    if pos_weight is not None and bound >= pos_weight.shape[0]:
        raise ValueError(
            "embedding: length {} exceeds the learned position table ({} rows); raise "
            "--max-source-positions/--max-target-positions".format(bound - padding_idx, pos_weight.shape[0])
        )
    if dispatch.compiling():  # the token range check reads the tokens (the reference's indexing checks them)
        p = p if training else 0.0
        if p > 0 and mask is None:
            mask = dispatch.dropout_mask(tokens.shape + weight.shape[1:], p, weight.device)
        return embedding_forward_op(tokens.contiguous(), positions.contiguous(), weight, pos_weight, scale, padding_idx,
                                    p, mask if p > 0 else None, max_position)
    if not tokens.is_cuda and tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < weight.shape[0]:
        # on the host the check is cheap; GPU batches come from data that ls_fairseq.data_checks checked at load
        bad = tokens[(tokens < 0) | (tokens >= weight.shape[0])]
        raise ValueError("embedding: token id {} is outside the table of {} rows (the dictionary's size)".format(
            int(bad[0]), weight.shape[0]))
    p = p if training else 0.0
    return dispatch.run(EmbeddingFunction,
        tokens.contiguous(), positions.contiguous(), weight, pos_weight, scale, padding_idx, p, mask if p > 0 else None,
        max_position,
    )


# torch.compile's path: the same route as two custom ops, the keep-mask a tensor of the graph given to both


def _forward(tokens: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
             scale: float, padding_idx: int, p: float, mask: Optional[torch.Tensor],
             max_position: Optional[int]) -> torch.Tensor:
    dispatch.check_given_mask("embedding", p, mask)
    fwd, _ = EMBEDDING_ROUTE.pick(weight)
    return fwd(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position)[0]


def _forward_fake(tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, max_position):
    return weight.new_empty(tokens.shape + weight.shape[1:])


def _backward_op(dout: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor],
                 scale: float, padding_idx: int, p: float, num_embeddings: int,
                 num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table's gradient, the position table's: [0, d] where positions are not learned)."""
    kernel = dispatch.use_kernel("embedding", dout)
    _, bwd = EMBEDDING_ROUTE.pick(dout)
    dweight, dpos = bwd(dout.contiguous(), tokens, positions, dispatch.given_dropout(kernel, mask, p), scale,
                        padding_idx, p, num_embeddings, num_positions, None, None)  # every argument: no defaults
    return dweight, dout.new_empty(0, dout.shape[-1]) if dpos is None else dpos


def _backward_fake(dout, tokens, positions, mask, scale, padding_idx, p, num_embeddings, num_positions):
    return dout.new_empty(num_embeddings, dout.shape[-1]), dout.new_empty(num_positions, dout.shape[-1])


def _setup_context(ctx, inputs, output):
    tokens, positions, weight, pos_weight, scale, padding_idx, p, mask, _ = inputs
    ctx.args = (scale, padding_idx, p, weight.shape[0], 0 if pos_weight is None else pos_weight.shape[0])
    ctx.save_for_backward(tokens, positions, mask)


def _backward(ctx, dout):
    tokens, positions, mask = ctx.saved_tensors
    dweight, dpos = embedding_backward_op(dout, tokens, positions, mask, *ctx.args)
    return None, None, dweight, dpos if ctx.args[-1] else None, None, None, None, None, None


embedding_backward_op = dispatch.custom_op("embedding_backward", _backward_op, fake=_backward_fake)
embedding_forward_op = dispatch.custom_op("embedding_forward", _forward, fake=_forward_fake, backward=_backward,
                                          setup_context=_setup_context)
