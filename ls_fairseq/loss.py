"""The fused label-smoothed cross-entropy as a module (no fairseq needed)."""
import torch.nn as nn

from ls_fairseq import ops


class LabelSmoothedCrossEntropy(nn.Module):
    """fairseq's label-smoothed cross-entropy (eps_i = eps / (V - 1)) from the logits in one fused op:
    no [tokens x vocab] fp32 log-probabilities. ``forward(logits [..., V], target [...])`` returns
    (loss, nll_loss), summed over the tokens (``reduction="sum"``) or per token (``"none"``);
    targets equal to ``padding_idx`` (a valid index into the vocabulary, as fairseq's pad) count zero. ``overwrite_logits``: the logits' memory takes
    their gradient (they must not be used after the loss)."""

    def __init__(self, padding_idx, eps=0.1, reduction="sum", overwrite_logits=False):
        super().__init__()
        if reduction not in ("sum", "none"):
            raise ValueError("LabelSmoothedCrossEntropy: reduction must be 'sum' or 'none', got {!r}".format(reduction))
        self.eps, self.padding_idx, self.reduction, self.overwrite_logits = eps, padding_idx, reduction, overwrite_logits

    def forward(self, logits, target):
        loss, nll_loss = ops.label_smoothed_cross_entropy(logits, target, self.eps, self.padding_idx,
                                                          overwrite_logits=self.overwrite_logits)
        if self.reduction == "sum":
            return loss.sum(), nll_loss.sum()
        return loss, nll_loss

    def extra_repr(self):
        return "eps={}, padding_idx={}, reduction={!r}".format(self.eps, self.padding_idx, self.reduction)
