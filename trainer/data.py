"""Deterministic synthetic token data, sharded across ranks by step.

Each step's global batch is a pure function of (seed, step), so the data position
is just the step number: a resumed run sees exactly the batches it would have seen,
and a run resumed on fewer ranks still trains on the same global batch.
The sequences follow a noisy affine rule, so the loss falls visibly as it learns.
"""

from __future__ import annotations

import torch


class SyntheticTokens:
    def __init__(self, seed: int, vocab: int, seq_len: int, global_batch: int) -> None:
        self.seed, self.vocab, self.seq_len, self.global_batch = seed, vocab, seq_len, global_batch

    def global_batch_at(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (self.global_batch, 1), generator=g)
        mult = torch.randint(1, 8, (self.global_batch, 1), generator=g)
        pos = torch.arange(self.seq_len + 1).unsqueeze(0)
        seq = (start + mult * pos) % self.vocab
        noise = torch.rand(seq.shape, generator=g) < 0.05
        rand = torch.randint(0, self.vocab, seq.shape, generator=g)
        return torch.where(noise, rand, seq)

    def shard(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the step's global batch: (inputs, next-token targets)."""
        rows = self.global_batch_at(step)[rank::world]
        return rows[:, :-1], rows[:, 1:]

    def host_bytes(self, world: int) -> int:
        return (self.global_batch // max(world, 1)) * (self.seq_len + 1) * 8
