"""--ls-packed end to end on the CPU: the packed batches are fairseq's batches sentence for sentence
(on the real epoch iterators of fairseq's Trainer and of ls-fairseq-train's), and a run trains packed,
resumes padded and packed again, and translates."""
import pytest
import torch
from conftest import USER_DIR, bin_path, run
from test_cli import TRAIN, generate, hypotheses, updates

import ls_fairseq.fairseq_plugin  # noqa: F401 (installs the plugin's hooks into fairseq's Trainer)
from ls_fairseq import packing

pytestmark = pytest.mark.slow


def epoch_batches(data_bin, trainer_class, *extra, epochs=2):
    """Every batch of the first ``epochs`` epochs of the training split, as the trainer's epoch iterator
    gives it: (sentence ids, packed?, the sample)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        str(data_bin / "data-bin"), "--user-dir", USER_DIR] + TRAIN + list(extra))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    trainer = trainer_class(cfg, task, model, criterion)
    out = []
    for epoch in range(1, epochs + 1):
        itr = trainer.get_train_iterator(epoch).next_epoch_itr(shuffle=True)
        out.append([(sample["id"].tolist(), packing.is_packed(sample), sample) for sample in itr])
    return out


@pytest.mark.parametrize("trainer", ["fairseq", "ls"])
def test_packed_batches_are_fairseqs_batches(data_bin, trainer):
    from fairseq.trainer import Trainer

    from ls_fairseq.trainer import LSTrainer

    cls = {"fairseq": Trainer, "ls": LSTrainer}[trainer]
    stock = epoch_batches(data_bin, Trainer)
    packed = epoch_batches(data_bin, cls, "--ls-packed")
    assert len(stock) == len(packed)
    for stock_epoch, packed_epoch in zip(stock, packed):
        assert [ids for ids, _, _ in stock_epoch] == [ids for ids, _, _ in packed_epoch]
        assert not any(p for _, p, _ in stock_epoch) and all(p for _, p, _ in packed_epoch)
        for (_, _, s), (_, _, p) in zip(stock_epoch, packed_epoch):
            assert s["ntokens"] == p["ntokens"] == int(p["target"].ne(1).sum())
            assert p["net_input"]["src_tokens"].ne(1).sum() == s["net_input"]["src_tokens"].ne(1).sum()


def test_graph_shapes_are_few_and_hold_every_batch(data_bin):
    """With --ls-cuda-graphs the streams take one of at most 8 capacities each, with the segment
    count and the longest sentences fixed per pair (the shapes a graph is captured for)."""
    from fairseq.trainer import Trainer

    (epoch,) = epoch_batches(data_bin, Trainer, "--ls-packed", "--ls-cuda-graphs", epochs=1)
    keys = set()
    for _, _, p in epoch:
        net = p["net_input"]
        keys.add((net["src_tokens"].shape[1], net["prev_output_tokens"].shape[1], net["ls_src_offsets"].shape[0],
                  net["ls_src_max_len"], net["ls_tgt_max_len"]))
        assert net["src_tokens"].shape[1] % 16 == 0 and net["ls_src_offsets"][-1] <= net["src_tokens"].shape[1]
    assert len({k[0] for k in keys}) <= 8 and len({k[1] for k in keys}) <= 8
    assert len(keys) == len({k[:2] for k in keys})  # one shape per pair of capacities


def test_train_packed_resume_padded_and_packed_then_translate(data_bin, tmp_path):
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin"), "--user-dir", USER_DIR] + TRAIN + [
        "--save-dir", str(tmp_path), "--no-epoch-checkpoints"]
    logs = []
    for packed, until in ((True, 8), (False, 16), (True, 24)):
        proc = run(cmd + ["--max-update", str(until)] + (["--ls-packed"] if packed else []))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs.append(proc.stdout + proc.stderr)
        assert max(updates(logs[-1])) == until
        assert ("training batches of train packed" in logs[-1]) == packed
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 24
    assert len(hypotheses(generate(data_bin, tmp_path / "checkpoint_last.pt"))) == 200


def test_packed_needs_the_ls_criterion(data_bin, tmp_path):
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin"), "--user-dir", USER_DIR] + [
        a if a != "ls_label_smoothed_cross_entropy" else "label_smoothed_cross_entropy" for a in TRAIN]
    proc = run(cmd + ["--save-dir", str(tmp_path), "--max-update", "1", "--ls-packed"])
    assert proc.returncode != 0 and "--ls-packed needs --criterion ls_label_smoothed_cross_entropy" in proc.stderr, \
        proc.stderr[-2000:]


@pytest.mark.gpu
def test_packed_cuda_graphs_replay_the_eager_steps_bit_for_bit(data_bin, tmp_path):
    """--ls-packed --ls-cuda-graphs with --ls-deterministic and attention dropout: 30 updates, most
    replayed from graphs captured per pair of stream capacities, end with the same bits in every
    parameter as 30 eager packed updates."""
    from test_cli import ONE_GPU, eager_and_graphed

    gpu = ONE_GPU + ["--fp16", "--ls-packed", "--ls-deterministic", "--attention-dropout", "0.1",
                     "--disable-validation", "--no-epoch-checkpoints", "--max-update", "30", "--max-tokens", "4096"]
    assert "ls_src_offsets" in eager_and_graphed(data_bin, tmp_path, gpu)
