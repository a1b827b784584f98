"""python -m ls_fairseq.convert to-ctranslate2: a trained model's CTranslate2 translations against
fairseq-generate's on the same weights, from an ls checkpoint and from a stock one."""
import gzip
import os
import re
import sys
import time

import pytest
import torch
from conftest import REPO, USER_DIR, bin_path, run

ctranslate2 = pytest.importorskip("ctranslate2")
sacrebleu = pytest.importorskip("sacrebleu")

from ls_fairseq import convert  # noqa: E402

# fairseq-generate's options and CTranslate2's that decode the same way (the README's table)
BEAM_OPTIONS = {1: dict(lenpen=1.0), 4: dict(lenpen=0.6)}
MAX_LEN_B = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The whole embedded training corpus (33k pairs; the test fixtures' 3k give a model of BLEU
    near 0) and the first 200 test pairs, prepared by the recipe with a 1000-piece vocabulary."""
    root = tmp_path_factory.mktemp("deploy_corpus")
    src = root / "text"
    src.mkdir()
    for split, n in {"train": None, "valid": 100, "test": 200}.items():
        for lang in ("en", "de"):
            with gzip.open(os.path.join(REPO, "data", "lohelp", "{}.{}.gz".format(split, lang)), "rt",
                           encoding="utf-8") as f:
                lines = f.readlines()[:n]
            (src / "{}.{}".format(split, lang)).write_text("".join(lines), encoding="utf-8")
    work = root / "work"
    proc = run(["bash", os.path.join(REPO, "recipes", "wmt14_en_de", "prepare.sh"), "--from", str(src), "--work",
                str(work), "--vocab-size", "1000", "--ratio", "2.5"],
               env={"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work


@pytest.fixture(scope="module")
def ls_checkpoint(corpus, tmp_path_factory):
    """ls_transformer_tiny trained for 600 updates (about 1.5 minutes on two CPU cores): test BLEU
    about 3 at beam 4."""
    save = tmp_path_factory.mktemp("deploy_ckpt")
    proc = run([bin_path("fairseq-train"), str(corpus / "data-bin"), "--user-dir", USER_DIR, "--save-dir", str(save),
                "--arch", "ls_transformer_tiny", "--share-all-embeddings", "--dropout", "0.1",
                "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
                "--optimizer", "ls_adam", "--adam-betas", "(0.9,0.98)", "--lr", "5e-3", "--lr-scheduler", "inverse_sqrt",
                "--warmup-updates", "100", "--clip-norm", "1.0", "--max-tokens", "4096", "--max-update", "600",
                "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "500", "--disable-validation",
                "--no-epoch-checkpoints", "--seed", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return save / "checkpoint_last.pt"


def fairseq_generate(corpus, checkpoint, beam, plugin):
    """(fairseq-generate's best hypothesis per test sentence as SentencePiece pieces {id: str}, its
    sentences/s)."""
    args = [bin_path("fairseq-generate"), str(corpus / "data-bin"), "--path", str(checkpoint), "--cpu",
            "--gen-subset", "test", "--beam", str(beam), "--lenpen", str(BEAM_OPTIONS[beam]["lenpen"]),
            "--max-len-b", str(MAX_LEN_B), "--batch-size", "100"]
    proc = run(args + (["--user-dir", USER_DIR] if plugin else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("ls_fairseq: beam search on the device" in proc.stdout + proc.stderr) == plugin
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            i, _, text = line[2:].split("\t")
            found[int(i)] = text
    speed = re.search(r"Translated .* \(([\d.]+) sentences/s", proc.stdout + proc.stderr)
    return found, float(speed.group(1))


def ctranslate2_translate(model_dir, sources, beam, compute_type):
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type, intra_threads=2)
    start = time.perf_counter()
    out = translator.translate_batch(
        [s.split() for s in sources], beam_size=beam, length_penalty=BEAM_OPTIONS[beam]["lenpen"],
        max_decoding_length=MAX_LEN_B, min_decoding_length=1, max_batch_size=100)
    seconds = time.perf_counter() - start
    return [" ".join(r.hypotheses[0]) for r in out], len(sources) / seconds


def detok(pieces):
    """fairseq's --remove-bpe sentencepiece."""
    return pieces.replace(" ", "").replace("\u2581", " ").strip()


def bleu(hypotheses, references):
    return sacrebleu.corpus_bleu([detok(h) for h in hypotheses], [references]).score


@pytest.mark.slow
def test_ctranslate2_translates_as_fairseq_generate(corpus, ls_checkpoint, tmp_path):
    """The ls checkpoint converted by the command (float32, the dictionaries from --data-dir) and its
    stock conversion by to_ctranslate2 (the dictionaries from the data it was trained on) give the
    same CTranslate2 model, file for file. Its hypotheses against fairseq-generate's on the ls
    checkpoint (with the plugin) and on the stock one (without), at beam 1 and 4: at least 95%
    identical, BLEU within 0.5, and the int8 model's within 1.0."""
    stock = tmp_path / "stock.pt"
    convert.save_atomic(convert.convert(convert.load_checkpoint(str(ls_checkpoint)), to_ls=False), str(stock))
    sources = (corpus / "spm_text" / "test.en").read_text(encoding="utf-8").splitlines()
    references = (corpus / "raw" / "test.de").read_text(encoding="utf-8").splitlines()
    assert len(sources) == len(references) == 200
    models = {"float32": tmp_path / "ct2-float32", "int8": tmp_path / "ct2-int8"}
    proc = run([bin_path("python"), "-m", "ls_fairseq.convert", "to-ctranslate2", str(ls_checkpoint),
                str(models["float32"]), "--quantization", "float32", "--data-dir", str(corpus / "data-bin")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert.to_ctranslate2(str(ls_checkpoint), str(models["int8"]), data_dir=str(corpus / "data-bin"),
                           quantization="int8")
    from_stock = tmp_path / "ct2-stock-float32"
    convert.to_ctranslate2(str(stock), str(from_stock), quantization="float32")
    files = sorted(p.name for p in models["float32"].iterdir())
    assert files == sorted(p.name for p in from_stock.iterdir()) and "model.bin" in files, files
    for name in files:
        assert (models["float32"] / name).read_bytes() == (from_stock / name).read_bytes(), name

    report = {"ls": {}, "stock": {}}
    for beam in (1, 4):
        hyp, speed = ctranslate2_translate(models["float32"], sources, beam, "float32")
        if beam == 4:
            int8, int8_speed = ctranslate2_translate(models["int8"], sources, beam, "int8")
        for source, checkpoint in (("ls", ls_checkpoint), ("stock", stock)):
            ref, fairseq_speed = fairseq_generate(corpus, checkpoint, beam, plugin=source == "ls")
            ref = [ref[i] for i in range(len(sources))]
            same = sum(a == b for a, b in zip(ref, hyp)) / len(ref)
            report[source][beam] = dict(identical=same, fairseq_bleu=bleu(ref, references),
                                        ct2_bleu=bleu(hyp, references), ct2_sentences_per_s=speed,
                                        fairseq_sentences_per_s=fairseq_speed)
            assert same >= 0.95, (source, beam, same, [(a, b) for a, b in zip(ref, hyp) if a != b][:3])
            if beam == 4:
                report[source][beam].update(int8_bleu=bleu(int8, references), int8_sentences_per_s=int8_speed)
    print(report)
    for source in ("ls", "stock"):
        beam4 = report[source][4]
        assert beam4["fairseq_bleu"] > 2.5, report  # a model whose BLEU means something
        assert abs(beam4["ct2_bleu"] - beam4["fairseq_bleu"]) <= 0.5, report
        assert abs(beam4["int8_bleu"] - beam4["fairseq_bleu"]) <= 1.0, report


def test_to_ctranslate2_bad_input_gets_a_clear_error(tmp_path, monkeypatch):
    import argparse

    from fairseq.data import Dictionary

    ckpt = tmp_path / "model.pt"
    d = Dictionary()
    for w in "abcdef":
        d.add_symbol(w)
    state = {"args": None, "cfg": {"model": argparse.Namespace(arch="transformer", task="translation", data=None),
                                   "task": {"_name": "translation"}},
             "model": {"encoder.embed_tokens.weight": torch.zeros(len(d), 4),
                       "decoder.embed_tokens.weight": torch.zeros(len(d), 4)}}
    torch.save(state, ckpt)
    with pytest.raises(convert.ConversionError, match="no dictionaries .* --data-dir"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "out"))
    data = tmp_path / "data"
    data.mkdir()
    d.save(str(data / "dict.en.txt"))
    d.save(str(data / "dict.de.txt"))
    with pytest.raises(convert.ConversionError, match="--source-lang and --target-lang"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "out"), data_dir=str(data))
    with pytest.raises(convert.ConversionError, match="no dict.fr.txt"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "out"), data_dir=str(data), source_lang="fr", target_lang="de")
    state["extra_state"] = {"ls_dictionaries": {"target": {"size": len(d), "sha256": "0" * 16}}}
    torch.save(state, tmp_path / "recorded.pt")
    with pytest.raises(convert.ConversionError, match=r"dict.de.txt is not the target dictionary .*\(sha256 0{16} there"):
        convert.to_ctranslate2(str(tmp_path / "recorded.pt"), str(tmp_path / "out"), data_dir=str(data),
                               source_lang="en", target_lang="de")
    d.add_symbol("g")
    d.save(str(data / "dict.de.txt"))
    with pytest.raises(convert.ConversionError, match="dict.de.txt has 11 entries, the checkpoint's decoder"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "out"), data_dir=str(data), source_lang="en", target_lang="de")
    (tmp_path / "exists").mkdir()
    with pytest.raises(convert.ConversionError, match="exists .*--force"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "exists"))
    monkeypatch.setitem(sys.modules, "ctranslate2.converters", None)
    with pytest.raises(convert.ConversionError, match="pip install ctranslate2"):
        convert.to_ctranslate2(str(ckpt), str(tmp_path / "out"))


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """Untrained models saved as fairseq-train saves a checkpoint (its cfg, the model's state dict)
    beside tiny en/de dictionaries (the data they name): a builder, (name, arch, options) -> path."""
    from fairseq import options, tasks
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    import ls_fairseq.fairseq_plugin  # noqa: F401 (registers the ls architectures, as --user-dir does)

    root = tmp_path_factory.mktemp("untrained")
    d = Dictionary()
    for w in "abcdefgh":
        d.add_symbol(w)
    for lang in ("en", "de"):
        d.save(str(root / "dict.{}.txt".format(lang)))

    def build(name, arch, *extra):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [str(root), "--arch", arch, "--source-lang", "en", "--target-lang",
                                                    "de", "--cpu"] + list(extra))
        task = tasks.setup_task(args)
        state = {"args": None, "cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True,
                                                             enum_to_str=True),
                 "model": task.build_model(args).state_dict(), "optimizer_history": [], "extra_state": {},
                 "last_optimizer_state": None}
        path = root / "{}.pt".format(name)
        torch.save(state, path)
        return path

    return build


def renamed(state, arch):
    """``state`` with its model configuration (a dict or, as fairseq saves some, a Namespace) naming
    ``arch``."""
    model = state["cfg"]["model"]
    for key in ("arch", "_name"):
        if isinstance(model, dict):
            model[key] = arch
        else:
            setattr(model, key, arch)
    return state


def refusal(capsys, *argv):
    """python -m ls_fairseq.convert's exit status and its one line on stderr (which it must be)."""
    status = convert.main(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return status, lines[0]


def test_to_ctranslate2_refuses_what_ctranslate2_cannot_take_in_one_line(untrained, tmp_path, capsys):
    """Every case exits with status 2 and one line that names what is unsupported: CTranslate2's own
    reasons (an lstm, mixed normalize_before) before the dictionaries are looked for, ls's (an
    architecture fairseq does not register, an ls one with no stock counterpart, a missing dictionary,
    a file that is no checkpoint)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    small = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16"]
    lstm = untrained("lstm", "lstm", *small, "--encoder-hidden-size", "16", "--decoder-hidden-size", "16",
                     "--decoder-out-embed-dim", "16")
    # refused for what it is, although the dictionaries are missing from --data-dir too
    status, line = refusal(capsys, "to-ctranslate2", str(lstm), str(tmp_path / "out"), "--data-dir", str(empty))
    assert status == 2 and "CTranslate2 cannot convert this model: Model 'lstm' used by architecture 'lstm' is not " \
                           "supported" in line, line

    tiny = ["--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
            "--decoder-attention-heads", "2"] + small
    mixed = untrained("mixed", "ls_transformer_tiny", *tiny, "--encoder-normalize-before")
    status, line = refusal(capsys, "to-ctranslate2", str(mixed), str(tmp_path / "out"))
    assert status == 2 and line.endswith(
        "CTranslate2 cannot convert this model: Options --encoder-normalize-before and --decoder-normalize-before "
        "must have the same value"), line
    # its twin with both sides pre-norm converts (ls trains either), so the refusal is about the mix
    both = untrained("both", "ls_transformer_tiny", *tiny, "--encoder-normalize-before", "--decoder-normalize-before")
    assert convert.main(["to-ctranslate2", str(both), str(tmp_path / "both")]) == 0
    assert (tmp_path / "both" / "model.bin").is_file()

    stock = tmp_path / "stock.pt"
    convert.save_atomic(convert.convert(convert.load_checkpoint(str(both)), to_ls=False), str(stock))
    state = torch.load(stock, weights_only=True)
    renamed(state, "my_arch")
    torch.save(state, tmp_path / "my_arch.pt")
    status, line = refusal(capsys, "to-ctranslate2", str(tmp_path / "my_arch.pt"), str(tmp_path / "out"))
    assert status == 2 and "architecture 'my_arch' is not one that fairseq registers" in line, line
    state = torch.load(both, weights_only=True)
    renamed(state, "ls_my_arch")
    torch.save(state, tmp_path / "ls_my_arch.pt")
    status, line = refusal(capsys, "to-ctranslate2", str(tmp_path / "ls_my_arch.pt"), str(tmp_path / "out"))
    assert status == 2 and "architecture 'ls_my_arch' has no stock transformer counterpart" in line, line

    # the dictionaries are neither in --data-dir nor beside the checkpoint (a copy elsewhere)
    status, line = refusal(capsys, "to-ctranslate2", str(both), str(tmp_path / "out"), "--data-dir", str(empty))
    assert status == 2 and "no dictionaries (dict.SRC.txt, dict.TGT.txt) in {}".format(empty) in line, line

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for direction in ("to-ctranslate2", "to-fairseq"):
        status, line = refusal(capsys, direction, str(tmp_path / "junk.pt"), str(tmp_path / "out"))
        assert status == 2 and "torch.load(weights_only=True) cannot load it" in line, line
    status, line = refusal(capsys, "to-fairseq", str(tmp_path / "missing.pt"), str(tmp_path / "out"))
    assert status == 2 and line.endswith("missing.pt: no such checkpoint"), line
    status, line = refusal(capsys, "to-fairseq", str(stock), str(tmp_path / "out"))
    assert status == 2 and "this is already a stock fairseq transformer checkpoint" in line, line
    assert not (tmp_path / "out").exists()


def test_a_refusal_of_the_command_is_one_line_and_status_2(untrained, tmp_path):
    """The same as the command runs: a stock lstm checkpoint, no traceback."""
    lstm = untrained("lstm_cli", "lstm", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
                     "--encoder-hidden-size", "16", "--decoder-hidden-size", "16", "--decoder-out-embed-dim", "16")
    proc = run([bin_path("python"), "-m", "ls_fairseq.convert", "to-ctranslate2", str(lstm), str(tmp_path / "out")])
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-3000:]
    assert "Model 'lstm' used by architecture 'lstm' is not supported" in proc.stderr, proc.stderr[-3000:]
