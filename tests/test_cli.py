"""End to end through fairseq's command-line tools with --user-dir, on CPU."""
import re

import pytest
import torch
from conftest import USER_DIR, bin_path, run

import ls_fairseq.fairseq_plugin  # noqa: F401 (allowlists the checkpoint types for torch.load below)

pytestmark = pytest.mark.slow

TRAIN = [
    "--arch", "ls_transformer_tiny", "--share-all-embeddings",
    "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--clip-norm", "1.0",
    "--max-tokens", "1024", "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "5",
    "--seed", "3",
]
ALL_FP8 = "qkv,out,q,kv,fc1,fc2,vocab"
# the same on GPUs: one (fairseq-train takes every visible GPU unless told), or two where a test says so
GPU = [a for a in TRAIN if a != "--cpu"]
ONE_GPU = GPU + ["--distributed-world-size", "1"]


def train(data_bin, save_dir, *extra, user_dir=True):
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin")] + (["--user-dir", USER_DIR] if user_dir else [])
    proc = run(cmd + TRAIN + ["--save-dir", str(save_dir)] + list(extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def generate(data_bin, checkpoint, user_dir=True):
    cmd = [bin_path("fairseq-generate"), str(data_bin / "data-bin"), "--path", str(checkpoint), "--cpu",
           "--beam", "4", "--max-len-b", "30", "--batch-size", "64", "--remove-bpe", "sentencepiece"]
    proc = run(cmd + (["--user-dir", USER_DIR] if user_dir else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def hypotheses(output):
    return sorted(line.split("\t")[0] + "\t" + line.split("\t")[2] for line in output.splitlines() if line.startswith("H-"))


def tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def updates(log):
    return [int(n) for n in re.findall(r"num_updates[ =](\d+)", log)]


def test_train_save_resume_generate_and_convert(data_bin, tmp_path):
    save = tmp_path / "ckpt"
    log = train(data_bin, save, "--max-update", "12", "--memory-efficient-fp16")
    assert (save / "checkpoint_last.pt").is_file()
    assert max(updates(log)) == 12
    tb = tmp_path / "tb"
    log = train(data_bin, save, "--max-update", "20", "--memory-efficient-fp16", "--update-freq", "2",
                "--tensorboard-logdir", str(tb))
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 12 updates\)", log), log[-2000:]
    assert min(updates(log)) > 12 and max(updates(log)) == 20
    assert re.search(r"mfu[ =]\d", log), "MFU is not in the training log"
    scalars = tensorboard_scalars(tb / "train_inner")
    assert {"wps", "mfu", "loss"} <= set(scalars) and all(v > 0 for v in scalars["mfu"])

    out = generate(data_bin, save / "checkpoint_last.pt")
    assert re.search(r"BLEU4? = \d+\.\d+", out), out[-2000:]

    stock = tmp_path / "stock.pt"
    proc = run([bin_path("python"), "-m", "ls_fairseq.convert", "to-fairseq", str(save / "checkpoint_last.pt"), str(stock)])
    assert proc.returncode == 0, proc.stderr
    assert "optimizer state is dropped" in proc.stderr
    stock_out = generate(data_bin, stock, user_dir=False)  # no plugin: stock fairseq alone
    assert hypotheses(stock_out) == hypotheses(out) and len(hypotheses(out)) == 200

    back = tmp_path / "back.pt"
    again = tmp_path / "again.pt"
    assert run([bin_path("python"), "-m", "ls_fairseq.convert", "from-fairseq", str(stock), str(back)]).returncode == 0
    assert run([bin_path("python"), "-m", "ls_fairseq.convert", "to-fairseq", str(back), str(again)]).returncode == 0
    s1, s2 = torch.load(stock, weights_only=True), torch.load(again, weights_only=True)
    assert s1["cfg"] == s2["cfg"]
    assert set(s1["model"]) == set(s2["model"]) and all(torch.equal(s1["model"][k], s2["model"][k]) for k in s1["model"])
    ls_orig, ls_back = torch.load(save / "checkpoint_last.pt", weights_only=True), torch.load(back, weights_only=True)
    assert set(ls_orig["model"]) == set(ls_back["model"])
    assert all(torch.equal(ls_orig["model"][k], ls_back["model"][k]) for k in ls_orig["model"])


def test_bf16_through_the_plugin_entry_point(data_bin, tmp_path):
    """ls-fairseq-train keeps --bf16 off fairseq's TPU path (here on the CPU; on a GPU the same)."""
    cmd = [bin_path("ls-fairseq-train"), str(data_bin / "data-bin"), "--save-dir", str(tmp_path)]
    proc = run(cmd + TRAIN + ["--max-update", "4", "--memory-efficient-bf16", "--disable-validation"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\bloss[ =]([\d.]+)", proc.stdout + proc.stderr)]
    assert losses and all(0 < loss < 20 for loss in losses)
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]
    weights = state["model"]["encoder.embed_tokens.weight"]  # saved in fp32, trained in bf16
    assert torch.equal(weights, weights.bfloat16().float())


def test_spawned_workers_train_with_the_plugins_trainer(data_bin, tmp_path):
    """With several GPUs fairseq runs the entry point's main() in processes it spawns (fresh
    interpreters); main() itself installs the plugin's trainer there. Here one such process,
    started with the spawn method as torch.multiprocessing.spawn does, trains 3 updates: the
    `skipped` column only the plugin's trainer logs is there."""
    import sys

    script = "\n".join([
        "import multiprocessing, sys",
        "from fairseq.dataclass.utils import convert_namespace_to_omegaconf",
        "import ls_fairseq.train as entry",
        "if __name__ == '__main__':",
        "    cfg = convert_namespace_to_omegaconf(entry.parse_args(entry.with_user_dir(sys.argv[1:])))",
        "    worker = multiprocessing.get_context('spawn').Process(target=entry.main, args=(cfg,))",
        "    worker.start()",
        "    worker.join()",
        "    sys.exit(worker.exitcode)",
    ])
    args = [str(data_bin / "data-bin"), "--save-dir", str(tmp_path), "--max-update", "3", "--disable-validation",
            "--memory-efficient-fp16", "--log-interval", "1"] + TRAIN
    proc = run([sys.executable, "-c", script] + args)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert re.search(r"num_updates[ =]3\b", log) and re.search(r"skipped[ =]\d", log), log[-3000:]


def test_fp16_loss_scale_decided_on_the_device(data_bin, tmp_path):
    """ls-fairseq-train --fp16: ls_adam's device loss scaler skips and counts the overflowing steps,
    logs the scale, saves it, and a resumed run continues from it."""
    cmd = [bin_path("ls-fairseq-train"), str(data_bin / "data-bin"), "--save-dir", str(tmp_path)]
    args = TRAIN + ["--fp16", "--fp16-init-scale", str(2**17), "--disable-validation"]
    proc = run(cmd + args + ["--max-update", "10"])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    intervals = re.findall(r"train_inner.*", log) or re.findall(r".*num_updates[ =](?:5|10)\b.*", log)
    assert len(intervals) == 2, log[-3000:]
    skipped = [int(re.search(r"skipped[ =](\d+)", line).group(1)) for line in intervals]
    scales = [float(re.search(r"loss_scale[ =]([\d.]+)", line).group(1)) for line in intervals]
    assert skipped[0] >= 1 and scales[0] < 2**17, intervals  # 2^17 overflows fp16 gradients
    assert re.search(r"gnorm[ =]\d+\.\d+", intervals[-1]) and re.search(r"clip[ =]\d", intervals[-1])
    saved = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["last_optimizer_state"]
    assert saved["loss_scale"] == scales[-1] and saved["state"]["step"] == 10 - sum(skipped)
    assert saved["state"]["master"].dtype == torch.float32  # --fp16: fp32 master weights inside ls_adam
    proc = run(cmd + args + ["--max-update", "12"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["last_optimizer_state"]["state"]["step"] > 10 - sum(skipped)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_gpu_resume_continues_bit_identically(data_bin, tmp_path, precision):
    """On the GPU with --ls-deterministic: 8 updates in one run, and 4 + resume + 4 (mid-epoch, dropout on,
    ls-fairseq-train's device-decided step and loss scale), end with the same bits in every parameter
    and every optimizer state tensor."""
    import sys

    gpu = ONE_GPU + [precision, "--ls-deterministic", "--attention-dropout", "0.1", "--disable-validation",
                     "--no-epoch-checkpoints"]
    cmd = [sys.executable, "-m", "ls_fairseq.train", str(data_bin / "data-bin")]
    for save, stops in (("straight", ["8"]), ("resumed", ["4", "8"])):
        for stop in stops:
            proc = run(cmd + gpu + ["--save-dir", str(tmp_path / save), "--max-update", stop])
            assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / save / "checkpoint_last.pt", weights_only=True) for save in ("straight", "resumed"))
    assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"] == 8
    assert set(a["model"]) == set(b["model"])
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not differ, "parameters differ after the resume: {}".format(differ)
    sa, sb = a["last_optimizer_state"], b["last_optimizer_state"]
    assert sa.get("loss_scale") == sb.get("loss_scale")
    assert all(torch.equal(sa["state"][k], sb["state"][k]) if torch.is_tensor(sa["state"][k]) else
               sa["state"][k] == sb["state"][k] for k in sa["state"]), "optimizer state differs after the resume"


def test_cuda_graphs_without_a_gpu_fail_clearly(data_bin, tmp_path):
    import sys

    cmd = [sys.executable, "-m", "ls_fairseq.train", str(data_bin / "data-bin"), "--save-dir", str(tmp_path)]
    proc = run(cmd + TRAIN + ["--max-update", "1", "--ls-cuda-graphs"])
    # status 1 from the error, not 134: the batch-prefetch thread, still collating, is stopped first
    assert proc.returncode == 1 and "--ls-cuda-graphs needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [[], ["--ls-fp8", "--ls-fp8-forward", ALL_FP8, "--ls-fp8-dgrad", ALL_FP8]],
                         ids=["fp16", "fp8"])
def test_cuda_graphs_replay_the_eager_steps_bit_for_bit(data_bin, tmp_path, fp8):
    """--ls-cuda-graphs with --ls-deterministic and dropout on: 30 updates, most of them replayed from
    captured graphs (batches of 32 sentences padded to multiples of 32 tokens share a few shapes),
    end with the same bits in every parameter as 30 eager updates; with every GEMM's FP8 too (the
    scaling state is updated on the device, inside the graphs)."""
    gpu = ONE_GPU + fp8 + ["--fp16", "--ls-deterministic", "--attention-dropout", "0.1", "--disable-validation",
                           "--no-epoch-checkpoints", "--max-update", "30", "--max-tokens", "4096", "--batch-size",
                           "32", "--required-seq-len-multiple", "32"]
    eager_and_graphed(data_bin, tmp_path, gpu)


def eager_and_graphed(data_bin, tmp_path, options):
    """Runs ls-fairseq-train with ``options`` eagerly and with --ls-cuda-graphs, asserts that the second
    captured graphs and ended with the same bits in every parameter as the first; returns its log."""
    import sys

    cmd = [sys.executable, "-m", "ls_fairseq.train", str(data_bin / "data-bin")]
    logs = {}
    for name, extra in (("eager", []), ("graphs", ["--ls-cuda-graphs"])):
        proc = run(cmd + options + extra + ["--save-dir", str(tmp_path / name)])
        assert proc.returncode == 0, "{} run: {}".format(name, proc.stderr[-3000:])
        logs[name] = proc.stdout + proc.stderr
    assert "CUDA graph" not in logs["eager"] and "CUDA graph 1 captured" in logs["graphs"], logs["graphs"][-3000:]
    a, b = (torch.load(tmp_path / name / "checkpoint_last.pt", weights_only=True) for name in ("eager", "graphs"))
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not differ, "parameters differ between eager and replayed steps: {}".format(differ)
    return logs["graphs"]


def test_fp8_gemms_train_and_resume(data_bin, tmp_path):
    """--ls-fp8 with every GEMM's forward and input gradient in FP8 (on the CPU, the reference's math):
    the loss falls, and a resume (whose first pass calibrates again) continues the update count."""
    fp8 = ["--ls-fp8", "--ls-fp8-forward", ALL_FP8, "--ls-fp8-dgrad", ALL_FP8, "--bf16",
           "--required-batch-size-multiple", "8", "--required-seq-len-multiple", "8"]
    cmd = [bin_path("ls-fairseq-train"), str(data_bin / "data-bin"), "--save-dir", str(tmp_path)]
    logs = []
    for stop in (16, 24):
        proc = run(cmd + TRAIN + fp8 + ["--max-update", str(stop), "--disable-validation"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs.append(proc.stdout + proc.stderr)
    losses = [float(x) for x in re.findall(r"\bloss[ =]([\d.]+)", logs[0])]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    assert updates(logs[1])[-1] == 24 and min(updates(logs[1])) > 16


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_two_gpus_train_resume_and_keep_the_ranks_identical(data_bin, tmp_path, precision):
    """ls-fairseq-train on two GPUs (fairseq's data-parallel training, ls_adam's one all-reduce over its
    gradient workspace under legacy_ddp): rank 0 alone saves, a second run resumes, and after every
    update both ranks hold the same parameters."""
    import os
    import sys

    from conftest import REPO

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    cmd = [sys.executable, "-m", "ls_fairseq.train", str(data_bin / "data-bin"),
           "--user-dir", os.path.join(REPO, "tests", "rank_hooks"), "--save-dir", str(tmp_path / "ckpt")]
    cmd += GPU + [precision, "--distributed-world-size", "2", "--ddp-backend", "legacy_ddp", "--disable-validation",
                  "--no-epoch-checkpoints"]
    env = {"LS_TEST_RANK_DIR": str(ranks), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    for stop in (4, 8):
        proc = run(cmd + ["--max-update", str(stop)], env=env)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        assert len(re.findall(r"Saved checkpoint", log)) == 1, log[-3000:]
        states = [(ranks / "rank{}.txt".format(r)).read_text() for r in (0, 1)]
        assert states[0] == states[1] and states[0].startswith("{} ".format(stop)), states
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 4 updates\)", log), log[-3000:]


def torchrun_two_cpu_ranks(data_bin, tmp_path, *extra, env=None):
    """ls-fairseq-train --cpu in two processes under torchrun (one node), each rank's update count and
    parameter checksum written after every update (tests/rank_hooks): (process, seconds)."""
    import os
    import time

    from conftest import REPO

    ranks = tmp_path / "ranks"
    ranks.mkdir(exist_ok=True)
    cmd = [bin_path("torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "ls_fairseq.train",
           str(data_bin / "data-bin"), "--user-dir", os.path.join(REPO, "tests", "rank_hooks"),
           "--save-dir", str(tmp_path / "ckpt")]
    cmd += TRAIN + ["--ddp-backend", "legacy_ddp", "--disable-validation", "--no-epoch-checkpoints"] + list(extra)
    start = time.monotonic()
    proc = run(cmd, env=dict(env or {}, LS_TEST_RANK_DIR=str(ranks)), timeout=600)
    return proc, time.monotonic() - start


def test_two_cpu_ranks_under_torchrun_train_resume_and_keep_the_ranks_identical(data_bin, tmp_path):
    """The two-GPU test's checks on CPUs over gloo, as torchrun launches a run: rank 0 alone saves, a
    second run resumes from its update count, and after every update both ranks hold the same
    parameters."""
    for stop in (4, 8):
        proc, _ = torchrun_two_cpu_ranks(data_bin, tmp_path, "--max-update", str(stop))
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        assert "--distributed-backend gloo" in log and len(re.findall(r"Saved checkpoint", log)) == 1, log[-3000:]
        states = [(tmp_path / "ranks" / "rank{}.txt".format(r)).read_text() for r in (0, 1)]
        assert states[0] == states[1] and states[0].startswith("{} ".format(stop)), states
    assert re.search(r"Loaded checkpoint .*\(epoch \d+ @ 4 updates\)", log), log[-3000:]


def test_a_killed_rank_ends_the_torchrun_job_with_an_error_naming_it(data_bin, tmp_path):
    """Rank 1 killed (SIGKILL) after its third update: the other rank does not wait for it in the next
    all-reduce; the whole job ends within 2 minutes, with torchrun's error naming rank 1's signal."""
    proc, seconds = torchrun_two_cpu_ranks(data_bin, tmp_path, "--max-update", "400", env={"LS_TEST_KILL": "1 3"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 120, (seconds, log[-3000:])
    root = log[log.index("Root Cause"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", root), root[:2000]
    assert (tmp_path / "ranks" / "rank0.txt").read_text().split()[0] in ("3", "4")


def test_a_hung_rank_ends_the_torchrun_job_after_the_heartbeat_timeout(data_bin, tmp_path):
    """Rank 1 stops after its third update without exiting (what a rank on a lost node looks like to the
    others): with fairseq's --heartbeat-timeout 15 both ranks end themselves (the other one was
    waiting in the all-reduce) with fairseq's message, and the job ends within a minute."""
    proc, seconds = torchrun_two_cpu_ranks(data_bin, tmp_path, "--max-update", "400", "--heartbeat-timeout", "15",
                                           env={"LS_TEST_HANG": "1 3"})
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and seconds < 60, (seconds, log[-3000:])
    assert "Killing job for not making progress in 15 seconds" in log, log[-3000:]


def test_fine_tune_a_stock_model_with_the_plugin(data_bin, tmp_path):
    stock_dir = tmp_path / "stock"
    stock_args = ["--arch", "transformer_tiny", "--share-all-embeddings", "--criterion", "label_smoothed_cross_entropy",
                  "--optimizer", "adam", "--max-update", "6"]
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin"), "--save-dir", str(stock_dir), "--cpu",
           "--max-tokens", "1024", "--num-workers", "0", "--no-progress-bar", "--lr", "1e-3"] + stock_args
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ls_ckpt = tmp_path / "ls.pt"
    assert run([bin_path("python"), "-m", "ls_fairseq.convert", "from-fairseq", str(stock_dir / "checkpoint_last.pt"),
                str(ls_ckpt)]).returncode == 0
    log = train(data_bin, tmp_path / "ft", "--max-update", "10", "--restore-file", str(ls_ckpt), "--reset-optimizer",
                "--reset-dataloader", "--reset-meters")
    assert "Loaded checkpoint" in log and max(updates(log)) == 10


def test_corrupt_checkpoint_on_resume_is_named_and_nothing_is_lost(data_bin, tmp_path):
    save = tmp_path / "ckpt"
    train(data_bin, save, "--max-update", "4")
    good = (save / "checkpoint_best.pt").read_bytes()
    last = save / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[: len(good) // 3])
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--save-dir", str(save)]
    proc = run(cmd + TRAIN + ["--max-update", "8"])
    assert proc.returncode != 0
    assert "checkpoint_last.pt is corrupt or truncated" in proc.stderr and "checkpoint_best.pt" in proc.stderr
    assert (save / "checkpoint_best.pt").read_bytes() == good
    log = train(data_bin, save, "--max-update", "8", "--restore-file", str(save / "checkpoint_best.pt"))
    assert "Loaded checkpoint" in log


@pytest.mark.parametrize(
    "args,message",
    [
        (["--activation-fn", "swish"], "invalid choice: 'swish'"),
        (["--encoder-embed-dim", "30", "--decoder-embed-dim", "30", "--encoder-attention-heads", "4"],
         "--encoder-embed-dim 30 is not divisible by --encoder-attention-heads 4"),
    ],
)
def test_bad_options_fail_clearly(data_bin, tmp_path, args, message):
    cmd = [bin_path("fairseq-train"), str(data_bin / "data-bin"), "--user-dir", USER_DIR, "--save-dir", str(tmp_path)]
    proc = run(cmd + TRAIN + ["--max-update", "1"] + args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_missing_data_dir_fails_clearly(tmp_path):
    missing = str(tmp_path / "no-such-data")
    proc = run([bin_path("fairseq-train"), missing, "--user-dir", USER_DIR, "--save-dir", str(tmp_path)] + TRAIN)
    assert proc.returncode != 0 and missing in proc.stderr
    assert not list(tmp_path.glob("*.pt"))


def test_recipe_train_sh_trains_averages_and_scores(data_bin, tmp_path):
    """The WMT14 recipe's train.sh on the offline-prepared corpus, with a small architecture."""
    import os
    import sys

    from conftest import REPO

    save = tmp_path / "recipe"
    proc = run(
        ["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "train.sh"), "--work", str(data_bin), "--save", str(save),
         "--max-tokens", "1024", "--", "--arch", "ls_transformer_tiny", "--max-epoch", "2", "--num-workers", "0",
         "--warmup-updates", "10", "--log-interval", "10"],
        env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^BLEU = \d+\.\d+", proc.stdout, re.M), proc.stdout[-2000:]
    assert "averaged 2 checkpoints" in proc.stdout
    for name in ("checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt", "averaged.pt"):
        assert (save / name).is_file(), name
    scalars = tensorboard_scalars(save / "tensorboard" / "train_inner")
    assert {"wps", "ups", "mfu"} <= set(scalars)
