"""The speed benchmark's steady state: which log intervals it averages."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "wmt14_en_de"))
import bench  # noqa: E402


def interval(epoch, update, wps):
    return "2026-11-29 19:00:40 | INFO | train_inner | epoch {:03d}:     3 / 107 loss=15.1, wps={}, ups=30, " \
           "num_updates={}, lr=1e-05".format(epoch, wps, update)


def captured(n):
    return "2026-11-29 19:00:40 | INFO | ls_fairseq.cuda_graphs | {}{} captured for the batch shape " \
           "src_tokens=[8, 24]".format(bench.CAPTURED, n)


def test_steady_state_leaves_out_early_epochs_capturing_intervals_and_all_from_the_profile_on():
    # two ranks log each interval; rank 1 captures a graph during updates 31..40, after both
    # ranks logged update 30; updates 55..57 are profiled, and the steps after a profile run
    # slower too (docs/perf-log.md), so update 70's interval is out as well as update 60's
    log = [interval(1, 10, 100)]
    for update in (20, 30, 40, 50, 60, 70):
        for _rank in range(2):
            log.append(interval(2 if update <= 30 else 3, update, 1000 + update))
        if update == 30:
            log.append(captured(7))
    steady = bench.steady_intervals("\n".join(log), profiled=[55, 56, 57], steady_from=3)
    assert [int(f["num_updates"]) for f in steady] == [50, 50]
    assert [float(f["wps"]) for f in steady] == [1050, 1050]
    # without a profile, every interval from the epoch on that did not capture
    assert [int(f["num_updates"]) for f in bench.steady_intervals("\n".join(log), [], 3)] == [50, 50, 60, 60, 70, 70]


def test_first_updates_wps_is_tokens_over_time_of_each_update_once():
    # updates 10 and 20 logged by two ranks (counted once), 30 profiled, 40 past the first 30 updates
    log = [interval(1, 10, 1000).replace("ups=30", "ups=10"), interval(1, 10, 1000).replace("ups=30", "ups=10"),
           interval(1, 20, 4000).replace("ups=30", "ups=40"), interval(1, 30, 1), interval(1, 40, 1)]
    # 10 updates in 1 s at 1000 wps, 10 in 0.25 s at 4000 wps: 2000 tokens in 1.25 s
    assert bench.first_updates_wps("\n".join(log), profiled=[25], updates=30) == 2000 / 1.25


def test_several_gpus_take_neighbouring_batches_in_each_update_for_both_systems():
    from fairseq.data.iterators import EpochBatchIterator
    from torch.utils.data import TensorDataset

    assert bench.distributed_options(1, True) == ["--distributed-world-size", "1"]
    for with_ls in (False, True):
        assert "--grouped-shuffling" in bench.distributed_options(2, with_ls)
    assert "legacy_ddp" in bench.distributed_options(2, True) and "legacy_ddp" not in bench.distributed_options(2, False)
    # what the option does in fairseq: batches (built from length-sorted indices) go to the ranks in
    # shuffled groups of neighbours, so the two ranks' batches of an update are batch 2k and 2k + 1
    batches = [[i] for i in range(10)]
    shards = [EpochBatchIterator(TensorDataset(torch.arange(10)), None, batches, seed=3, num_shards=2, shard_id=rank,
                                 grouped_shuffling=True).ordered_batches(epoch=2, fix_batches_to_gpus=False, shuffle=True)
              for rank in (0, 1)]
    assert [b[0] for b in shards[0]] != list(range(0, 10, 2))  # shuffled
    assert all(b1[0] == b0[0] + 1 and b0[0] % 2 == 0 for b0, b1 in zip(*shards))


def test_several_gpus_keep_one_batch_iterator_that_reshuffles_its_groups_every_epoch():
    from fairseq import options
    from fairseq.data.iterators import EpochBatchIterator
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from torch.utils.data import TensorDataset

    # fairseq makes --update-epoch-batch-itr default to --grouped-shuffling (a new iterator, data loader
    # and workers every epoch); the options turn that off, in the config fairseq's trainer reads
    args = options.parse_args_and_arch(
        options.get_training_parser(), ["data", "--arch", "transformer"] + bench.distributed_options(2, True)
    )
    cfg = convert_namespace_to_omegaconf(args)
    assert cfg.dataset.grouped_shuffling is True and cfg.dataset.update_epoch_batch_itr is False
    # the one iterator still draws a new grouped order each epoch
    itr = EpochBatchIterator(TensorDataset(torch.arange(12)), None, [[i] for i in range(12)], seed=3, num_shards=2,
                             shard_id=0, grouped_shuffling=True)
    orders = [[b[0] for b in itr.ordered_batches(epoch, fix_batches_to_gpus=False, shuffle=True)] for epoch in (2, 3)]
    assert orders[0] != orders[1] and all(i % 2 == 0 for order in orders for i in order)


def test_table_gives_scaling_to_a_tenth_of_a_percent_and_kernel_launches_beside_all_gpu_activities():
    common = dict(arch="big", max_tokens=8192, ups=30.0, step_ms=30.0, mfu=0.3, kernels_per_step=649.0,
                  kernel_launches_per_step=550.0)
    results = [dict(common, system="ls-fp16-graphs", gpus=1, wps=247393.0),
               dict(common, system="ls-fp16-graphs", gpus=2, wps=443316.0)]
    rows = [line.split(" | ") for line in bench.table(results).splitlines()]
    header = rows[0]
    assert len(header) == len(rows[2]) == len(rows[3])  # rows[1]: the separator
    two = dict(zip(header, rows[3]))
    assert two["scaling"] == "89.6%"  # not rounded up to the 90% it misses
    assert two["kernels/step"] == "649" and two["kernel launches/step"] == "550"


def test_memory_peak_replays_the_allocation_history_to_its_peak():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import memory_peak

    def alloc(addr, size, op):
        return dict(action="alloc", addr=addr, size=size, frames=[dict(filename="/r/ls_fairseq/ops/" + op, line=7, name="forward")])

    trace = [alloc(1, 100, "a.py"), alloc(2, 300, "b.py"), dict(action="free_completed", addr=1, size=100),
             alloc(3, 50, "a.py"), alloc(4, 120, "c.py"), dict(action="free_completed", addr=4, size=120)]
    peak, at, live = memory_peak.live_at_peak(trace)
    assert (peak, at) == (470, 4) and sorted(live) == [2, 3, 4]
    assert memory_peak.where(trace[4]) == "c.py:7 forward"


def test_gpu_idle_is_the_profile_window_less_the_union_of_overlapping_activities(monkeypatch):
    from types import SimpleNamespace

    from fairseq.tasks import FairseqTask
    from fairseq.trainer import Trainer

    # the hooks patch fairseq's trainer and torch when imported: put them back after the test
    for owner, name in ((Trainer, "train_step"), (Trainer, "begin_epoch"), (Trainer, "clip_grad_norm"),
                        (FairseqTask, "optimizer_step"), (torch.cuda, "reset_peak_memory_stats")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.syspath_prepend(os.path.dirname(bench.__file__))
    import bench_hooks

    def activity(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # b runs on a second stream inside a's span; c after a 5 us gap; d after 2 us, e overlapping d
    acts = [activity("c", 30, 40), activity("a", 0, 20), activity("b", 10, 25), activity("d", 42, 50),
            activity("e", 45, 60)]
    assert bench_hooks._gaps(acts) == [(5, "b", "c"), (2, "c", "d")]
