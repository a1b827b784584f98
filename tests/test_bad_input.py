"""Bad data and bad configuration: each is refused with an error that names the problem, and
nothing on disk is changed (or, where the input is valid, it is trained on correctly)."""
import argparse
import logging
import os
import re
import types

import pytest
import torch
from fairseq.data import data_utils, indexed_dataset
from model_utils import batch, build_pair, dictionary, model_args

import ls_fairseq.fairseq_plugin  # noqa: F401 (installs the data checks and the checkpoint checks)
from ls_fairseq.checkpoint import CheckpointMismatchError, dictionary_fingerprints
from ls_fairseq.fairseq_plugin.checkpoint_hooks import load_on_every_rank, with_dictionaries
from ls_fairseq.data_checks import DataError
from ls_fairseq.models.ls_transformer import LSTransformerModel
from ls_fairseq.models.ls_transformer import base_architecture as ls_base


def write_split(prefix, sentences, vocab_size=100):
    """A memory-mapped split as fairseq-preprocess writes it (each sentence ends with eos = 2)."""
    builder = indexed_dataset.make_builder(str(prefix) + ".bin", impl="mmap", vocab_size=vocab_size)
    for ids in sentences:
        builder.add_item(torch.tensor(list(ids) + [2], dtype=torch.int32))
    builder.finalize(str(prefix) + ".idx")


def test_token_ids_outside_the_dictionary_are_refused_at_load(tmp_path):
    d = dictionary()  # 44 entries
    write_split(tmp_path / "train.src-tgt.src", [[5, 6, 7], [8, 43], [9, 44, 50, 10], [11]])
    before = (tmp_path / "train.src-tgt.src.bin").read_bytes()
    with pytest.raises(DataError, match=r"train\.src-tgt\.src: token id 44 in sentence 2 is outside the dictionary "
                                        r"\(44 entries, ids 0-43\); 2 token\(s\) in this split are"):
        data_utils.load_indexed_dataset(str(tmp_path / "train.src-tgt.src"), d, "mmap")
    assert (tmp_path / "train.src-tgt.src.bin").read_bytes() == before


def test_every_shard_of_a_combined_split_is_checked(tmp_path):
    d = dictionary()
    write_split(tmp_path / "train", [[5, 6], [7]])
    write_split(tmp_path / "train1", [[8], [9, 99]])
    with pytest.raises(DataError, match="token id 99 in sentence 1"):
        data_utils.load_indexed_dataset(str(tmp_path / "train"), d, "mmap", combine=True)


def test_a_valid_split_loads_and_its_empty_lines_are_counted(tmp_path, caplog):
    d = dictionary()
    write_split(tmp_path / "valid", [[5, 43], [], [6], []])
    with caplog.at_level(logging.WARNING, logger="ls_fairseq.data_checks"):
        dataset = data_utils.load_indexed_dataset(str(tmp_path / "valid"), d, "mmap")
    assert len(dataset) == 4 and dataset[1].tolist() == [2]
    assert "2 of 4 sentences are empty (end-of-sentence token only)" in caplog.text


def test_the_forward_on_cpu_refuses_ids_outside_the_table():
    _, model, task = build_pair()
    net_input, _ = batch(task, seed=0)
    net_input["src_tokens"][1, -2] = len(task.source_dictionary)
    with pytest.raises(ValueError, match=r"token id 44 is outside the table of 44 rows"):
        model(**net_input)
    net_input, _ = batch(task, seed=0)
    net_input["prev_output_tokens"][0, 1] = -1
    with pytest.raises(ValueError, match=r"token id -1 is outside the table"):
        model(**net_input)


def test_empty_source_and_target_lines_give_finite_loss_and_gradients():
    """fairseq-preprocess keeps an empty line as eos alone: a source row of eos after padding, a
    target of eos whose decoder input is eos."""
    _, model, task = build_pair()
    d = task.source_dictionary
    net_input, target = batch(task, B=3, S=6, T=5, seed=1)
    net_input["src_tokens"][0] = torch.tensor([d.pad()] * 5 + [d.eos()])
    net_input["src_lengths"][0] = 1
    net_input["prev_output_tokens"][2] = torch.tensor([d.eos()] + [d.pad()] * 4)
    target[2] = torch.tensor([d.eos()] + [d.pad()] * 4)
    logits, _ = model(**net_input)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=d.pad(), reduction="sum")
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_a_head_count_that_does_not_divide_the_width_is_named(side):
    args = argparse.Namespace(**model_args(**{side + "_embed_dim": 30, side + "_attention_heads": 4}))
    d = dictionary()
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    with pytest.raises(ValueError, match="--{0}-embed-dim 30 is not divisible by --{0}-attention-heads 4".format(side)):
        LSTransformerModel.build_model(args, task)


def ls_model(n_words=40, **overrides):
    d = dictionary(n_words)
    task = types.SimpleNamespace(source_dictionary=d, target_dictionary=d)
    args = argparse.Namespace(**model_args(**overrides))
    ls_base(args)
    return LSTransformerModel.build_model(args, task)


def test_a_stock_transformer_checkpoint_is_named_with_its_conversion():
    stock, model, _ = build_pair()
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint of fairseq's transformer .* ls_fairseq\.convert"):
        model.load_state_dict(stock.state_dict())


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(decoder_layers=2), r"parameters missing: decoder\.layers\.2\."),
        (dict(decoder_layers=4), r"unexpected parameters: decoder\.layers\.3\."),
        (dict(encoder_ffn_embed_dim=64), r"of other shapes: encoder\.layers\.0\.fc1\.weight \[64, 32\] "
                                         r"\(this model: \[48, 32\]\)"),
    ],
)
def test_a_checkpoint_of_another_architecture_says_what_differs(other, message):
    model = ls_model(decoder_layers=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    theirs = ls_model(**dict(dict(decoder_layers=3), **other)).state_dict()
    with pytest.raises(CheckpointMismatchError, match="another architecture than the one the command line builds"):
        model.load_state_dict(theirs)
    with pytest.raises(CheckpointMismatchError, match=message):
        model.load_state_dict(theirs)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # nothing was loaded


def test_a_checkpoint_of_another_dictionary_size_is_named():
    model = ls_model(40)
    with pytest.raises(CheckpointMismatchError, match=r"encoder\.embed_tokens\.weight has 54 rows, the data-bin's "
                                                      r"source dictionary 44 entries"):
        model.load_state_dict(ls_model(50).state_dict())


def fake_trainer(d):
    return types.SimpleNamespace(data_parallel_world_size=1, task=types.SimpleNamespace(source_dictionary=d,
                                                                                        target_dictionary=d))


def test_checkpoints_record_the_dictionaries_and_a_resume_on_other_tokens_is_refused():
    d = dictionary()
    saved = with_dictionaries(lambda trainer: {"extra_state": {"epoch": 1}})(fake_trainer(d))
    assert saved["extra_state"]["ls_dictionaries"] == dictionary_fingerprints(fake_trainer(d).task)
    load = load_on_every_rank(lambda trainer, filename, *a, **k: saved["extra_state"])
    assert load(fake_trainer(d), "checkpoint_last.pt")["epoch"] == 1  # the same dictionary: resumes
    shuffled = dictionary()
    shuffled.symbols[5], shuffled.symbols[6] = shuffled.symbols[6], shuffled.symbols[5]
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint_last\.pt was trained with another source dictionary "
                                                      r"than the data-bin's: 44 entries, sha256 \w+ there, 44 entries"):
        load(fake_trainer(shuffled), "checkpoint_last.pt")


def test_fairseqs_generic_load_error_is_replaced_by_the_mismatch():
    def load(trainer, filename, *args, **kwargs):
        try:
            raise CheckpointMismatchError("its encoder.embed_tokens.weight has 54 rows")
        except Exception:
            raise Exception("Cannot load model parameters from checkpoint {}; please ensure that the architectures "
                            "match.".format(filename))

    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint ck\.pt: its encoder\.embed_tokens\.weight has 54"):
        load_on_every_rank(load)(fake_trainer(dictionary()), "ck.pt")


def test_an_extension_older_than_its_sources_is_noticed(tmp_path, caplog):
    from ls_fairseq.ops import dispatch

    module = tmp_path / "_C.so"
    module.write_bytes(b"")
    os.utime(module, (0, 0))
    with caplog.at_level(logging.WARNING, logger="ls_fairseq.ops.dispatch"):
        dispatch._warn_if_older_than_sources(str(module))
    assert "is older than" in caplog.text and "bindings.cpp" in caplog.text and "rebuild it" in caplog.text
    caplog.clear()
    os.utime(module, (2**32, 2**32))
    dispatch._warn_if_older_than_sources(str(module))
    assert caplog.text == ""


@pytest.mark.slow
def test_resuming_on_a_data_bin_of_another_dictionary_is_refused_and_nothing_is_lost(tmp_path):
    """A tiny run on one synthetic data-bin, then resumes on one whose dictionary has the same size but
    another order (other token ids), and on one with a smaller dictionary."""
    import sys

    from conftest import REPO, bin_path, run

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import fault_checkpoints

    same = fault_checkpoints.make_data_bin(str(tmp_path / "a"), seed=0)
    reordered = fault_checkpoints.make_data_bin(str(tmp_path / "b"), seed=5)
    smaller = fault_checkpoints.make_data_bin(str(tmp_path / "c"), vocab=30)
    save = tmp_path / "ckpt"
    args = fault_checkpoints.TRAIN + ["--save-dir", str(save), "--user-dir", os.path.join(REPO, "ls_fairseq")]

    def train(data_bin, max_update):
        return run([bin_path("fairseq-train"), data_bin] + args + ["--max-update", str(max_update)])

    proc = train(same, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in save.glob("*.pt")}
    proc = train(reordered, 6)
    assert proc.returncode != 0
    assert re.search(r"CheckpointMismatchError: checkpoint \S+checkpoint_last\.pt was trained with another source "
                     r"dictionary than the data-bin's: 48 entries, sha256 \w+ there, 48 entries, sha256 \w+ here",
                     proc.stderr), proc.stderr[-3000:]
    proc = train(smaller, 6)
    assert proc.returncode != 0
    assert re.search(r"CheckpointMismatchError: checkpoint \S+checkpoint_last\.pt: its encoder\.embed_tokens\.weight "
                     r"has 48 rows, the data-bin's source dictionary 40 entries", proc.stderr), proc.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in save.glob("*.pt")} == before
    assert train(same, 6).returncode == 0
