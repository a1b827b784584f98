"""ls_label_smoothed_cross_entropy: fairseq's label_smoothed_cross_entropy from
the logits in one fused op (no [tokens x vocab] fp32 log-probabilities).

Same formula (eps_i = eps / (V - 1)), same logging outputs and metrics
(loss, nll_loss, ntokens, nsentences, sample_size; --report-accuracy,
--ignore-prefix-size) as fairseq's criterion, which it extends.
"""
from dataclasses import dataclass

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ls_fairseq import ops


@dataclass
class LSLabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    pass


@register_criterion("ls_label_smoothed_cross_entropy", dataclass=LSLabelSmoothedCrossEntropyCriterionConfig)
class LSLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def get_logits_and_target(self, model, net_output, sample):
        logits = net_output[0]
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size :, :]
            target = target[:, self.ignore_prefix_size :]
        return logits, target

    def compute_loss(self, model, net_output, sample, reduce=True):
        logits, target = self.get_logits_and_target(model, net_output, sample)
        loss, nll_loss = ops.label_smoothed_cross_entropy(logits, target, self.eps, self.padding_idx)
        if reduce:
            return loss.sum(), nll_loss.sum()
        return loss.reshape(-1, 1), nll_loss.reshape(-1, 1)

    def compute_accuracy(self, model, net_output, sample):
        logits, target = self.get_logits_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = torch.sum(logits.argmax(-1).masked_select(mask).eq(target.masked_select(mask)))
        return n_correct, torch.sum(mask)
