"""A fairseq --user-dir for the shared-masks run of scripts/parity.py: stock fairseq
drawing every dropout mask as ls_fairseq's kernels draw it, and nothing else changed.

fairseq seeds torch before every update with --seed + the update number, so both
systems start each update from the same generator state; ls_fairseq's kernels then
draw each call's keep-bits from the generator's next Philox state as a function of
the element index of their batch-first [B, T, C] tensor, in the same order as stock
fairseq's dropouts (each embedding's, then each layer's residual dropouts; attention
and activation dropout 0 draw nothing in either). Here each of stock fairseq's
dropouts draws the mask through the extension (``_C.draw_dropout``: the generator
advances as for a kernel call) over the batch-first shape, transposed for the layers'
time-first [T, B, C] tensors, and multiplies as the kernels do (fp32, 1 / (1 - p)).
So the two runs differ only where their arithmetic rounds differently: the per-interval
comparison of the fused layers issue, without dropout's sampling noise (two stock runs
with other masks drift 2.7% apart: parity_hooks). Needs the CUDA extension.
"""
import torch
from fairseq.modules.fairseq_dropout import FairseqDropout

import ls_fairseq.fairseq_plugin  # noqa: F401 (the checkpoint allowlist, the extension)
from ls_fairseq.ops import dispatch


def _kernels_mask_dropout(self, x, inplace=False):
    if not (self.p > 0 and (self.training or self.apply_during_inference)):
        return x
    ext = dispatch.extension()
    if ext is None or not x.is_cuda:
        raise RuntimeError("parity_ls_masks: needs ls_fairseq's CUDA extension and CUDA tensors")
    time_first = "Layer" in (self.module_name or "")  # the layers' [T, B, C]; the embeddings' [B, T, C]
    batch_first = x.transpose(0, 1) if time_first else x
    keep = ext.draw_dropout(batch_first, self.p).mask()
    if time_first:
        keep = keep.transpose(0, 1)
    scale = (1.0 / (1.0 - torch.tensor(self.p, dtype=torch.float32))).item()  # the kernels' 1 / (1 - p) in fp32
    return (x.float() * keep * scale).to(x.dtype)


FairseqDropout.forward = _kernels_mask_dropout
