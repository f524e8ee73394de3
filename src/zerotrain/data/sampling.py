"""Which examples go into which micro-batch on which rank: seeded, resumable, optionally length-bucketed.

The whole plan of an epoch is a pure function of (seed, epoch, dataset size, world size), so a
resumed run rebuilds it and skips the micro-batches already consumed, instead of iterating
through them. Each global batch (micro_batch_size x world_size examples) is cut into one
micro-batch per rank.

The plan is made per optimizer step (micro_batch_size x world_size x grad_accum examples) and depends on
those three only through that product: each step is then cut into grad_accum micro-steps of
micro_batch_size x world_size examples. So a run resumed on another process count with the same global
batch (accumulation changed to keep it, see ``checkpoint.keep_global_batch``) trains every step on the same
samples; a position (micro-batches consumed per rank) counts micro-steps and is converted on such a resume.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
from torch.utils.data import Sampler


class EpochBatches(Sampler[list[int]]):
    """Batch sampler for one rank. Call :meth:`set_epoch` before iterating."""

    def __init__(self, size: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 grad_accum: int = 1, lengths: Optional[Sequence[int]] = None, shuffle: bool = True):
        self.size, self.micro, self.rank, self.world = size, micro_batch_size, rank, world_size
        self.seed, self.lengths, self.shuffle, self.grad_accum = seed, lengths, shuffle, grad_accum
        per_rank = size // (micro_batch_size * world_size)
        # Epochs end on an optimizer-step boundary: leftover micro-batches are dropped.
        self.batches_per_epoch = per_rank - per_rank % grad_accum
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def global_batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(self.size, generator=g).tolist() if self.shuffle else list(range(self.size))
        gb = self.micro * self.world
        step = gb * self.grad_accum  # examples of one optimizer step
        steps = self.batches_per_epoch // self.grad_accum
        if self.lengths is not None:
            # Sort within windows of 64 optimizer steps: similar lengths share a batch (less padding)
            # while the data order stays random at a coarser grain.
            window = 64 * step
            order = [i for s in range(0, len(order), window)
                     for i in sorted(order[s:s + window], key=lambda j: self.lengths[j])]
        planned = [order[s:s + step] for s in range(0, steps * step, step)]
        if self.lengths is not None:
            if self.shuffle:
                perm = torch.randperm(len(planned), generator=g).tolist()
                planned = [planned[i] for i in perm]
            # The step holding the longest example goes first (as Hugging Face's length-grouped
            # sampler does), its longest examples to rank 0's first micro-batch: a run that will run out of
            # memory does so at its first step, and a short planner trial meets the epoch's peak memory on
            # rank 0, where peaks are measured.
            if planned:
                longest = max(range(len(planned)), key=lambda b: max(self.lengths[i] for i in planned[b]))
                planned[0], planned[longest] = planned[longest], planned[0]
                planned[0] = sorted(planned[0], key=lambda i: -self.lengths[i])
        batches = [p[s:s + gb] for p in planned for s in range(0, step, gb)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        for b in self.global_batches(self.epoch)[self.skip:]:
            yield b[self.rank * self.micro:(self.rank + 1) * self.micro]

    def __len__(self) -> int:
        return self.batches_per_epoch - self.skip


def eval_shard(size: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """Every example exactly once across ranks (no padding, so summed metrics are exact)."""
    mine = list(range(rank, size, world_size))
    return [mine[s:s + batch_size] for s in range(0, len(mine), batch_size)]
