"""ls_label_smoothed_cross_entropy: fairseq's label_smoothed_cross_entropy from
the logits in one fused op (no [tokens x vocab] fp32 log-probabilities).

Same formula (eps_i = eps / (V - 1)), same logging outputs and metrics
(loss, nll_loss, ntokens, nsentences, sample_size; --report-accuracy,
--ignore-prefix-size) as fairseq's criterion, which it extends. It also logs
throughput for TensorBoard: ``mfu`` (wps x model FLOPs per target token, see
ls_fairseq.flops, over --ls-peak-tflops) and, on a GPU, ``gpu_peak_gib`` (the
peak of allocated memory over the log interval's steps, CUDA graph replays
included: ls_fairseq.memory); neither needs a device synchronisation.
"""
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ls_fairseq import memory, ops, packing


@dataclass
class LSLabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    ls_peak_tflops: float = field(
        default=989.0,
        metadata={"help": "the GPU's dense fp16/bf16 peak in TFLOP/s, for the logged MFU (989: H100/H200)"},
    )


class LSLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 ls_peak_tflops=989.0):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.peak_flops = ls_peak_tflops * 1e12

    def forward(self, model, sample, reduce=True):
        if self.report_accuracy:  # fairseq's forward, which reads the accuracy counts back from the device
            net_output = model(**sample["net_input"])
            loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
            sample_size, logging_output = self.logging_outputs(model, sample, loss, nll_loss)
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
            return loss, sample_size, logging_output
        loss, nll_loss = self.losses(model, sample, reduce)
        return (loss,) + self.logging_outputs(model, sample, loss, nll_loss)

    def losses(self, model, sample, reduce=True):
        """(loss, nll_loss) of ``sample``: the device's part of forward, which a CUDA graph of the
        training step captures (ls_fairseq.cuda_graphs)."""
        net_output = model(**sample["net_input"])
        return self.compute_loss(model, net_output, sample, reduce=reduce)

    def logging_outputs(self, model, sample, loss, nll_loss):
        """(sample_size, logging_output) as fairseq's criterion forms them: the host's part of forward,
        from ``sample`` and the two losses (device tensors)."""
        # a packed target is one stream: its sentences are counted by the collater
        sentences = sample["nsentences"] if packing.is_packed(sample) else sample["target"].size(0)
        sample_size = sentences if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sentences,
            "sample_size": sample_size,
        }
        return sample_size, self._with_flops(model, sample, logging_output)

    def _with_flops(self, model, sample, logging_output):
        flops = getattr(model, "training_flops", None)
        if flops is not None:
            logging_output["ls_flops"] = flops(sample)
            logging_output["ls_peak_flops"] = self.peak_flops
        return logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        flops = sum(log.get("ls_flops", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        peak = max((log.get("ls_peak_flops", 0) for log in logging_outputs), default=0)
        if flops > 0 and ntokens > 0 and peak > 0:
            # model GFLOPs per target token (ls_fairseq.flops); mfu = wps x FLOPs per token / peak
            metrics.log_scalar("gflops_per_tok", flops / ntokens / 1e9, ntokens, round=3)
            metrics.log_derived(
                "mfu",
                lambda meters: float("{:.3g}".format(meters["wps"].avg * meters["gflops_per_tok"].avg * 1e9 / peak))
                if "wps" in meters
                else 0.0,
            )
        memory.log_peak("gpu_peak_gib", round=2)

    def get_logits_and_target(self, model, net_output, sample):
        logits = net_output[0]
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0 and packing.is_packed(sample):
            # the first tokens of each sentence: positions padding_idx + 1 .. padding_idx + prefix size
            positions = sample["net_input"]["ls_tgt_positions"]
            return logits, target.masked_fill(positions <= self.padding_idx + self.ignore_prefix_size, self.padding_idx)
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size :, :]
            target = target[:, self.ignore_prefix_size :]
        return logits, target

    def compute_loss(self, model, net_output, sample, reduce=True):
        logits, target = self.get_logits_and_target(model, net_output, sample)
        # the logits are not needed after the loss: their gradient takes their memory
        loss, nll_loss = ops.label_smoothed_cross_entropy(logits, target, self.eps, self.padding_idx,
                                                          overwrite_logits=True)
        if reduce:
            return loss.sum(), nll_loss.sum()
        return loss.reshape(-1, 1), nll_loss.reshape(-1, 1)

    def compute_accuracy(self, model, net_output, sample):
        logits, target = self.get_logits_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = torch.sum(logits.argmax(-1).masked_select(mask).eq(target.masked_select(mask)))
        return n_correct, torch.sum(mask)
