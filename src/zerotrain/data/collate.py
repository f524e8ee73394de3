"""Batching: the one padding collator, and the label value the losses skip."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label value that torch's cross-entropy (and Hugging Face's losses) skip: padding, prompts, unmasked tokens."""


def _is_sequence(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 1


class PadCollator:
    """Right-pad a list of examples into a batch of long tensors; picklable, for DataLoader workers.

    An example is either a mapping with an ``input_ids`` sequence (the LoRA/SFT examples,
    ``{"input_ids": [...], "labels": [...]}``) or a pair ``(token_ids, label)`` (the IMDB reviews),
    read as ``{"input_ids": token_ids, "labels": label}``. The batch holds:

    * ``input_ids`` (B, T), padded with ``pad_token_id``, and ``attention_mask`` (B, T), 1 on tokens;
    * every other field, in the examples' order: a sequence field is padded to (B, T), ``labels``
      with :data:`IGNORE_INDEX` and any other with 0; a scalar field (a class label) is stacked to (B,).

    T is the batch's longest ``input_ids``, rounded up to a multiple of ``pad_to_multiple_of`` (fewer
    distinct shapes, tensor-core aligned matmuls) but never past ``max_len`` nor below the longest.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8, max_len: Optional[int] = None):
        if pad_token_id is None:
            raise ValueError("pad_token_id is None: set a pad token (e.g. the EOS token) on the tokenizer")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))
        self.max_len = None if max_len is None else int(max_len)

    def __repr__(self) -> str:
        return (f"PadCollator(pad_token_id={self.pad_token_id}, pad_to_multiple_of={self.pad_to_multiple_of}, "
                f"max_len={self.max_len})")

    def padded_length(self, longest: int) -> int:
        m = self.pad_to_multiple_of
        length = -(-longest // m) * m
        if self.max_len is not None:
            length = max(longest, min(length, self.max_len))
        return length

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty list of examples")
        rows: list[Mapping[str, Any]] = [
            e if isinstance(e, Mapping) else {"input_ids": e[0], "labels": e[1]} for e in examples
        ]
        lengths = [len(r["input_ids"]) for r in rows]
        B, T = len(rows), self.padded_length(max(lengths))

        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((B, T), dtype=torch.long)  # (B, T)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            input_ids[i, :n] = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)
            attention_mask[i, :n] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}

        for key, first in rows[0].items():
            if key in batch:
                continue
            if _is_sequence(first):
                fill = IGNORE_INDEX if key == "labels" else 0
                out = torch.full((B, T), fill, dtype=torch.long)  # (B, T)
                for i, row in enumerate(rows):
                    values = np.asarray(row[key])
                    if values.shape[0] > T:
                        raise ValueError(f"field {key!r} of example {i} has {values.shape[0]} values, "
                                         f"more than the {T} positions of the batch")
                    out[i, : values.shape[0]] = torch.as_tensor(values, dtype=torch.long)
            else:
                out = torch.tensor([int(row[key]) for row in rows], dtype=torch.long)  # (B,)
            batch[key] = out
        return batch
