"""Kill tiny CPU training runs again and again; show that every checkpoint survives whole.

Each round starts a run in a save folder and SIGKILLs it: from ls_fairseq's fault
hook (``LS_FAIRSEQ_TEST_KILL_AT``, see ls_fairseq/checkpoint.py ``fault_point``) at
a chosen point of a checkpoint's write or copy, or from outside after a random delay.
After every kill the script
- loads every ``*.pt`` file in the folder (none may be truncated), finds at most one
  ``*.tmp`` (the interrupted write; the next save removes it), checks that each
  ``checkpoint_<epoch>_<updates>.pt`` holds the update count its name says, and that
  ``checkpoint_last.pt`` holds the update count of the last save that put it in place;
- reads the next round's log: the run must resume from ``checkpoint_last.pt`` at
  exactly that update count (or start afresh when there was none).
A last run without a kill resumes and trains to its end. Half of the kills go to
``fairseq-train --user-dir ls_fairseq``, half to ``ls-fairseq-train``, each in a
folder of its own (their optimizers' checkpoints differ: fairseq refuses to resume
one from the other's without --reset-optimizer). Printed: where each kill
landed (a hook point, or for a random kill the phase the log was in: startup,
training, validation, the first file's write, the copies), and the checks passed.

    python scripts/fault_checkpoints.py --kills 30 --hooked 14

tests/test_fault_checkpoints.py runs a shorter version through ``run_rounds``.
"""
import argparse
import collections
import functools
import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ls_fairseq.checkpoint import FAULT_POINTS, FAULT_VARIABLE  # noqa: E402

SAVE_INTERVAL_UPDATES = 3
TRAIN = [
    "--arch", "ls_transformer_tiny", "--share-all-embeddings", "--encoder-layers", "1", "--decoder-layers", "1",
    "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "1e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--max-tokens", "512", "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "1",
    "--seed", "1", "--max-update", "100000",
    "--save-interval-updates", str(SAVE_INTERVAL_UPDATES), "--keep-interval-updates", "3",
    "--validate-interval-updates", str(SAVE_INTERVAL_UPDATES), "--keep-last-epochs", "2",
]
CLIS = ("fairseq-train", "ls-fairseq-train")


def bin_path(name):
    # the interpreter's own console script, else the one on PATH
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else shutil.which(name) or beside


def make_data_bin(root, pairs=240, valid=16, vocab=40, seed=0):
    """A synthetic translation corpus (target: the source's words reversed, renamed), binarized by
    fairseq-preprocess with a joined dictionary; returns the data-bin folder."""
    rng = random.Random(seed)
    text = os.path.join(root, "text")
    os.makedirs(text, exist_ok=True)
    for split, n in (("train", pairs), ("valid", valid)):
        src, tgt = [], []
        for _ in range(n):
            words = [rng.randrange(vocab) for _ in range(rng.randint(3, 24))]
            src.append(" ".join("w{}".format(w) for w in words))
            tgt.append(" ".join("w{}".format((w * 7 + 3) % vocab) for w in reversed(words)))
        for lang, lines in (("src", src), ("tgt", tgt)):
            with open(os.path.join(text, "{}.{}".format(split, lang)), "w") as f:
                f.write("\n".join(lines) + "\n")
    out = os.path.join(root, "data-bin")
    subprocess.run(
        [bin_path("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
         "--trainpref", os.path.join(text, "train"), "--validpref", os.path.join(text, "valid"),
         "--destdir", out, "--workers", "1"],
        check=True, capture_output=True,
    )
    return out


def command(cli, data_bin, save_dir, max_update=None):
    cmd = [bin_path(cli), data_bin] + TRAIN + ["--save-dir", save_dir]
    if cli == "fairseq-train":
        cmd += ["--user-dir", os.path.join(REPO, "ls_fairseq")]
    if max_update is not None:
        cmd += ["--max-update", str(max_update)]
    return cmd


def environment(kill_at=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(FAULT_VARIABLE, None)
    if kill_at:
        env[FAULT_VARIABLE] = kill_at
    return env


def launch(cmd, env, delay=None, timeout=600):
    """Run ``cmd`` to its end, or SIGKILL it ``delay`` seconds after its start; (log, return code)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=delay if delay is not None else timeout)
        except subprocess.TimeoutExpired:
            if delay is None:
                proc.kill()
                raise
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.seek(0)
        return log.read(), proc.returncode


SAVE_START = re.compile(r"Preparing to save checkpoint for epoch \d+ @ (\d+) updates")
SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")
LOADED = re.compile(r"Loaded checkpoint (\S+) \(epoch \d+ @ (\d+) updates\)")
HOOK = re.compile(r"ls_fairseq fault hook: SIGKILL at (\w+) (\S+)")


PHASES = (  # a line of fairseq's log and the phase it begins
    ("Start iterating over samples", "training"),
    ("| train_inner |", "training"),
    ('begin validation on "valid"', "validation"),
    ("Preparing to save checkpoint", "save: first file"),
    ("Finished saving checkpoint to", "save: copies"),
    ("Saved checkpoint", "training"),
)


def phase(log):
    """The phase a killed run's log stopped in (startup: before its first training step)."""
    at, where = max((log.rfind(line), name) for line, name in PHASES)
    return where if at >= 0 else "startup"


def last_updates(log, start):
    """The update counts checkpoint_last.pt may hold after this log's run: that of the last save that
    finished (or that the hook killed after checkpoint_last.pt was renamed in place), else ``start``;
    also that of the save a random kill landed in the copies of (checkpoint_last.pt is the last copy)."""
    updates = start
    for m in SAVED.finditer(log):
        updates = int(m.group(1))
    started = [int(m.group(1)) for m in SAVE_START.finditer(log)]
    hook = HOOK.search(log)
    if hook:
        done = hook.group(2).endswith("checkpoint_last.pt") and hook.group(1).endswith("_renamed")
        return {started[-1] if done else updates}
    if phase(log) == "save: copies":
        return {updates, started[-1]}
    return {updates}


def checkpoint_updates(path):
    import torch

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the checkpoint allowlist)

    state = torch.load(path, map_location="cpu", weights_only=True)
    assert "model" in state and state["model"], "{}: no model state".format(path)
    return state["optimizer_history"][-1]["num_updates"]


def check_folder(save_dir):
    """Every .pt file loads; named interval checkpoints hold their updates. {name: updates}."""
    found = {}
    for path in sorted(glob.glob(os.path.join(save_dir, "*.pt"))):
        name = os.path.basename(path)
        try:
            found[name] = checkpoint_updates(path)
        except Exception as e:
            raise AssertionError("{} does not load: {}: {}".format(name, type(e).__name__, e)) from e
        m = re.fullmatch(r"checkpoint_\d+_(\d+)\.pt", name)
        if m:
            assert found[name] == int(m.group(1)), "{} holds {} updates".format(name, found[name])
    return found


def run_rounds(cli, data_bin, save_dir, kills, hooked, seed=0, delay_range=(3.0, 9.0), say=print):
    """``kills`` killed runs of ``cli`` (``hooked`` of them from the fault hook), each checked, then a
    last run to the end; returns {"landed": Counter of where the kills landed, "resumes": number checked}."""
    rng = random.Random(seed)
    plan = ["hook"] * hooked + ["random"] * (kills - hooked)
    rng.shuffle(plan)
    landed, resumes, hooks = collections.Counter(), 0, rng.randrange(len(FAULT_POINTS))
    expected = None  # update count in checkpoint_last.pt; None: no checkpoint yet
    for i, kind in enumerate(plan + ["final"]):
        kill_at, delay = None, None
        if kind == "hook":
            point, hooks = FAULT_POINTS[hooks % len(FAULT_POINTS)], hooks + 1  # each point in turn
            kill_at = "{}:{}".format(point, rng.randint(1, 3))
        elif kind == "random":
            delay = rng.uniform(*delay_range)
        max_update = (expected or 0) + 2 * SAVE_INTERVAL_UPDATES if kind == "final" else None
        t0 = time.time()
        log, code = launch(command(cli, data_bin, save_dir, max_update), environment(kill_at), delay)
        loaded = LOADED.search(log)
        if loaded:
            assert os.path.basename(loaded.group(1)) == "checkpoint_last.pt", loaded.group(0)
            assert int(loaded.group(2)) == expected, "round {}: resumed at {} updates, checkpoint_last.pt had {}".format(
                i, loaded.group(2), expected)
            resumes += 1
        elif "No existing checkpoint found" in log:
            assert expected is None, "round {}: started afresh, checkpoint_last.pt had {} updates".format(i, expected)
        if kind == "final":
            assert code == 0, log[-3000:]
            assert loaded or expected is None
            found = check_folder(save_dir)
            assert found["checkpoint_last.pt"] == max_update, found
            say("final run: resumed at {} updates, trained to {}, {:.1f} s".format(
                expected, max_update, time.time() - t0))
            break
        assert code == -signal.SIGKILL, "round {} ended with {} instead of a kill:\n{}".format(i, code, log[-3000:])
        hook = HOOK.search(log)
        if kind == "hook":
            assert hook, "round {}: the hook {} was not reached:\n{}".format(i, kill_at, log[-3000:])
            where = hook.group(1)
        else:
            where = phase(log)
        landed[where] += 1
        allowed = last_updates(log, expected) if "Start iterating over samples" in log else {expected}
        found = check_folder(save_dir)
        assert found.get("checkpoint_last.pt") in allowed, "round {}: checkpoint_last.pt holds {}, expected {}".format(
            i, found.get("checkpoint_last.pt"), " or ".join(map(str, allowed)))
        expected = found.get("checkpoint_last.pt")
        tmp = sorted(os.path.basename(p) for p in glob.glob(os.path.join(save_dir, "*.tmp")))
        assert len(tmp) <= 1, "round {}: stale temporaries {} (a save removes those of earlier kills)".format(i, tmp)
        say("round {:2d} {:6s} {:24s} -> checkpoint_last.pt @ {} updates, {} .pt files load{}, {:.1f} s".format(
            i, kind, (kill_at or "after {:.1f} s".format(delay)) + ": " + where, expected, len(found),
            ", stale " + " ".join(tmp) if tmp else "", time.time() - t0))
    return {"landed": landed, "resumes": resumes}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30, help="killed runs in all")
    parser.add_argument("--hooked", type=int, default=14, help="of them killed by the fault hook inside a save or copy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", help="folder for the data and checkpoints (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="fault_checkpoints_")
    data_bin = make_data_bin(work)
    t0 = time.time()
    landed, resumes = collections.Counter(), 0
    for k, cli in enumerate(CLIS):
        say = functools.partial(print, cli, flush=True)
        kills, hooked = (args.kills + 1 - k) // 2, (args.hooked + 1 - k) // 2
        result = run_rounds(cli, data_bin, os.path.join(work, cli), kills, hooked, seed=args.seed + k, say=say)
        landed.update(result["landed"])
        resumes += result["resumes"]
    print("kills: {} ({} from the hook), resumes checked: {}, {:.0f} s".format(
        args.kills, args.hooked, resumes, time.time() - t0))
    for where, n in sorted(landed.items()):
        print("  {:20s} {}".format(where, n))
    print("every .pt file loaded after every kill; every resume started at checkpoint_last.pt's update count")


if __name__ == "__main__":
    main()
