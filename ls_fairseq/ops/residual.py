"""A residual connection's gradient, handed from a block's end to its start.

A block computes out = x + branch(x), the residual added at its end by
bias_dropout_residual. Backward owes x the sum of d_out (through the residual)
and the branch's input gradient, and autograd would add the two in a kernel of
its own: one [tokens, d] add (two reads, one write) per block, 30 a
transformer-big step. Instead the branch's first op on x ``claim``s the
residual's gradient in forward, bias_dropout_residual's backward (which runs
first) leaves it in the ``ResidualGrad`` and gives autograd none for x, and
that op's backward adds it into the input gradient it computes:

- a GEMM (post-LN: x feeds the first projection) accumulates into it
  (``addmm_``, cuBLAS beta = 1): bias_dropout_residual's backward kernel writes
  it out as a copy of d_out of its own (one write in a pass that reads d_out
  anyway), so nothing that autograd or the caller holds is modified;
- LayerNorm (pre-LN) adds d_out to the dx it has just made.

ls_transformer's layers make one per block and forward. An op that does not
claim it (a frozen weight's plain GEMM) leaves the residual's gradient to
autograd.
"""


class ResidualGrad:
    """d_out between bias_dropout_residual's backward (``put``) and the backward of the branch's
    first op (``take``, which also clears it, so a second backward over a retained graph starts
    empty). ``claimed``: None, "accumulate" (the taker adds into it in place: it must be a copy of
    its own) or "read" (the taker only reads it)."""

    __slots__ = ("grad", "claimed")

    def __init__(self):
        self.grad = None
        self.claimed = None

    def claim(self, how):
        assert how in ("accumulate", "read"), how
        self.claimed = how

    def put(self, grad):
        self.grad = grad

    def take(self):
        grad, self.grad = self.grad, None
        return grad
