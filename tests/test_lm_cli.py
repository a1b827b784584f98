"""ls_transformer_lm through fairseq's command-line tools: train (fairseq-train and ls-fairseq-train,
--task language_modeling), convert to stock transformer_lm and back, fairseq-eval-lm and
fairseq-generate on both."""
import gzip
import os
import re
import sys

import pytest
from conftest import REPO, USER_DIR, bin_path, run

# one worker trains the model that the tests share (scripts/test.sh runs pytest-xdist)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lm_cli")]

TRAIN = ["--task", "language_modeling", "--arch", "ls_transformer_lm_gpt2_tiny", "--decoder-embed-dim", "32",
         "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "64",
         "--sample-break-mode", "none", "--max-tokens", "1024", "--criterion", "ls_label_smoothed_cross_entropy",
         "--label-smoothing", "0", "--optimizer", "ls_adam", "--lr", "3e-3", "--max-update", "30", "--cpu",
         "--seed", "1", "--log-format", "simple", "--log-interval", "10", "--no-epoch-checkpoints",
         "--num-workers", "0"]


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    """recipes/lm/prepare.sh --from on the first lines of the embedded corpus's target side (German)."""
    root = tmp_path_factory.mktemp("lm")
    text = root / "text"
    text.mkdir()
    for split, n in {"train": 2000, "valid": 100, "test": 300}.items():
        with gzip.open(os.path.join(REPO, "data", "lohelp", "{}.de.gz".format(split)), "rt", encoding="utf-8") as f:
            (text / "{}.txt".format(split)).write_text("".join(next(f) for _ in range(n)), encoding="utf-8")
    work = root / "work"
    proc = run(["bash", os.path.join(REPO, "recipes", "lm", "prepare.sh"), "--from", str(text), "--work", str(work),
                "--vocab-size", "400"],
               env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "data-bin"


@pytest.fixture(scope="module")
def trained(lm_data, tmp_path_factory):
    """(ls checkpoint, its stock conversion) after 30 updates of fairseq-train with the plugin."""
    save = tmp_path_factory.mktemp("lm_ckpt")
    proc = run([bin_path("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--save-dir", str(save)] + TRAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = save / "stock.pt"
    proc = run([sys.executable, "-m", "ls_fairseq.convert", "to-fairseq", str(save / "checkpoint_last.pt"), str(stock)])
    assert proc.returncode == 0, proc.stderr
    return save / "checkpoint_last.pt", stock


def eval_lm(data, checkpoint):
    """fairseq-eval-lm's (loss base 2, perplexity) on the test split (with the plugin: on torch >= 2.6 stock
    fairseq cannot load any checkpoint without it)."""
    proc = run([bin_path("fairseq-eval-lm"), str(data), "--path", str(checkpoint), "--user-dir", USER_DIR, "--cpu",
                "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "1024"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-3000:]
    return float(found.group(1)), float(found.group(2))


def test_eval_lm_perplexity_equals_the_stock_conversions(lm_data, trained):
    ls_ckpt, stock_ckpt = trained
    loss_ls, ppl_ls = eval_lm(lm_data, ls_ckpt)
    loss_stock, ppl_stock = eval_lm(lm_data, stock_ckpt)
    assert "{:.4g}".format(ppl_ls) == "{:.4g}".format(ppl_stock), (ppl_ls, ppl_stock)
    assert ppl_ls < 400  # trained: below the uniform model's perplexity over the vocabulary


def test_conversion_back_from_stock_gives_the_same_weights(trained, tmp_path):
    import torch

    from ls_fairseq.convert import load_checkpoint

    ls_ckpt, stock_ckpt = trained
    back = tmp_path / "back.pt"
    proc = run([sys.executable, "-m", "ls_fairseq.convert", "from-fairseq", str(stock_ckpt), str(back)])
    assert proc.returncode == 0, proc.stderr
    original, again = load_checkpoint(str(ls_ckpt)), load_checkpoint(str(back))
    assert again["cfg"]["model"]["_name"] == "ls_transformer_lm_gpt2_tiny"
    assert load_checkpoint(str(stock_ckpt))["cfg"]["model"]["_name"] == "transformer_lm_gpt2_tiny"
    assert set(original["model"]) == set(again["model"])
    for name, value in original["model"].items():
        assert torch.equal(value, again["model"][name]), name


def generate(data, checkpoint, *options):
    """fairseq-generate's hypotheses (H lines by sample id) on the test split's blocks of whole sentences, each
    prompted by its first 3 tokens. (--sample-break-mode eos fails in fairseq-fixed on numpy 2: np.compat.long;
    with none a block may start at a sentence's last tokens, and stock's beam search fails where the prompt
    holds an EOS: its "assert step < max_len".)"""
    proc = run([bin_path("fairseq-generate"), str(data), "--path", str(checkpoint), "--user-dir", USER_DIR, "--cpu",
                "--task", "language_modeling", "--gen-subset", "test", "--sample-break-mode", "complete",
                "--tokens-per-sample", "32", "--prefix-size", "3", "--max-len-b", "12", "--batch-size", "16",
                "--skip-invalid-size-inputs-valid-test"]
               + list(options))
    assert proc.returncode == 0, proc.stderr[-3000:]
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            key, score, text = line.split("\t", 2)
            hyps[key] = (float(score), text)
    return hyps, proc.stderr


@pytest.mark.parametrize("options", [["--beam", "1"], ["--beam", "4"]], ids=["greedy", "beam4"])
def test_generate_equals_stock_on_the_converted_model(lm_data, trained, options):
    ls_ckpt, stock_ckpt = trained
    ours, log = generate(lm_data, ls_ckpt, *options)
    theirs, _ = generate(lm_data, stock_ckpt, *options)
    assert len(ours) >= 100, log[-2000:]  # every block of the test split
    assert set(ours) == set(theirs)
    for key, (score, text) in ours.items():  # the same tokens; the scores as two fp32 models' agree
        assert text == theirs[key][1] and abs(score - theirs[key][0]) <= 1e-4, (key, ours[key], theirs[key])
    assert "ls_fairseq: beam search on the device" in log


def test_ctranslate2_greedy_equals_fairseq_generate_on_the_converted_model(lm_data, trained, tmp_path):
    """to-ctranslate2 on the ls checkpoint; ctranslate2.Generator's greedy continuation of each prompt (the first
    3 tokens of the test split's blocks, after the EOS that starts a language model's decoding) equals
    fairseq-generate's, which stops at 12 tokens prompt included."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from fairseq import checkpoint_utils

    import ls_fairseq.fairseq_plugin  # noqa: F401 (the checkpoint types allowed for torch.load)

    ls_ckpt, stock_ckpt = trained
    proc = run([sys.executable, "-m", "ls_fairseq.convert", "to-ctranslate2", str(ls_ckpt), str(tmp_path / "ct2"),
                "--data-dir", str(lm_data)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _ = generate(lm_data, ls_ckpt, "--beam", "1")
    assert len(ours) >= 100
    _, _, task = checkpoint_utils.load_model_ensemble_and_task(  # the blocks fairseq-generate reads
        [str(stock_ckpt)], arg_overrides=dict(data=str(lm_data), sample_break_mode="complete", tokens_per_sample=32))
    task.load_dataset("test")
    d = task.target_dictionary
    keys = sorted(ours, key=lambda k: int(k[2:]))
    prompts = [["</s>"] + [d[t] for t in task.dataset("test")[int(k[2:])]["target"][:3]] for k in keys]
    # a prompt that holds a sentence's EOS (a block starting with a sentence of 1 or 2 pieces) ends fairseq's
    # hypothesis there, where CTranslate2 goes on: those are compared without CTranslate2
    ended = [i for i, prompt in enumerate(prompts) if "</s>" in prompt[1:]]
    for i in ended:
        assert ours[keys[i]][1] == " ".join(prompts[i][1:prompts[i].index("</s>", 1)]), ours[keys[i]]
    keys = [k for i, k in enumerate(keys) if i not in ended]
    prompts = [p for i, p in enumerate(prompts) if i not in ended]
    assert len(keys) >= 100, (len(keys), len(ended))
    results = ctranslate2.Generator(str(tmp_path / "ct2"), device="cpu").generate_batch(
        prompts, max_length=16, include_prompt_in_result=False)
    for key, prompt, result in zip(keys, prompts, results):
        theirs = (prompt[1:] + result.sequences[0])[:12]
        assert " ".join(theirs) == ours[key][1], (key, theirs, ours[key])


def test_sampling_continues_every_prompt_as_stock_does(lm_data, trained):
    """--sampling: the device generator on the ls model and fairseq's on the stock one, 100 prompts or more:
    each prompt kept, samples continuing it (the two draw differently: ls_fairseq.generation's own draw,
    whose distribution tests/test_generate.py checks with a chi-square test)."""
    ls_ckpt, stock_ckpt = trained
    options = ["--beam", "1", "--sampling", "--sampling-topk", "20", "--temperature", "0.8", "--seed", "5"]
    ours, _ = generate(lm_data, ls_ckpt, *options)
    theirs, _ = generate(lm_data, stock_ckpt, *options)
    assert set(ours) == set(theirs) and len(ours) >= 100
    for key in ours:
        assert ours[key][1].split()[:3] == theirs[key][1].split()[:3], key


def test_ls_fairseq_train_trains_a_language_model(lm_data, tmp_path):
    proc = run([bin_path("ls-fairseq-train"), str(lm_data), "--save-dir", str(tmp_path)]
               + [o if o != "30" else "5" for o in TRAIN])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "checkpoint_last.pt").exists()


def test_refused_option_is_named_on_the_command_line(lm_data, tmp_path):
    proc = run([bin_path("fairseq-train"), str(lm_data), "--user-dir", USER_DIR, "--save-dir", str(tmp_path)]
               + TRAIN + ["--decoder-layerdrop", "0.1"])
    assert proc.returncode != 0
    assert "ls_transformer_lm: --decoder-layerdrop: LayerDrop is not implemented" in proc.stderr
