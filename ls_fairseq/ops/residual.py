"""A residual connection's gradient, handed from a block's end to its start.

A block computes out = x + branch(x), the residual added at its end. Backward owes
x the sum of d_out (through the residual) and the branch's input gradient, and
autograd would add the two in a kernel of its own: one [tokens, d] add (two reads,
one write) per block, 30 a transformer-big step. Instead the branch's first op on
x ``claim``s the residual's gradient in forward, the block's end (whose backward
runs first) leaves it in the ``ResidualGrad`` and gives autograd none for x, and
that op's backward adds it into the input gradient it computes:

- post-LN: the end is bias_dropout_residual_layer_norm, whose residual gradient is
  LayerNorm's new dx, and the first op a GEMM, which accumulates into it
  (``addmm_``, cuBLAS beta = 1: no extra kernel, no copy);
- pre-LN: the end is bias_dropout_residual, whose residual gradient is its d_out
  (autograd's, not to be modified), and the first op the LayerNorm, which only
  reads it (adds it to the dx it has just made).

A GEMM's claim at a bias_dropout_residual end is not served (it would need a copy
of d_out, which costs what autograd's add does), nor is an op's that does not
claim (a frozen weight's plain GEMM): autograd adds as usual.
"""


class ResidualGrad:
    """d_out between bias_dropout_residual's backward (``put``) and the backward of the branch's
    first op (``take``, which also clears it, so a second backward over a retained graph starts
    empty). ``claimed``: None, "accumulate" (the taker adds into it in place: only a gradient
    nothing else holds is handed over) or "read" (the taker only reads it)."""

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
