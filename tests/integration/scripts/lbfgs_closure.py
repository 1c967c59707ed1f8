"""PyTorch's time_sequence_prediction example, in its shape: an LSTMCell model in float64 fitted to sine waves with
`optimizer.step(closure)` and LBFGS, which evaluates the closure (forward, loss, backward) up to `max_iter` times
per step. No DataLoader: the whole training set is one tensor.

Prints its own throughput (sequences per second, one LBFGS step = one pass over the set) every --print-freq steps:
    step 4 loss 0.123456 samples/s 12.3
"""

import argparse
import time

import numpy as np
import torch
from torch import nn


class Sequence(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input):
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--max-iter", type=int, default=20)
    parser.add_argument("--print-freq", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    np.random.seed(0)
    torch.manual_seed(0)
    x = np.arange(args.length + 1) + np.random.randint(-20, 20, (args.sequences, 1))
    data = np.sin(x / 4.0)
    input = torch.from_numpy(data[:, :-1])
    target = torch.from_numpy(data[:, 1:])
    seq = Sequence(args.hidden).double()
    criterion = nn.MSELoss()
    # a line search would make the evaluations per step vary; the example's plain LBFGS makes up to max_iter
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=args.max_iter, tolerance_grad=0,
                                  tolerance_change=0)
    window_samples, window_start = 0, time.perf_counter()
    for i in range(args.steps):
        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            loss.backward()
            return loss
        loss = optimizer.step(closure)
        window_samples += input.size(0)
        if (i + 1) % args.print_freq == 0:
            now = time.perf_counter()
            print(f"step {i + 1} loss {loss.item():.6f} samples/s {window_samples / (now - window_start):.1f}",
                  flush=True)
            window_samples, window_start = 0, now


if __name__ == "__main__":
    main()
