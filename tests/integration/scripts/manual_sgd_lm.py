"""PyTorch's word_language_model example, in its shape: batchify + get_batch slicing, an LSTM LM with its
hidden state repackaged, clip_grad_norm_ and a MANUAL parameter update (no optimizer, no DataLoader).

Time-major like the example: the model takes (seq_len, batch) token ids into a non-batch_first LSTM, so a
batch's sequences are its second dimension.
Prints its own throughput every --log-interval batches:
    | epoch 1 |    10/  285 batches | ms/batch 12.34 | samples/s 1620.5 | loss 6.90 |
"""

import argparse
import math
import time

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.ntoken = nhid, nlayers, ntoken
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def synthetic_corpus(tokens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (tokens,), generator=g)


def batchify(data, bsz):
    """Cut the token stream into `bsz` columns, one sequence per column: (nbatch, bsz)."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].reshape(-1)
    return data, target


def repackage_hidden(h):
    """Wrap hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def evaluate(model, criterion, source, args):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(source.size(1))
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, args.bptt):
            data, targets = get_batch(source, i, args.bptt)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(source) - 1)


def train(model, criterion, train_data, epoch, lr, args):
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    nbatches = (train_data.size(0) - 1) // args.bptt
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i, args.bptt)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            rate = args.batch_size * args.log_interval / elapsed
            print(f"| epoch {epoch:3d} | {batch:5d}/{nbatches:5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | samples/s {rate:.1f} | "
                  f"loss {cur_loss:5.2f} | ppl {math.exp(min(cur_loss, 50)):8.2f} |", flush=True)
            total_loss = 0.0
            start_time = time.time()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--emsize", type=int, default=64)
    parser.add_argument("--nhid", type=int, default=64)
    parser.add_argument("--nlayers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=20.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    corpus = synthetic_corpus(args.tokens, args.vocab, args.seed)
    split = int(len(corpus) * 0.9)
    train_data = batchify(corpus[:split], args.batch_size)
    val_data = batchify(corpus[split:], 10)
    model = RNNModel(args.vocab, args.emsize, args.nhid, args.nlayers)
    criterion = nn.NLLLoss()

    lr = args.lr
    best_val_loss = None
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train(model, criterion, train_data, epoch, lr, args)
        val_loss = evaluate(model, criterion, val_data, args)
        print("-" * 89)
        print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
              f"valid loss {val_loss:5.2f} |")
        print("-" * 89)
        if best_val_loss is None or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            lr /= 4.0  # anneal the learning rate when no improvement on the validation set


if __name__ == "__main__":
    main()
