"""Train a tiny, randomly initialised Hugging Face BERT (no pretrained weights, so no fine-tuning and nothing
to download) with ls_fairseq's fused layers, on the CPU.

The task is made from the embedded corpus (data/lohelp, no download): is a line English or German?
Lines are read as UTF-8 bytes (one token each, no tokenizer to fetch). Every BertLayer is replaced by
ls_fairseq.hf.LSBertLayer, the model trains with AdamW, and is then restored to plain BertLayers
and saved as an ordinary Hugging Face model.

    python scripts/hf_bert_example.py [--steps 150] [--out DIR]
"""
import argparse
import gzip
import os
import random
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification

from ls_fairseq.hf import replace_bert_layers, restore_bert_layers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD, CLS, MAX_LEN = 0, 1, 64  # byte b is token b + 2


def lines(split, lang, n):
    with gzip.open(os.path.join(REPO, "data", "lohelp", "{}.{}.gz".format(split, lang)), "rt", encoding="utf-8") as f:
        return [line.strip() for line, _ in zip(f, range(n)) if line.strip()]


def examples(split, n):
    """(text, label) pairs, label 0 for English and 1 for German, shuffled."""
    found = [(t, 0) for t in lines(split, "en", n)] + [(t, 1) for t in lines(split, "de", n)]
    random.Random(split).shuffle(found)
    return found


def encode(texts):
    rows = [[CLS] + [b + 2 for b in t.encode("utf-8")[: MAX_LEN - 1]] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    return ids, ids.ne(PAD).long()


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        ids, mask = encode([t for t, _ in data])
        predicted = model(ids, attention_mask=mask).logits.argmax(-1)
    model.train()
    return (predicted == torch.tensor([y for _, y in data])).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="where to save the fine-tuned model (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_LEN, num_labels=2,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=PAD)
    model = replace_bert_layers(BertForSequenceClassification(config))
    print("layers:", ", ".join(type(layer).__name__ for layer in model.bert.encoder.layer))
    train, valid = examples("train", 2000), examples("valid", 200)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print("step 0: valid accuracy {:.3f}".format(accuracy(model, valid)))
    for step in range(1, args.steps + 1):
        chunk = [train[(step * args.batch_size + i) % len(train)] for i in range(args.batch_size)]
        ids, mask = encode([t for t, _ in chunk])
        loss = model(ids, attention_mask=mask, labels=torch.tensor([y for _, y in chunk])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.steps:
            print("step {}: loss {:.3f}, valid accuracy {:.3f}".format(step, loss.item(), accuracy(model, valid)))
    out = args.out or tempfile.mkdtemp(prefix="ls-bert-")
    restore_bert_layers(model).save_pretrained(out)
    again = BertForSequenceClassification.from_pretrained(out)
    print("saved as a plain Hugging Face model in {} (reloaded: valid accuracy {:.3f})".format(
        out, accuracy(again, valid)))


if __name__ == "__main__":
    main()
