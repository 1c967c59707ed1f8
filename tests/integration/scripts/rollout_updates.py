"""A PPO-shaped reinforcement-learning loop, no gym: each cycle collects a rollout (the policy chooses actions under
no_grad for --num-envs environments at a time, the model in training mode, and a NumPy "environment" steps), then
runs --update-epochs x --minibatches updates on minibatches of the rollout. No DataLoader.

Prints its own throughput every cycle: samples trained (minibatch rows) over the cycle's wall time, rollout included:
    cycle 3 rollout 31% samples/s 1234.5
"""

import argparse
import time

import numpy as np
import torch
from torch import nn


class Agent(nn.Module):
    def __init__(self, obs, actions, hidden):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, 1))
        self.actor = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, actions))

    def forward(self, x):
        return self.actor(x), self.critic(x).squeeze(-1)


class Environments:
    """Vectorised toy environments: the observation drifts with the action; some NumPy work per step."""

    def __init__(self, n, obs, work, seed=0):
        self.rng = np.random.default_rng(seed)
        self.state = self.rng.standard_normal((n, obs)).astype(np.float32)
        self.work = work

    def step(self, actions):
        for _ in range(self.work):  # the simulator's own time
            self.state = np.tanh(self.state * 0.9 + 0.1 * actions[:, None]).astype(np.float32)
        reward = -np.abs(self.state).mean(axis=1)
        return self.state.copy(), reward


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--rollout", type=int, default=64, help="environment steps per cycle")
    parser.add_argument("--update-epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--obs", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--env-work", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    actions_n = 4
    agent = Agent(args.obs, actions_n, args.hidden)
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4)
    envs = Environments(args.num_envs, args.obs, args.env_work)
    obs = torch.from_numpy(envs.state.copy())
    size = args.rollout * args.num_envs
    minibatch = size // args.minibatches
    for cycle in range(args.cycles):
        started = time.perf_counter()
        observations, actions, logprobs, returns = [], [], [], []
        for _ in range(args.rollout):
            with torch.no_grad():
                logits, value = agent(obs)
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()
            observations.append(obs)
            actions.append(action)
            logprobs.append(dist.log_prob(action))
            next_obs, reward = envs.step(action.numpy().astype(np.float32))
            returns.append(torch.from_numpy(reward) + 0.99 * value)
            obs = torch.from_numpy(next_obs)
        b_obs, b_actions = torch.cat(observations), torch.cat(actions)
        b_logprobs, b_returns = torch.cat(logprobs), torch.cat(returns)
        collected = time.perf_counter()
        trained = 0
        for _ in range(args.update_epochs):
            order = torch.randperm(size)
            for start in range(0, size, minibatch):
                idx = order[start:start + minibatch]
                logits, value = agent(b_obs[idx])
                dist = torch.distributions.Categorical(logits=logits)
                ratio = (dist.log_prob(b_actions[idx]) - b_logprobs[idx]).exp()
                advantage = b_returns[idx] - value.detach()
                loss = -(ratio * advantage).mean() + 0.5 * ((value - b_returns[idx]) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
                trained += len(idx)
        ended = time.perf_counter()
        print(f"cycle {cycle + 1} rollout {(collected - started) / (ended - started):.0%} "
              f"samples/s {trained / (ended - started):.1f}", flush=True)


if __name__ == "__main__":
    main()
