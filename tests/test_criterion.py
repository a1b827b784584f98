import argparse

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from helpers import assert_close, rel_error
from model_utils import batch, build_pair

from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import LSLabelSmoothedCrossEntropyCriterion


@pytest.mark.parametrize("eps,prefix,accuracy", [(0.1, 0, True), (0.0, 0, False), (0.2, 2, True)])
def test_equals_fairseq_label_smoothed_cross_entropy(eps, prefix, accuracy):
    _, model, task = build_pair(dtype=torch.float64, share_all_embeddings=True)
    net_input, target = batch(task, B=5, S=8, T=9)
    pad = task.source_dictionary.pad()
    sample = {"net_input": net_input, "target": target, "ntokens": int(target.ne(pad).sum())}
    kw = dict(sentence_avg=False, label_smoothing=eps, ignore_prefix_size=prefix, report_accuracy=accuracy)
    results = []
    for cls in (LabelSmoothedCrossEntropyCriterion, LSLabelSmoothedCrossEntropyCriterion):
        model.zero_grad()
        loss, sample_size, log = cls(task, **kw)(model, sample)
        loss.backward()
        results.append((loss, sample_size, log, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l_ref, s_ref, log_ref, g_ref), (l_ls, s_ls, log_ls, g_ls) = results
    # fairseq's criterion takes log_softmax in fp32 whatever the model's dtype
    assert_close(l_ls, l_ref, rtol=1e-6, atol=0, what="loss")
    assert_close(log_ls["nll_loss"], log_ref["nll_loss"], rtol=1e-6, atol=0, what="nll_loss")
    assert s_ls == s_ref
    assert set(log_ls) - {"ls_flops", "ls_peak_flops"} == set(log_ref)
    assert log_ls["ls_flops"] > 0 and log_ls["ls_peak_flops"] == 989e12  # for the logged MFU
    for key in ("ntokens", "nsentences", "sample_size", "n_correct", "total"):
        assert log_ls.get(key) == log_ref.get(key), key
    for name in g_ref:
        assert rel_error(g_ls[name], g_ref[name]) < 1e-6, name


def test_registered_under_its_name():
    from fairseq.criterions import CRITERION_REGISTRY

    assert CRITERION_REGISTRY["ls_label_smoothed_cross_entropy"] is LSLabelSmoothedCrossEntropyCriterion
    assert argparse  # the criterion takes fairseq's options: --label-smoothing, --report-accuracy, --ignore-prefix-size
