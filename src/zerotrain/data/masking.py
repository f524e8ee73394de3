"""BERT/RoBERTa masking for masked-language-model training, vectorised on the tensors' device, and
the packed-block dataset that masks each block as the data pipeline reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import Dataset

from zerotrain.data.collate import IGNORE_INDEX


def mask_tokens(
    input_ids: torch.Tensor,
    special_mask: torch.Tensor,
    mask_token_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    random_replace_prob: float = 0.1,
    unmask_replace_prob: float = 0.1,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose positions to predict and corrupt them, as BERT and HelloDeepSpeed do.

    Each position that is not special is chosen independently with probability ``mask_prob``. Of
    the chosen ones, a fraction ``random_replace_prob`` gets a token drawn uniformly from the
    vocabulary, ``unmask_replace_prob`` keeps its token, and the rest become ``mask_token_id``.

    Args:
        input_ids: (B, T) token ids; not modified.
        special_mask: (B, T) bool, True where a position must never be chosen (<s>, </s>, <pad>).
        generator: draws come from it (it must live on ``input_ids.device``), else from torch's
            global RNG of that device, which checkpoints save so that a resumed run masks alike.

    Returns:
        ``(masked_input_ids, labels)``: labels hold the original id at chosen positions, -100 elsewhere.
    """
    if not (0.0 <= random_replace_prob and 0.0 <= unmask_replace_prob
            and random_replace_prob + unmask_replace_prob <= 1.0):
        raise ValueError(f"random_replace_prob {random_replace_prob} + unmask_replace_prob {unmask_replace_prob} "
                         "must be probabilities summing to <= 1")
    device = input_ids.device
    chosen = torch.rand(input_ids.shape, device=device, generator=generator) < mask_prob  # (B, T)
    chosen &= ~special_mask.bool()
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))  # (B, T)

    # One uniform draw per position splits the chosen ones into [random | unchanged | <mask>].
    u = torch.rand(input_ids.shape, device=device, generator=generator)  # (B, T)
    to_random = chosen & (u < random_replace_prob)
    to_mask = chosen & (u >= random_replace_prob + unmask_replace_prob)
    random_ids = torch.randint(vocab_size, input_ids.shape, device=device, generator=generator, dtype=input_ids.dtype)

    masked = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


@dataclass(frozen=True)
class BlockMasker:
    """:func:`mask_tokens` for one packed block, with the tokenizer's ids it needs (small and picklable,
    so a loader worker gets its own copy)."""

    special_ids: tuple[int, ...]
    """Ids never chosen: <s>, </s>, <pad>."""
    mask_token_id: int
    vocab_size: int
    mask_prob: float = 0.15
    random_replace_prob: float = 0.1
    unmask_replace_prob: float = 0.1

    def __call__(self, block: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        block = block.long()  # packed blocks are stored narrow (int32); ids up to the vocabulary need int64 draws
        special = torch.isin(block, torch.tensor(self.special_ids, dtype=block.dtype))  # (T,)
        masked, labels = mask_tokens(block[None], special[None], self.mask_token_id, self.vocab_size,
                                     self.mask_prob, self.random_replace_prob, self.unmask_replace_prob, generator)
        return masked[0], labels[0]  # (T,) each


class MaskedBlocks(Dataset):
    """Rows of a packed (N, T) tensor, each masked as it is read: RoBERTa's dynamic masking done in the
    data pipeline, as Hugging Face's MLM collator does, so that the training step is handed its masked
    positions (:func:`collate_masked`) and never waits for the GPU to find them.

    A block's mask is a pure function of its draw's seed. In training that is (run seed, epoch, index):
    fresh each epoch, and the same after a resume on any number of ranks. With ``fixed`` (evaluation)
    it is the block's content, so a validation number never changes between evaluations, runs, rank
    counts or batchings.
    """

    def __init__(self, blocks: torch.Tensor, masker: BlockMasker, seed: int = 0, fixed: bool = False):
        self.blocks, self.masker, self.seed, self.fixed = blocks, masker, seed, fixed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called before each epoch's loader starts; its workers copy the dataset then."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def _seed(self, index: int, block: torch.Tensor) -> int:
        if self.fixed:
            return _mix(_content(block))
        return _mix(self.seed, self.epoch, index)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]  # (T,)
        masked, labels = self.masker(block, torch.Generator().manual_seed(self._seed(index, block)))
        return {"input_ids": masked, "labels": labels}


def mask_streamed(blocks: torch.Tensor, masker: BlockMasker, seed: int) -> dict[str, torch.Tensor]:
    """Blocks of a streamed split (N, T) masked as they are made: ``input_ids`` and ``labels`` (N, T) each.

    A streamed block has no index the whole run agrees on, so its mask is a pure function of (run seed, the
    block's content): the same after a resume, and in every pass over the stream (a corpus streamed because it is
    large is seldom read twice)."""
    if blocks.shape[0] == 0:
        return {"input_ids": [], "labels": []}
    masked, labels = [], []
    for block in blocks:  # (T,) each
        m, l = masker(block, torch.Generator().manual_seed(_mix(seed, _content(block))))
        masked.append(m)
        labels.append(l)
    return {"input_ids": torch.stack(masked), "labels": torch.stack(labels)}


def _content(block: torch.Tensor) -> int:
    """An integer of a block's tokens and their order, for a seed."""
    weights = torch.arange(block.numel()) % 65521 + 1
    return int((block.long() * weights).sum())


def _mix(*values: int) -> int:
    """Integers hashed into one 32-bit seed (splitmix64's finaliser per value). torch's CPU generator
    keeps only a seed's low 32 bits, so (seed, epoch, index) cannot simply be laid side by side."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0xFFFFFFFF


def collate_masked(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack masked blocks (full, so no padding) and say where the masked positions are.

    ``masked_positions``: (M,) flat indices into the B*T positions whose label is not -100, row-major,
    found here on the CPU, where that costs no wait.
    """
    input_ids = torch.stack([e["input_ids"] for e in examples]).long()  # (B, T)
    labels = torch.stack([e["labels"] for e in examples]).long()  # (B, T)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels,
            "masked_positions": (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)}
