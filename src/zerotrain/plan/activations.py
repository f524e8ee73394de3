"""Activation memory of a Hugging Face transformer from its dimensions alone: what ``zerotrain estimate`` adds to
the model states without measuring, and what the planner uses where the probe could not measure.

Notation: ``b`` micro-batch, ``s`` tokens per row, ``N = b*s``, ``h`` hidden, ``a`` heads, ``k`` KV heads, ``d``
head width, ``f`` intermediate, ``V`` vocabulary, ``L`` layers, ``P`` positions per row scored over the vocabulary
(every position for causal and masked LMs, 0 for a classifier), ``e`` bytes of an activation (2 when the run
computes in bf16/fp16, 4 in fp32). Every term counts the tensors autograd keeps for the backward pass (bytes):

* **a norm**: RMSNorm (Llama's, in fp32 inside) keeps an fp32 copy of its input, its normalised 16-bit output
  (for the weight's gradient) and its output (the next linear's input): ``(4 + 2e) N h``; ``nn.LayerNorm`` keeps
  its input and its output: ``2e N h``. Two per layer.
* **attention** keeps the queries, keys and values, its output and the softmax's log-sum-exp, and the output
  projection its own (contiguous) input: ``e N (a d + 2 k' d + 2 a d) + 4 N a``, with ``k' = a`` where
  transformers repeats the KV heads (whenever it passes a mask to sdpa: padded batches, packed rows) and
  ``k' = k`` where sdpa's own GQA reads them. **Eager** attention also keeps the probabilities, in fp32 and in
  the activation dtype: ``(4 + e) b a s^2`` (``4 b a s^2`` in fp32; ``e b a s^2`` for models whose softmax runs
  in the activation dtype: GPT-2, BERT), the ``s^2`` that fused kernels never store.
* **the MLP** keeps ``m`` intermediate-width tensors: ``m e N f``, ``m`` = 2 (a fused GELU), 4 (SwiGLU), 5 (GPT-2's
  ``gelu_new``, written as tensor operations).
* **dropout** keeps a one-byte mask per element: ``2 N h`` a layer after attention and MLP, ``(1 + e) b a s^2``
  more for eager attention's dropout (a fused kernel draws it inside).
* **the mask**: a boolean ``b s^2`` built once and kept by every layer (padded batches, packed rows; not with
  flash attention, which reads the packed rows' boundaries instead).
* **the head**: logits ``e b P V``, Hugging Face's loss upcasts them (``4 b P V``) and ``log_softmax`` keeps its
  fp32 output (``4 b P V``); the backward pass starts with that output, the loss's gradient and the gradient of
  the logits at once: ``12 b P V`` (``3e b P V`` for BERT-family heads, whose loss stays in the logits' dtype). The larger of the two moments counts, over the layers' activations. For a
  small model with a big vocabulary at long context this is most of it (a 0.5B Qwen2 at 32k positions: 4.4 GiB
  of fp32 logits per row, each layer 0.3 GiB).
* **LoRA** (frozen base): a frozen linear keeps no copy of its input (its weight takes no gradient), so the norms'
  and projections' inputs drop out; each adapted projection keeps its dropout's mask and output, ``(1 + e) N h``.

Peak: without activation checkpointing, ``L x layer + mask + head``, at the start of the backward pass (or the
end of the forward). With Hugging Face's (non-reentrant) checkpointing each layer keeps its input, ``e N h``, and
the backward pass recomputes one layer at a time: ``L e N h + mask + max(head, layer + its gradients)``.

Validated against what the probe measures on the CPU (PyTorch's ``MemTracker``, :mod:`zerotrain.plan.probe`:
live tensor storages at the peak of a forward and backward pass, over weights and gradients), micro-batch 2-4,
128-256 tokens, tiny models from configs: Llama (fp32 and bf16 weights, sdpa and eager, packed and padded rows,
checkpointing on and off) at 0.92-1.08 of the measurement; Qwen2, GPT-2, GPT-NeoX and BERT with bf16 weights at
0.94-1.04, except eager attention with checkpointing (the recomputed layer's seq x seq gradients, modelled as 3
bytes each): up to 1.4x at 128 tokens. ``tests/test_activations.py`` keeps five of these cases. Not validated on a
GPU: CUDA's fused attention kernels keep the same tensors as the CPU's (queries, keys, values, output, log-sum-exp),
and the caching allocator's rounding is outside the formula (:data:`zerotrain.plan.memory.ALLOCATOR_SLACK`).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.models.shape import TransformerShape


@dataclass(frozen=True)
class Activations:
    """Bytes of activations at the peak of one forward and backward pass, and its parts."""

    peak_bytes: float
    layer_bytes: float
    """One transformer layer's stored tensors (without checkpointing)."""
    head_bytes: float
    """The logits and the loss at their largest moment."""
    mask_bytes: float
    checkpointing: bool

    def describe(self) -> str:
        gib = 2**30
        return (f"modelled from the config: {self.layer_bytes / gib:.3f} GiB a layer"
                f"{' (checkpointed: its input kept)' if self.checkpointing else ''}, "
                f"logits and loss {self.head_bytes / gib:.3f} GiB"
                + (f", attention mask {self.mask_bytes / gib:.3f} GiB" if self.mask_bytes else ""))


def _norm(shape: TransformerShape, n: int, e: int) -> float:
    """A norm's stored bytes, with its output as the next (trainable) linear's input."""
    if shape.rms_norm:
        if shape.frozen_base:
            return 4.0 * n * shape.hidden
        return (4 + 2 * e) * n * shape.hidden if e != 4 else 12.0 * n * shape.hidden
    return (1 if shape.frozen_base else 2) * e * n * shape.hidden


def layer_bytes(shape: TransformerShape, micro_batch_size: int, element: int) -> float:
    """Bytes one transformer layer stores for its backward pass (module docstring)."""
    b, s, e = micro_batch_size, shape.seq_len, element
    n = b * s
    width = shape.heads * shape.head_dim
    eager = shape.attention == "eager"
    kv = shape.heads if (shape.dense_mask or eager) else shape.kv_heads
    attention = e * n * (width + 2 * kv * shape.head_dim) + e * n * width + 4.0 * n * shape.heads
    if not shape.frozen_base:
        attention += e * n * width  # the output projection's input
    if eager:
        kept = 4 + (e if e != 4 else 0) if shape.fp32_softmax else e
        attention += kept * b * shape.heads * s * s
        if shape.attention_dropout > 0:
            attention += (1 + e) * b * shape.heads * s * s
    mlp_tensors = shape.mlp_tensors - (1 if shape.frozen_base else 0)  # the last linear's input
    mlp = mlp_tensors * e * n * shape.intermediate
    dropout = 2.0 * n * shape.hidden if shape.hidden_dropout > 0 else 0.0
    adapters = shape.adapted_projections * (1 + e) * n * shape.hidden
    return 2 * _norm(shape, n, e) + attention + mlp + dropout + adapters


def head_bytes(shape: TransformerShape, micro_batch_size: int, element: int) -> float:
    """The logits and fp32 loss at their largest moment: the backward pass's first step (module docstring)."""
    scored = micro_batch_size * shape.vocab_positions * shape.vocab
    if not shape.fp32_loss:  # the logits, log_softmax's output; then its gradient and the logits' at once
        return 3.0 * element * scored
    forward = (element + (4 if element != 4 else 0) + 4) * scored
    return max(forward, 12.0 * scored)


def activation_bytes(shape: TransformerShape, micro_batch_size: int, element: int,
                     checkpointing: bool) -> Activations:
    """Peak activation bytes of one forward and backward pass at ``micro_batch_size`` rows of ``shape.seq_len``
    tokens, activations of ``element`` bytes (module docstring)."""
    b, s, e = micro_batch_size, shape.seq_len, element
    n = b * s
    layer = layer_bytes(shape, b, e)
    head = head_bytes(shape, b, e)
    mask = float(b * s * s) if shape.dense_mask else 0.0
    final_norm = _norm(shape, n, e)
    if checkpointing:
        # The recomputed layer's backward holds its activations and, at once, the gradients of its widest
        # tensors (the MLP's intermediate ones; eager attention's probabilities).
        regrads = 2.0 * e * n * max(shape.intermediate, shape.hidden)
        if shape.attention == "eager":
            regrads += 3.0 * b * shape.heads * s * s  # the probabilities' gradients (measured 2.6-3.1 bytes each)
        peak = shape.layers * e * n * shape.hidden + mask + final_norm + max(head, layer + regrads)
    else:
        peak = shape.layers * layer + mask + final_norm + head
    return Activations(peak_bytes=peak, layer_bytes=layer, head_bytes=head, mask_bytes=mask,
                       checkpointing=checkpointing)
