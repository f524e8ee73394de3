"""Masking rates, checked statistically as HelloDeepSpeed's test_train_bert does."""

from __future__ import annotations

import itertools

import torch

from zerotrain.data.masking import IGNORE_INDEX, mask_tokens

VOCAB, MASK_ID = 1000, 3
SPECIAL_IDS = (0, 1, 2)


def _draws(positions: int, chunk: int = 4_000_000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = chunk // 500
    special = torch.zeros(rows, 500, dtype=torch.bool)
    special[:, 0] = special[:, -1] = True  # <s> ... </s>
    for _ in range(positions // chunk):
        # Ids in [4, VOCAB) so that no original token is <mask> or special by accident.
        ids = torch.randint(4, VOCAB, (rows, 500), generator=g)
        ids[:, 0], ids[:, -1] = 0, 2
        masked, labels = mask_tokens(ids, special, MASK_ID, VOCAB, generator=g)
        yield ids, special, masked, labels


def test_rates_match_bert_within_1e3():
    draws = _draws(20_000_000)  # 5 chunks of 4M positions, drawn one at a time
    # The invariants, on the first chunk; the rates over all 20M positions.
    first = next(draws)
    ids, special, masked, labels = first
    chosen = labels != IGNORE_INDEX
    assert not (chosen & special).any(), "special tokens must never be chosen"
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(masked[~chosen], ids[~chosen]), "positions off the selection must be untouched"
    eligible = chosen_n = to_mask = unchanged = 0
    for ids, special, masked, labels in itertools.chain([first], draws):
        chosen = labels != IGNORE_INDEX
        eligible += int((~special).sum())
        chosen_n += int(chosen.sum())
        to_mask += int((masked == MASK_ID).sum())  # only chosen positions can hold <mask>
        unchanged += int((chosen & (masked == ids)).sum())
    assert eligible == 20_000_000 // 500 * 498  # all five chunks counted, <s> and </s> left out
    random = chosen_n - to_mask - unchanged
    assert abs(chosen_n / eligible - 0.15) < 1e-3
    assert abs(to_mask / chosen_n - 0.8) < 1e-3
    # A random draw equals the original token 1 time in VOCAB; that is well inside the tolerance.
    assert abs(unchanged / chosen_n - 0.1) < 1e-3
    assert abs(random / chosen_n - 0.1) < 1e-3


def test_generator_makes_masks_reproducible_and_global_rng_is_used_without_one():
    ids = torch.randint(4, VOCAB, (8, 64))
    original = ids.clone()
    special = torch.zeros_like(ids, dtype=torch.bool)
    a = mask_tokens(ids, special, MASK_ID, VOCAB, generator=torch.Generator().manual_seed(1))
    b = mask_tokens(ids, special, MASK_ID, VOCAB, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    torch.manual_seed(5)
    c = mask_tokens(ids, special, MASK_ID, VOCAB)
    torch.manual_seed(5)
    d = mask_tokens(ids, special, MASK_ID, VOCAB)
    assert all(torch.equal(x, y) for x, y in zip(c, d))
    assert torch.equal(ids, original), "the input must not be modified in place"


def test_all_special_masks_nothing():
    ids = torch.randint(4, VOCAB, (4, 16))
    masked, labels = mask_tokens(ids, torch.ones_like(ids, dtype=torch.bool), MASK_ID, VOCAB, mask_prob=1.0)
    assert torch.equal(masked, ids)
    assert (labels == IGNORE_INDEX).all()
