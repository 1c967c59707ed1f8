"""A Hugging Face-style text classifier loop: a Dataset that tokenizes in __getitem__ (slowly, in pure
Python, as a slow tokenizer does), dict samples {"input_ids", "attention_mask", "labels"} batched by the
default collate, a tiny transformer whose forward takes those keywords and returns an output object
with `.loss` and `.logits`, called as `out = model(**batch)`, AdamW.

Prints its own throughput every --log-steps optimizer steps:
    step 10 samples/s 123.4 loss 1.0986
"""

import argparse
import random
import time
import unicodedata

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

VOCABULARY_TEXT = """the a an of to in and or but for with on at by from as is was are were be been being it this
that these those he she they we you i me him her them us my your his its our their what which who whom
whose when where why how all any both each few more most other some such no nor not only own same so
than too very can will just should now train model data batch loader worker tensor gradient optimizer
learning rate loss accuracy epoch step sample token sentence word vocabulary embedding attention layer
head hidden network neural deep machine python torch cuda device memory cache disk network fast slow
quick brown fox jumps over lazy dog cat bird fish tree river mountain city country house road car
train plane ship book paper pen table chair window door light dark red green blue yellow black white
happy sad angry calm good bad great small large big tiny huge long short high low hot cold warm cool
run walk talk read write sing play work sleep eat drink think know see hear feel make take give get
go come say tell ask answer open close start stop begin end win lose find keep hold bring build break
morning evening night day week month year today tomorrow yesterday always never often sometimes
"""
WORDS = VOCABULARY_TEXT.split()
POSITIVE = {"happy", "good", "great", "fast", "quick", "win", "light", "warm", "calm", "open"}
NEGATIVE = {"sad", "bad", "angry", "slow", "lose", "dark", "cold", "break", "stop", "close"}


class WordPieceTokenizer:
    """A greedy longest-match-first subword tokenizer in pure Python (like BERT's slow tokenizer)."""

    def __init__(self, words, max_length):
        pieces = {"[PAD]", "[UNK]", "[CLS]", "[SEP]"}
        for w in words:
            pieces.add(w)
            pieces.update(w[:k] for k in range(1, len(w)))
            pieces.update("##" + w[k:] for k in range(1, len(w)))
        self.vocab = {p: i for i, p in enumerate(sorted(pieces))}
        self.max_length = max_length

    def basic_tokenize(self, text):
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        out, word = [], []
        for c in text:
            if c.isalnum():
                word.append(c)
            else:
                if word:
                    out.append("".join(word))
                    word = []
                if not c.isspace():
                    out.append(c)
        if word:
            out.append("".join(word))
        return out

    def wordpiece(self, word):
        tokens, start = [], 0
        while start < len(word):
            end, piece = len(word), None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab:
                    piece = candidate
                    break
                end -= 1
            if piece is None:
                return ["[UNK]"]
            tokens.append(piece)
            start = end
        return tokens

    def __call__(self, text):
        ids = [self.vocab["[CLS]"]]
        for word in self.basic_tokenize(text):
            ids.extend(self.vocab.get(p, self.vocab["[UNK]"]) for p in self.wordpiece(word))
        ids = [*ids[:self.max_length - 1], self.vocab["[SEP]"]]
        mask = [1] * len(ids)
        pad = self.max_length - len(ids)
        return {"input_ids": ids + [self.vocab["[PAD]"]] * pad, "attention_mask": mask + [0] * pad}


class SentenceDataset(Dataset):
    """Synthetic sentences, made and tokenized on the fly; the label is the sentence's sentiment."""

    def __init__(self, size, tokenizer, sentences_per_sample, seed):
        self.size, self.tokenizer, self.seed = size, tokenizer, seed
        self.sentences_per_sample = sentences_per_sample

    def __len__(self):
        return self.size

    def text(self, index):
        rng = random.Random(self.seed * 1_000_003 + index)
        sentences = []
        for _ in range(self.sentences_per_sample):
            words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        return " ".join(sentences)

    def __getitem__(self, index):
        text = self.text(index)
        # a long document is tokenized whole, then truncated: the usual (slow) way
        encoded = self.tokenizer(text)
        words = text.lower().split()
        score = sum(w.strip(".!?") in POSITIVE for w in words) - sum(w.strip(".!?") in NEGATIVE for w in words)
        label = 0 if score < 0 else (1 if score == 0 else 2)
        return {"input_ids": torch.tensor(encoded["input_ids"], dtype=torch.long),
                "attention_mask": torch.tensor(encoded["attention_mask"], dtype=torch.long),
                "labels": torch.tensor(label, dtype=torch.long)}


class SequenceClassifierOutput(dict):
    """Like transformers' ModelOutput: a dict whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x, key_padding):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding[:, None, None, :])
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.norm2(x))


class TinyTransformerForSequenceClassification(nn.Module):
    def __init__(self, vocab_size, max_length, num_labels, d_model=64, n_head=4, n_layer=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_length, d_model)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_head) for _ in range(n_layer)])
        self.norm = nn.LayerNorm(d_model)
        self.classifier = nn.Linear(d_model, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embeddings(input_ids) + self.positions(positions)
        keep = attention_mask.bool()
        for layer in self.layers:
            x = layer(x, keep)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * weights).sum(1) / weights.sum(1).clamp(min=1)
        logits = self.classifier(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--sentences", type=int, default=96, help="sentences per sample, tokenized then truncated")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--log-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = WordPieceTokenizer(WORDS, args.max_length)
    dataset = SentenceDataset(args.samples, tokenizer, args.sentences, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    model = TinyTransformerForSequenceClassification(len(tokenizer.vocab), args.max_length, num_labels=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    model.train()
    step, window_samples, window_start = 0, 0, time.time()
    for _epoch in range(args.epochs):
        for batch in loader:
            out = model(**batch)
            loss = out.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            window_samples += batch["input_ids"].size(0)
            if step % args.log_steps == 0:
                now = time.time()
                rate = window_samples / (now - window_start)
                window_samples, window_start = 0, now
                print(f"step {step} samples/s {rate:.1f} loss {out['loss'].item():.4f}", flush=True)


if __name__ == "__main__":
    main()
