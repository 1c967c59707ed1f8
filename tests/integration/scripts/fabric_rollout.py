"""Lightning Fabric's PPO example, in its shape: the agent set up with `fabric.setup(agent, optimizer)` and reached
through methods of the returned wrapper (`agent.get_action_and_value(obs)`, forwarded by its __getattr__, never
`agent(obs)`), a rollout under no_grad, minibatch updates with `fabric.backward(loss)`. CPU, one device.

Prints its own throughput every cycle: samples trained over the cycle's wall time, rollout included:
    cycle 3 rollout 31% samples/s 1234.5
"""

import argparse
import time

import numpy as np
import torch
from lightning_fabric import Fabric
from torch import nn


class Agent(nn.Module):
    def __init__(self, obs, actions, hidden):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.actor = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, actions))

    def get_action_and_value(self, x, action=None):
        dist = torch.distributions.Categorical(logits=self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x).squeeze(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--rollout", type=int, default=64)
    parser.add_argument("--update-epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--obs", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--env-work", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0)
    agent = Agent(args.obs, 4, args.hidden)
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4)
    agent, optimizer = fabric.setup(agent, optimizer)
    rng = np.random.default_rng(0)
    state = rng.standard_normal((args.num_envs, args.obs)).astype(np.float32)
    size = args.rollout * args.num_envs
    minibatch = size // args.minibatches
    for cycle in range(args.cycles):
        started = time.perf_counter()
        observations, actions, logprobs, returns = [], [], [], []
        for _ in range(args.rollout):
            obs = torch.from_numpy(state)
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(obs)
            for _ in range(args.env_work):  # the simulator's own time
                state = np.tanh(state * 0.9 + 0.1 * action.numpy()[:, None]).astype(np.float32)
            observations.append(obs)
            actions.append(action)
            logprobs.append(logprob)
            returns.append(torch.from_numpy(-np.abs(state).mean(axis=1)) + 0.99 * value)
        b_obs, b_actions = torch.cat(observations), torch.cat(actions)
        b_logprobs, b_returns = torch.cat(logprobs), torch.cat(returns)
        collected = time.perf_counter()
        trained = 0
        for _ in range(args.update_epochs):
            order = torch.randperm(size)
            for start in range(0, size, minibatch):
                idx = order[start:start + minibatch]
                _, logprob, entropy, value = agent.get_action_and_value(b_obs[idx], b_actions[idx])
                ratio = (logprob - b_logprobs[idx]).exp()
                advantage = b_returns[idx] - value.detach()
                loss = -(ratio * advantage).mean() + 0.5 * ((value - b_returns[idx]) ** 2).mean()
                loss = loss - 0.01 * entropy.mean()
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                trained += len(idx)
        ended = time.perf_counter()
        fabric.print(f"cycle {cycle + 1} rollout {(collected - started) / (ended - started):.0%} "
                     f"samples/s {trained / (ended - started):.1f}")


if __name__ == "__main__":
    main()
