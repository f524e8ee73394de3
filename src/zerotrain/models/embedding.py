"""A token embedding whose backward pass never makes the host wait for the GPU.

For more than a few thousand looked-up tokens, torch's CUDA embedding backward sorts the token ids and
sums each id's gradients by segments, and it reads the number of segments back to the host to size
that sum: the host stops until the GPU has run everything queued before it. The embedding is the first
layer, so its backward is the last: every step the host then waits for the whole forward and backward to
finish before it can queue the optimizer step and the next forward, and the GPU idles while it does.
(Measured on IMDB preset (b): BENCHMARKS.md, session 23.)

:class:`TokenEmbedding` is ``nn.Embedding`` (same parameter, same state-dict keys, same forward) whose
gradient on a CUDA device is one ``index_add_`` into a float32 table, cast to the weight's dtype: no
sort, no read-back. The float32 sum keeps a bf16 table's gradient as exact as torch's, which also
accumulates in float32. The additions are atomic, so the order in which a token's gradients are added
varies from run to run (float rounding); where torch is asked for deterministic algorithms, and on a
CPU, torch's own backward runs. So it does inside ``torch.compile``, whose generated backward adds the
gradients by scattering, without a read-back.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class _IndexAddEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        rows, dim = ctx.weight_shape
        table = torch.zeros(rows, dim, dtype=torch.float32, device=grad.device)
        table.index_add_(0, ids.reshape(-1), grad.reshape(-1, dim).float())
        if ctx.padding_idx is not None:
            table[ctx.padding_idx].zero_()  # as nn.Embedding: the padding row gets no gradient
        return None, table.to(ctx.weight_dtype), None


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` with a backward that does not wait for the GPU (see the module's docstring)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (ids.is_cuda and self.weight.requires_grad and torch.is_grad_enabled() and self.max_norm is None
                and not self.scale_grad_by_freq and not self.sparse
                and not torch.are_deterministic_algorithms_enabled() and not torch.compiler.is_compiling()):
            return _IndexAddEmbedding.apply(ids, self.weight, self.padding_idx)
        return super().forward(ids)
