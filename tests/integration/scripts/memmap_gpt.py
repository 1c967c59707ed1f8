"""nanoGPT's train.py, in its shape: uint16 tokens in an np.memmap, `get_batch` at random offsets, a tiny
GPT whose forward is `model(X, Y) -> (logits, loss)`, AdamW, a cosine learning rate set every iteration,
gradient accumulation with the next batch fetched right after the forward, clip_grad_norm_. No DataLoader.

Prints its own throughput every --log-interval iterations:
    iter 10: loss 5.12, time 45.1ms, samples/s 354.2
"""

import argparse
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def prepare(data_dir, tokens, vocab_size, seed):
    """Write train.bin / val.bin (uint16 tokens) the way nanoGPT's prepare.py does, unless already there."""
    for split, n in (("train", tokens), ("val", tokens // 10)):
        path = os.path.join(data_dir, f"{split}.bin")
        if os.path.exists(path) and os.path.getsize(path) == 2 * n:
            continue
        rng = np.random.default_rng(seed + (split == "val"))
        arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n,))
        arr[:] = rng.integers(0, vocab_size, size=n, dtype=np.uint16)
        arr.flush()
        del arr


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="where train.bin/val.bin live (default: a new temp dir)")
    parser.add_argument("--tokens", type=int, default=500_000)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--max-iters", type=int, default=100_000)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--min-lr", type=float, default=6e-5)
    parser.add_argument("--warmup-iters", type=int, default=20)
    parser.add_argument("--lr-decay-iters", type=int, default=100_000)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-interval", type=int, default=2000)
    parser.add_argument("--eval-iters", type=int, default=5)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    own_dir = args.data_dir is None
    data_dir = tempfile.mkdtemp(prefix="memmap_gpt_") if own_dir else args.data_dir
    os.makedirs(data_dir, exist_ok=True)
    try:
        train(args, data_dir)
    finally:
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


def train(args, data_dir):
    torch.manual_seed(args.seed)
    prepare(data_dir, args.tokens, args.vocab_size, args.seed)
    batch_size, block_size = args.batch_size, args.block_size

    def get_batch(split):
        # recreate np.memmap every batch to avoid a memory leak, as nanoGPT does
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        return x, y

    model = GPT(args.vocab_size, block_size, args.n_layer, args.n_head, args.n_embd)
    optimizer = model.configure_optimizers(0.1, args.learning_rate, (0.9, 0.95))

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > args.lr_decay_iters:
            return args.min_lr
        decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return args.min_lr + coeff * (args.learning_rate - args.min_lr)

    accum = args.gradient_accumulation_steps
    X, Y = get_batch("train")  # fetch the very first batch
    t0 = time.time()
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            t0 = time.time()  # the evaluation is not training time
        for _micro_step in range(accum):
            _logits, loss = model(X, Y)
            loss = loss / accum  # scale the loss to account for gradient accumulation
            # immediately async prefetch next batch while model is doing the forward pass on the GPU
            X, Y = get_batch("train")
            loss.backward()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num % args.log_interval == 0:
            t1 = time.time()
            dt = (t1 - t0) / args.log_interval
            t0 = t1
            lossf = loss.item() * accum
            rate = batch_size * accum / dt
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.1f}ms, samples/s {rate:.1f}, lr {lr:.2e}",
                  flush=True)
        if iter_num > args.max_iters:
            break


if __name__ == "__main__":
    main()
