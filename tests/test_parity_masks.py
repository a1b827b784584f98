"""The parity run's stock fairseq with ls_fairseq's dropout masks (scripts/parity_ls_masks): each of its
dropouts draws the keep-mask that the next kernel call would (GPU)."""
import importlib
import os
import sys

import pytest
import torch
from fairseq.modules.fairseq_dropout import FairseqDropout
from helpers import kernel

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.mark.gpu
def test_draw_dropout_is_the_next_kernel_calls_mask():
    x = torch.rand(64, 256, device="cuda") + 1.0  # no zeros: an output is zero exactly where dropped
    b, r = torch.zeros(256, device="cuda"), torch.zeros(64, 256, device="cuda")
    ext = kernel("bias_dropout_residual", x)
    torch.cuda.manual_seed(3)
    out, _ = ext.bias_dropout_residual_forward(x, b, r, 0.3, None)
    after_kernel = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(3)
    drawn = ext.draw_dropout(x, 0.3)
    assert torch.equal(drawn.mask(), (out != 0).to(torch.uint8))
    assert torch.equal(torch.cuda.get_rng_state(), after_kernel), "the generator must advance as for a kernel call"
    with pytest.raises(RuntimeError, match=r"draw_dropout: p must be in \(0, 1\), got 0"):
        ext.draw_dropout(x, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("module_name", ["TransformerEncoderLayerBase", "TransformerDecoder"])
def test_stock_dropouts_take_the_kernels_masks(module_name):
    """A layer's time-first [T, B, C] tensor gets the mask a kernel draws over the batch-first [B, T, C]
    one, transposed; an embedding's [B, T, C] the kernel's own; values as the kernels scale them."""
    original = FairseqDropout.forward
    sys.path.insert(0, SCRIPTS)
    try:
        # set here, not by the import: a module imported by an earlier case is not imported again
        FairseqDropout.forward = importlib.import_module("parity_ls_masks")._kernels_mask_dropout
        ext = kernel("bias_dropout_residual", torch.zeros(1, device="cuda"))
        btc = torch.rand(6, 9, 64, device="cuda", dtype=torch.float16) + 1.0
        time_first = "Layer" in module_name
        x = btc.transpose(0, 1).contiguous() if time_first else btc
        dropout = FairseqDropout(0.3, module_name=module_name)
        torch.cuda.manual_seed(5)
        got = dropout(x)
        torch.cuda.manual_seed(5)
        want, _ = ext.bias_dropout_residual_forward(btc, torch.zeros(64, device="cuda", dtype=torch.float16),
                                                     torch.zeros_like(btc), 0.3, None)
        if time_first:
            want = want.transpose(0, 1)
        assert torch.equal(got, want)
        dropout.eval()
        assert dropout(x) is x
    finally:
        FairseqDropout.forward = original
        sys.path.remove(SCRIPTS)
