"""The dimensions of a transformer that size its activations, read from a built model (its Hugging Face config
and its modules), on any device: the meta device included, where nothing is allocated.

A recipe reports them (:meth:`zerotrain.tasks.base.Task.transformer_shape`) with the rows it trains on; the
memory model (:mod:`zerotrain.plan.activations`) turns them into bytes. Nothing here allocates or runs the model.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from zerotrain.models.hf import _first_attr, attention_implementation


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    seq_len: int
    """Tokens of the longest row a run meets (packed rows: exactly ``--data.seq_len``)."""
    mlp_tensors: int = 2
    """Intermediate-width tensors one MLP stores for its backward pass: 2 for a plain MLP with a fused activation
    (the first linear's output for the GELU, the GELU's output for the second linear), 4 for SwiGLU
    (``gate_proj``/``up_proj``: the gate, its SiLU, the up projection, their product), 5 for GPT-2's ``gelu_new``,
    which transformers writes as separate tensor operations."""
    rms_norm: bool = False
    """Hugging Face's RMSNorm, which computes in fp32 and keeps an fp32 copy of its input; else ``nn.LayerNorm``."""
    attention: str = "sdpa"
    """``sdpa``, ``flash_attention_2`` (or any fused kernel) or ``eager`` (stores the seq x seq probabilities)."""
    dense_mask: bool = False
    """The model builds a (batch, 1, seq, seq) boolean mask: padded batches and packed rows under sdpa or eager."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    fp32_loss: bool = True
    """The model's loss upcasts the logits to fp32 (transformers' shared loss functions); BERT-family heads take
    the cross-entropy in the logits' dtype."""
    fp32_softmax: bool = True
    """Eager attention's softmax computes in fp32 and keeps that copy too (Llama, Qwen2, Mistral, GPT-NeoX); GPT-2
    and BERT-family models keep the probabilities in the activation dtype only."""
    vocab_positions: int = 0
    """Positions per row that get logits over the vocabulary and a loss in fp32 (causal and masked LMs: every
    position, as Hugging Face's heads score them all); 0 for a classifier's few logits."""
    frozen_base: bool = False
    """LoRA: the base weights take no gradient, so a frozen linear keeps no copy of its input."""
    adapted_projections: int = 0
    """LoRA: adapted linear layers per transformer layer (their inputs are stored, with a dropout mask)."""


def _config_float(config: Any, names: tuple[str, ...]) -> float:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _model_source(model: nn.Module) -> str:
    """The source of the module that defines ``model``'s class (its attention and loss code), or "" where there is
    none to read: the eager softmax's dtype and the loss's upcast are written there, not in the config."""
    base = getattr(model, "get_base_model", lambda: model)()
    try:
        return inspect.getsource(sys.modules[type(base).__module__])
    except (OSError, TypeError, KeyError):
        return ""


def _forward_source(model: nn.Module) -> str:
    """The source of ``model``'s own ``forward`` (where its loss is taken), or ""."""
    base = getattr(model, "get_base_model", lambda: model)()
    try:
        return inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return ""


def head_dim(config: Any) -> int:
    """Dimensions of an attention head of a Hugging Face ``config``: its ``head_dim``, else the width over the heads;
    0 where it has neither."""
    hidden = _first_attr(config, ("hidden_size", "n_embd", "dim", "d_model"))
    heads = _first_attr(config, ("num_attention_heads", "n_head", "n_heads"))
    return _first_attr(config, ("head_dim",)) or (hidden // heads if hidden and heads else 0)


def transformer_shape(model: nn.Module, seq_len: int, vocab_positions: int, dense_mask: bool) -> Optional[TransformerShape]:
    """The shape of a Hugging Face transformer ``model`` (LoRA-wrapped or not), or None when its config lacks the
    dimensions (a model that is not a standard transformer: its activations are then only measured)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    layers = _first_attr(config, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"))
    hidden = _first_attr(config, ("hidden_size", "n_embd", "dim", "d_model"))
    heads = _first_attr(config, ("num_attention_heads", "n_head", "n_heads"))
    vocab = _first_attr(config, ("vocab_size",))
    if not (layers and hidden and heads and vocab):
        return None
    kv_heads = _first_attr(config, ("num_key_value_heads",)) or heads
    intermediate = _first_attr(config, ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim")) or 4 * hidden
    names = [name for name, _ in model.named_modules()]
    gated = any(name.endswith(("gate_proj", "gate_up_proj", "w1")) for name in names)
    act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None)
    mlp_tensors = 4 if gated else 5 if act == "gelu_new" else 2
    rms = any("RMSNorm" in type(m).__name__ for m in model.modules())
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    frozen = len(trainable) < sum(1 for _ in model.parameters())
    adapted = sum(1 for name in names if name.endswith(".lora_A")) // layers if frozen else 0
    attention = attention_implementation(model)
    source = _model_source(model)
    return TransformerShape(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim(config), intermediate=intermediate,
        vocab=vocab, seq_len=seq_len, mlp_tensors=mlp_tensors, rms_norm=rms, attention=attention,
        dense_mask=dense_mask and not attention.startswith("flash"),
        hidden_dropout=_config_float(config, ("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout")),
        attention_dropout=_config_float(config, ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")),
        fp32_loss="CrossEntropyLoss" not in _forward_source(model),
        fp32_softmax=re.search(r"softmax\([^)]*dtype=torch\.float32", source) is not None,
        vocab_positions=vocab_positions, frozen_base=frozen, adapted_projections=adapted)
