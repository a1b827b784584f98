import importlib.util
import os

import numpy as np

from ls_fairseq.flops import training_flops_per_target_token

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "padding_cost.py")
spec = importlib.util.spec_from_file_location("padding_cost", SCRIPT)
padding_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(padding_cost)


def test_flops_of_a_sentence_are_ls_fairseqs_count():
    """The script's forward FLOPs of one pair, times 3 (forward and backward), equal what MFU counts."""
    model = dict(d=1024, ffn=4096, layers=6, vocab=32000)
    for ls, lt in ((7, 11), (40, 33), (1, 250)):
        ours = 3 * padding_cost.flops(np.float64(ls), np.float64(lt), **model)
        counted = lt * training_flops_per_target_token(1024, 4096, 6, 6, 32000, ls, lt, src_per_tgt=ls / lt)
        assert abs(ours - counted) <= 1e-9 * counted, (ls, lt)
        attention = padding_cost.attention(np.float64(ls), np.float64(lt), **model)
        assert 0 < attention < ours / 3


def test_batches_hold_every_pair_once_within_max_tokens():
    src, tgt = padding_cost.pair_lengths(3000, seed=5)
    groups = padding_cost.batches(src, tgt, 4096, seed=5)
    seen = np.concatenate(groups)
    assert sorted(seen.tolist()) == list(range(3000))
    assert all(len(g) * int(np.maximum(src[g], tgt[g]).max()) <= 4096 for g in groups)
