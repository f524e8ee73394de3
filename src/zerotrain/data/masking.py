"""BERT/RoBERTa masking for masked-language-model training, vectorised on the tensors' device."""

from __future__ import annotations

from typing import Optional

import torch

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
