"""Which examples go into which micro-batch on which rank: seeded, resumable, optionally length-bucketed.

The whole plan of an epoch is a pure function of (seed, epoch, dataset size, world size), so a
resumed run rebuilds it and skips the micro-batches already consumed, instead of iterating
through them. Each global batch (micro_batch_size x world_size examples) is cut into one
micro-batch per rank.

The plan depends on micro_batch_size and world_size only through their product, and a position
(micro-batches consumed per rank) counts those global batches: a run resumed on another process
count with the same product (see ``checkpoint.check_compatible``) continues at the same samples.
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
        self.seed, self.lengths, self.shuffle = seed, lengths, shuffle
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
        if self.lengths is not None:
            # Sort within windows of 64 global batches: similar lengths share a batch (less padding)
            # while the data order stays random at a coarser grain.
            window = 64 * gb
            order = [i for s in range(0, len(order), window)
                     for i in sorted(order[s:s + window], key=lambda j: self.lengths[j])]
        batches = [order[s:s + gb] for s in range(0, self.batches_per_epoch * gb, gb)]
        if self.lengths is not None:
            if self.shuffle:
                perm = torch.randperm(len(batches), generator=g).tolist()
                batches = [batches[i] for i in perm]
            # The batch holding the longest example goes first (as Hugging Face's length-grouped
            # sampler does), its longest examples to rank 0: a run that will run out of memory does so
            # at its first step, and a short planner trial meets the epoch's peak memory on rank 0,
            # where peaks are measured.
            if batches:
                longest = max(range(len(batches)), key=lambda b: max(self.lengths[i] for i in batches[b]))
                batches[0], batches[longest] = batches[longest], batches[0]
                batches[0] = sorted(batches[0], key=lambda i: -self.lengths[i])
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
