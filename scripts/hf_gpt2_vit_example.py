"""Train a tiny, randomly initialised Hugging Face GPT-2 or ViT with ls_fairseq's fused layers, on the CPU.

GPT-2 (``--family gpt2``): a byte-level causal LM on the embedded corpus (data/lohelp, English lines, one
token a byte, left padding), then greedy ``generate`` from a few prompts through Hugging Face's KV cache.
ViT (``--family vit``): random 16x16 images whose label is the brightest of their three colour channels.
Every GPT2Block / ViTLayer is replaced by its ls layer (ls_fairseq.hf.replace_layers); the loss falls; the
model is saved with the ls layers in place (under Hugging Face's names) and reloads as a plain model.

    python scripts/hf_gpt2_vit_example.py --family gpt2 [--steps 100] [--out DIR]
"""
import argparse
import gzip
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification

from ls_fairseq.hf import replace_layers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD, BOS, MAX_LEN = 0, 1, 48  # byte b is token b + 2


def corpus(n):
    with gzip.open(os.path.join(REPO, "data", "lohelp", "train.en.gz"), "rt", encoding="utf-8") as f:
        return [line.strip() for line, _ in zip(f, range(n)) if line.strip()]


def encode(texts):
    """Left-padded byte tokens and their mask."""
    rows = [[BOS] + [b + 2 for b in t.encode("utf-8")[: MAX_LEN - 1]] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    return ids, ids.ne(PAD).long()


def gpt2_batches(batch_size):
    lines = corpus(4000)
    step = 0
    while True:
        ids, mask = encode(lines[(step * batch_size) % len(lines):][:batch_size])
        step += 1
        yield dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def vit_batches(batch_size):
    while True:
        pixels = torch.randn(batch_size, 3, 16, 16)
        yield dict(pixel_values=pixels, labels=pixels.mean((2, 3)).argmax(-1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("gpt2", "vit"), default="gpt2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="where to save the model (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.family == "gpt2":
        config = GPT2Config(vocab_size=258, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_LEN + 32,
                            bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD)
        cls, batches = GPT2LMHeadModel, gpt2_batches(args.batch_size)
    else:
        config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128, num_labels=3)
        cls, batches = ViTForImageClassification, vit_batches(args.batch_size)
    model = replace_layers(cls(config)).train()
    names = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("LS")})
    print("layers:", ", ".join(names))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(1, args.steps + 1):
        loss = model(**next(batches)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 1 or step % 25 == 0 or step == args.steps:
            print("step {}: loss {:.3f}".format(step, loss.item()))
    model.eval()
    out = args.out or tempfile.mkdtemp(prefix="ls-{}-".format(args.family))
    model.save_pretrained(out)
    plain = cls.from_pretrained(out).eval()
    if args.family == "gpt2":
        ids, mask = encode(["The ", "It is", "We"])
        options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
        generated = model.generate(ids, **options)
        assert torch.equal(generated, plain.generate(ids, **options))
        for row in generated[:, ids.shape[1]:]:
            print("generated:", bytes(max(t - 2, 0) for t in row.tolist()).decode("utf-8", "replace"))
    else:
        batch = next(batches)
        accuracy = (plain(pixel_values=batch["pixel_values"]).logits.argmax(-1) == batch["labels"]).float().mean()
        print("accuracy of the reloaded plain model: {:.3f}".format(accuracy.item()))
    print("saved with ls layers in place in {}; it reloads as a plain {}".format(out, cls.__name__))


if __name__ == "__main__":
    main()
