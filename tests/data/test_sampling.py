"""Which examples each rank trains on: disjoint, seeded, resumable, length-bucketed; eval shards cover all once."""

from __future__ import annotations

import os
import random

import pytest
import torch

from zerotrain.data.sampling import EpochBatches, eval_shard


def plans(size: int, micro: int, world: int, epoch: int = 0, seed: int = 0, skip: int = 0,
          **kw) -> list[list[list[int]]]:
    """Each rank's micro-batches of one epoch: plans[rank][i]."""
    out = []
    for rank in range(world):
        sampler = EpochBatches(size, micro, rank, world, seed, **kw)
        sampler.set_epoch(epoch, skip)
        out.append(list(sampler))
    return out


def flat(batches) -> list[int]:
    return [i for b in batches for i in b]


@pytest.mark.parametrize("size, micro, world, grad_accum",
                         [(100, 4, 2, 1), (100, 4, 2, 5), (61, 3, 4, 2), (64, 8, 1, 1)])
def test_each_example_at_most_once_per_epoch_across_ranks(size, micro, world, grad_accum):
    per_rank = plans(size, micro, world, epoch=3, grad_accum=grad_accum)
    seen = flat(flat(per_rank))
    assert seen, "no batches at all"
    assert len(seen) == len(set(seen))
    assert set(seen) <= set(range(size))
    assert all(len(b) == micro for rank in per_rank for b in rank)


def test_ranks_micro_batches_are_disjoint_step_by_step():
    per_rank = plans(96, 4, 3, epoch=1)
    steps = list(zip(*per_rank))
    assert len(steps) == len(per_rank[0]) == 96 // 12
    assert all(len(batches) == 3 for batches in steps)
    for batches in steps:
        assert len(set(flat(batches))) == 3 * 4  # one global batch, cut into disjoint micro-batches


@pytest.mark.parametrize("grad_accum, expected", [(1, 12), (2, 12), (5, 10), (7, 7), (13, 0)])
def test_batches_per_epoch_ends_on_an_optimizer_step(grad_accum, expected):
    # 100 examples, 4 x 2 per global batch: 12 micro-batches per rank, 4 examples left over.
    sampler = EpochBatches(100, 4, rank=1, world_size=2, seed=0, grad_accum=grad_accum)
    assert sampler.batches_per_epoch == expected
    sampler.set_epoch(0)
    assert len(sampler) == len(list(sampler)) == expected


def test_same_seed_and_epoch_same_plan_other_epoch_or_seed_other_order():
    a = plans(200, 4, 2, epoch=2, seed=7)
    assert a == plans(200, 4, 2, epoch=2, seed=7)  # new sampler objects: the plan is a pure function
    other_epoch = plans(200, 4, 2, epoch=3, seed=7)
    assert other_epoch != a
    assert sorted(flat(flat(other_epoch))) == sorted(flat(flat(a)))  # reordered, not different examples
    assert plans(200, 4, 2, epoch=2, seed=8) != a


def test_no_shuffle_keeps_the_data_order():
    assert flat(plans(20, 2, 1, epoch=5, shuffle=False)[0]) == list(range(20))


@pytest.mark.parametrize("lengths", [None, "random"])
@pytest.mark.parametrize("skip", [0, 1, 5, 11, 12])
def test_set_epoch_skip_yields_the_tail_of_the_epoch(skip, lengths):
    """A resumed run skips the micro-batches it already trained on and sees exactly the rest."""
    lens = [random.Random(i).randint(1, 50) for i in range(100)] if lengths else None
    for rank in range(2):
        full = EpochBatches(100, 4, rank, 2, seed=3, lengths=lens)
        full.set_epoch(4)
        whole = list(full)
        assert len(whole) == 12
        resumed = EpochBatches(100, 4, rank, 2, seed=3, lengths=lens)
        resumed.set_epoch(4, skip)
        assert len(resumed) == 12 - skip
        assert list(resumed) == whole[skip:]


def padding(batches: list[list[int]], lengths: list[int]) -> float:
    """Sum over batches of (longest - mean length): the padded positions per example."""
    return sum(max(lengths[i] for i in b) - sum(lengths[i] for i in b) / len(b) for b in batches)


def test_length_bucketing_reduces_padding_over_the_same_examples():
    rng = random.Random(0)
    size, micro, world = 3200, 8, 2  # 200 global batches: three windows of 64 and a partial one
    lengths = [rng.randint(5, 500) for _ in range(size)]
    plain = flat(plans(size, micro, world, epoch=1))
    bucketed = flat(plans(size, micro, world, epoch=1, lengths=lengths))
    assert sorted(flat(plain)) == sorted(flat(bucketed)) == list(range(size))
    assert padding(bucketed, lengths) < 0.1 * padding(plain, lengths)
    # Still shuffled: another epoch gives another order of batches.
    assert flat(plans(size, micro, world, epoch=2, lengths=lengths)) != bucketed


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_batch_with_the_longest_example_comes_first_in_every_epoch(shuffle):
    """An out-of-memory shows at step 1, and a short planner trial meets the epoch's peak."""
    rng = random.Random(1)
    size, micro, world = 3200, 8, 2
    lengths = [rng.randint(5, 500) for _ in range(size)]
    lengths[rng.randrange(size)] = 1000  # one outlier, wherever the shuffle puts it
    for epoch in (0, 1, 2):
        per_rank = plans(size, micro, world, epoch=epoch, lengths=lengths, shuffle=shuffle)
        global_batches = [flat(step) for step in zip(*per_rank)]  # each step's micro-batches of all ranks
        assert max(lengths[i] for i in per_rank[0][0]) == 1000  # on rank 0, where peak memory is measured
        assert sorted(flat(global_batches)) == list(range(size))  # moved, not duplicated


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 5, 17, 64])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_eval_shard_covers_every_index_exactly_once(world, size, batch_size):
    shards = [eval_shard(size, batch_size, rank, world) for rank in range(world)]
    everything = sorted(flat(flat(shards)))
    assert everything == list(range(size))
    assert all(0 < len(b) <= batch_size for shard in shards for b in shard)
    # No rank has more than one batch more than another (no padding, so ranks may differ by one batch).
    counts = [len(shard) for shard in shards]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("bucketed", [False, True])
def test_the_plan_depends_on_micro_batch_times_processes_only(bucketed):
    """What a resume on another process count relies on: 2 ranks x 4 and 1 rank x 8 take the same samples, in order."""
    lengths = [i % 7 for i in range(100)] if bucketed else None
    two = [EpochBatches(100, 4, r, 2, seed=3, grad_accum=2, lengths=lengths) for r in range(2)]
    one = EpochBatches(100, 8, 0, 1, seed=3, grad_accum=2, lengths=lengths)
    for sampler in (*two, one):
        sampler.set_epoch(1, skip_batches=2)
    assert one.batches_per_epoch == two[0].batches_per_epoch == 12
    assert [a + b for a, b in zip(*two)] == list(one)


class _Pids(torch.utils.data.Dataset):
    """Each example is the id of the process that read it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return os.getpid()


@pytest.mark.parametrize("persistent", [False, True])
def test_the_training_stream_forks_its_workers_once_not_every_epoch(persistent):
    """An epoch boundary that forks the workers again stalls every rank (a 5% data wait on 4 GPUs); the
    training stream's workers are persistent, so three epochs are read by the same two processes."""
    from zerotrain.data.loader import make_loader, micro_batch_stream

    sampler = EpochBatches(len(_Pids()), 2, rank=0, world_size=1, seed=0)
    loader = make_loader(_Pids(), sampler, lambda items: items, workers=2, seed=0, persistent=persistent)
    stream = micro_batch_stream(loader, sampler, 0, 0)
    pids = {pid for _ in range(3 * sampler.batches_per_epoch) for pid in next(stream)[2]}
    stream.close()
    loader.close()  # as fit ends: no worker outlives it
    assert os.getpid() not in pids
    assert len(pids) == (2 if persistent else 6)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("lengths", [None, [(i * 37) % 101 for i in range(200)]], ids=["plain", "bucketed"])
def test_every_optimizer_step_holds_the_same_samples_however_the_global_batch_is_split(lengths):
    """2 processes x micro 4 and 1 process x micro 4 x accumulation 2 (and 4 x 2 x 1): the same global batch of 8
    trains on the same samples at every step, which a resume on another process count relies on."""

    def steps(micro, world, accum):
        ranks = [list(EpochBatches(200, micro, r, world, seed=3, grad_accum=accum, lengths=lengths)) for r in range(world)]
        micro_steps = [sum((ranks[r][i] for r in range(world)), []) for i in range(len(ranks[0]))]
        return [sorted(sum(micro_steps[s:s + accum], [])) for s in range(0, len(micro_steps), accum)]

    reference = steps(4, 2, 1)
    assert len(reference) == 25
    assert steps(4, 1, 2) == reference
    assert steps(2, 4, 1) == reference
    assert steps(1, 2, 4) == reference
