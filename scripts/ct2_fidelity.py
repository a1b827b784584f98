"""CTranslate2 against fairseq-generate on a trained model: the main job's (scripts/run_example.sh).

  python scripts/ct2_fidelity.py --run runs/example [--threads 2] [--runs 3] [--out FILE.md]

Converts the run's checkpoint_last.pt with ``python -m ls_fairseq.convert to-ctranslate2`` (float32 and int8),
translates the test set with fairseq-generate (the ls generator, --cpu) and with ctranslate2.Translator on the
same source pieces (the binarized test set's), at beam 1 and beam 4 (--lenpen 0.6, 200 tokens at most, batches
of 128), and prints a table: the share of hypotheses identical to fairseq-generate's at the same beam, sacrebleu's
BLEU against the untouched references, and sentences per second (fairseq-generate's own figure, which leaves out
loading; CTranslate2's translate_batch alone, after one untimed pass), on ``--threads`` CPU threads for both: the
median of ``--runs`` runs with their range.
"""
import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import time

BEAMS = (1, 4)
LENPEN = 0.6


def post_process(pieces):
    """fairseq's --remove-bpe sentencepiece on a list of pieces."""
    return " ".join(pieces).replace(" ", "").replace("\u2581", " ").strip()


def fairseq_generate(data_bin, checkpoint, beam, threads):
    """({sentence id: detokenized hypothesis}, sentences/s as fairseq-generate reports it)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fairseq-generate"), data_bin, "--user-dir", "ls_fairseq",
         "--path", checkpoint, "--gen-subset", "test", "--beam", str(beam), "--lenpen", str(LENPEN),
         "--batch-size", "128", "--remove-bpe", "sentencepiece", "--cpu"],
        capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit("ct2_fidelity: fairseq-generate failed:\n" + proc.stderr[-3000:])
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            key, _, text = line.split("\t", 2)
            hyps[int(key[2:])] = text
    speed = re.search(r"Translated [0-9,]+ sentences .* in [0-9.]+s \(([0-9.]+) sentences/s", proc.stdout + proc.stderr)
    return hyps, float(speed.group(1)) if speed else float("nan")


def source_pieces(data_bin):
    """The test set's source sentences as fairseq-generate reads them: the binarized pieces, EOS dropped."""
    from fairseq.data import Dictionary, data_utils

    src, tgt = re.match(r"test\.(\w+)-(\w+)\.\w+\.bin", os.path.basename(
        glob.glob(os.path.join(data_bin, "test.*-*.*.bin"))[0])).groups()
    dictionary = Dictionary.load(os.path.join(data_bin, "dict.{}.txt".format(src)))
    dataset = data_utils.load_indexed_dataset(os.path.join(data_bin, "test.{}-{}.{}".format(src, tgt, src)),
                                              dictionary)
    return [[dictionary[t] for t in dataset[i][:-1]] for i in range(len(dataset))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/example", help="the main job's OUT_DIR (default: runs/example)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both (default: 2)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each decoder (default: 3)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    import ctranslate2
    import sacrebleu

    from ls_fairseq.convert import to_ctranslate2

    work = sorted(glob.glob(os.path.join(args.run, "data-*")))[-1]
    data_bin, checkpoint = os.path.join(work, "data-bin"), os.path.join(args.run, "checkpoints", "checkpoint_last.pt")
    with open(os.path.join(work, "raw", "test.de"), encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    sources = source_pieces(data_bin)
    assert len(sources) == len(refs), (len(sources), len(refs))

    def speed(values):
        return "{:.0f} ({:.0f}-{:.0f})".format(statistics.median(values), min(values), max(values))

    rows = []
    for beam in BEAMS:
        runs = [fairseq_generate(data_bin, checkpoint, beam, args.threads) for _ in range(args.runs)]
        assert all(hyps == runs[0][0] for hyps, _ in runs), "fairseq-generate's hypotheses changed between runs"
        ours = [runs[0][0][i] for i in range(len(refs))]
        rows.append(("fairseq-generate (ls)", beam, "-", sacrebleu.corpus_bleu(ours, [refs]).score,
                     speed([s for _, s in runs])))
        for quantization in ("float32", "int8"):
            model = os.path.join(args.run, "ct2-" + quantization)
            if not os.path.isdir(model):
                to_ctranslate2(checkpoint, model, data_dir=data_bin, quantization=quantization)
            translator = ctranslate2.Translator(model, device="cpu", compute_type=quantization,
                                                intra_threads=args.threads)
            speeds = []
            for run in range(args.runs + 1):  # the first pass untimed
                start = time.perf_counter()
                out = translator.translate_batch(sources, beam_size=beam, length_penalty=LENPEN,
                                                 max_decoding_length=200, min_decoding_length=1, max_batch_size=128)
                speeds += [len(sources) / (time.perf_counter() - start)] if run else []
            theirs = [post_process(r.hypotheses[0]) for r in out]
            same = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
            rows.append(("CTranslate2 " + quantization, beam, "{:.1%}".format(same),
                         sacrebleu.corpus_bleu(theirs, [refs]).score, speed(speeds)))
    table = ["| decoder | beam | identical to fairseq-generate's | BLEU | sentences/s ({} threads; median, range) |".format(
        args.threads), "| --- | --- | --- | --- | --- |"]
    table += ["| {} | {} | {} | {:.2f} | {} |".format(*row) for row in rows]
    print("\n".join(table))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
