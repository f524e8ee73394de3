"""A RoBERTa-style encoder with a masked-language-model head, built from dims.

Post-LN encoder layers as in BERT/RoBERTa, attention through
:func:`torch.nn.functional.scaled_dot_product_attention` (which picks the flash or memory-efficient
kernel when it can), and a decoder tied to the token embedding. The embeddings and layers live in
the ``encoder`` submodule so that another recipe (e.g. a classifier) can load ``encoder.*`` weights
from an MLM checkpoint. Nothing here knows about DeepSpeed or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerotrain.data.collate import IGNORE_INDEX
from zerotrain.engines.compiling import FusedLoss


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose output, under bf16 autocast, is bf16 rather than float32.

    Autocast returns layer_norm in float32 (of a float32 input, and on CUDA of any input), and in a post-LN
    encoder that output is the residual stream: every residual add, dropout and LayerNorm of every layer then
    reads and writes float32, and each matmul casts its input back to bf16 first (2.8 ms of a 31.5 ms BERT-base
    encoder step on an H100). Returned in bf16, the stream is what a model with bf16
    weights (ZeRO-1/2's bf16 block) carries; the normalisation is still computed in float32 and rounded once.
    fp16 autocast keeps float32: fp16's narrow range is what autocast's float32 LayerNorm protects the stream
    from. Without autocast it is ``nn.LayerNorm``, and its parameters keep their names.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
            return y.to(torch.bfloat16)
        return y


class SelfAttention(nn.Module):
    def __init__(self, h_dim: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(h_dim, 3 * h_dim)
        self.out = nn.Linear(h_dim, h_dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        # attn_mask is boolean (B, 1, 1, T), True where the key is a real token: padded keys get no weight
        # (None: every key is real).
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out(y)


class EncoderLayer(nn.Module):
    """Post-LN (as RoBERTa): ``x = LN(x + attn(x)); x = LN(x + ffn(x))``."""

    def __init__(self, h_dim: int, num_heads: int, ff_dim: int, dropout: float):
        super().__init__()
        self.attn = SelfAttention(h_dim, num_heads, dropout)
        self.ln_attn = LayerNorm(h_dim)
        self.ff_in = nn.Linear(h_dim, ff_dim)
        self.ff_out = nn.Linear(ff_dim, h_dim)
        self.ln_ff = LayerNorm(h_dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.ln_attn(x + self.drop(self.attn(x, attn_mask)))  # (B, T, C)
        h = self.ff_out(F.gelu(self.ff_in(x)))  # (B, T, C)
        return self.ln_ff(x + self.drop(h))  # (B, T, C)


class Encoder(nn.Module):
    """Token + learned position embeddings, LayerNorm, and the stack of encoder layers."""

    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, h_dim: int, ff_dim: int,
                 dropout: float, max_seq_length: int, pad_token_id: int, activation_checkpointing: bool):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, h_dim, padding_idx=pad_token_id)
        self.position_embedding = nn.Embedding(max_seq_length, h_dim)
        self.ln_emb = LayerNorm(h_dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(h_dim, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.activation_checkpointing = activation_checkpointing

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.position_embedding.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_seq_length {self.position_embedding.num_embeddings}")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.token_embedding(input_ids) + self.position_embedding(pos)  # (B, T, C)
        x = self.drop(self.ln_emb(x))
        # None when no position is padding (packed blocks): without a mask SDPA can pick its flash
        # kernel, which a mask (even an all-True one) rules out.
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                # Non-reentrant checkpointing works with kwargs, inputs that need no grad, and
                # restores the dropout RNG so the recomputed forward matches the first one.
                x = checkpoint(layer, x, attn_mask, use_reentrant=False)
            else:
                x = layer(x, attn_mask)
        return x  # (B, T, C)


class MLMHead(nn.Module):
    """dense -> gelu -> LayerNorm -> decoder (+ bias). The model ties the decoder weight to the token embedding."""

    def __init__(self, h_dim: int, vocab_size: int):
        super().__init__()
        self.dense = nn.Linear(h_dim, h_dim)
        self.ln = LayerNorm(h_dim)
        self.decoder = AlignedLinear(h_dim, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(F.gelu(self.dense(x)))  # (B, T, C)
        return self.decoder(h)  # (B, T, V)


class AlignedLinear(nn.Linear):
    """``nn.Linear`` whose matmuls run with the output width rounded up to 64 on a GPU (:func:`aligned_linear`).

    A module of its own, not a call on the head's weight, so that ZeRO-3's hooks on this module gather the
    weight before use; the parameter names (``decoder.weight``, ``decoder.bias``) stay nn.Linear's.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On a CPU alignment buys nothing and the padded copy of the table costs a pass over it.
        return aligned_linear(x, self.weight, self.bias, multiple=64 if x.is_cuda else 1)


def aligned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, multiple: int = 64) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with the output width rounded up to ``multiple``.

    RoBERTa's 50,265 outputs make every row of the logits and of their gradient start at an address cuBLAS
    cannot load 16 bytes at a time, so all three matmuls of the decoder fall back to slow unaligned kernels
    (one took 2.0 ms of a 45 ms BERT-base step on an H100, BENCHMARKS.md). Zero rows padded on the fly and
    cut off the result give the same logits and gradients with the parameter, and so checkpoints and exports,
    unchanged; a padded vocabulary (nanoGPT's 50,304) would change both and the softmax.
    """
    out = weight.shape[0]
    pad = -out % multiple
    if not pad:
        return F.linear(x, weight, bias)
    return F.linear(x, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad)))[..., :out]  # (..., V)


class MaskedLMLoss(FusedLoss):
    """Cross-entropy of the predicted positions' logits (M, V) against their targets (M,), summed, in float32."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), targets, reduction="sum")


class RobertaMLM(nn.Module):
    """RoBERTa-style masked language model. ``forward`` returns ``dict(logits=(B, T, V), loss=scalar|None)``."""

    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, h_dim: int, ff_dim: int,
                 dropout: float, max_seq_length: int, pad_token_id: int, activation_checkpointing: bool = False):
        super().__init__()
        if h_dim % num_heads:
            raise ValueError(f"h_dim {h_dim} must be divisible by num_heads {num_heads}")
        self.vocab_size, self.num_layers, self.h_dim = vocab_size, num_layers, h_dim
        # Laid out on the meta device and given memory after, so that each weight is initialised once, by
        # _init_weights: nn.Linear's own Kaiming init, which that overwrites, was 23.5 of the 30.5 s that a 1.4B
        # model took to build on a 2-core CPU, and 12.3B took ~2 minutes on a GPU machine's host).
        device = torch.get_default_device()  # meta too, when zerotrain estimate builds the model there
        with torch.device("meta"):
            self.encoder = Encoder(vocab_size, num_layers, num_heads, h_dim, ff_dim, dropout, max_seq_length,
                                   pad_token_id, activation_checkpointing)
            self.lm_head = MLMHead(h_dim, vocab_size)
        self.to_empty(device=device)
        self.loss = MaskedLMLoss()  # no parameters: checkpoints are unchanged
        # Tie by sharing the Parameter between two modules (as Hugging Face does) rather than reading
        # the embedding's weight from the head: ZeRO-3 gathers a parameter in the pre-forward hook of
        # each module that owns it, so the head must own it too.
        self.lm_head.decoder.weight = self.encoder.token_embedding.weight
        self.apply(self._init_weights)
        with torch.no_grad():
            # The decoder's init (it runs after the embedding's) also rewrote the shared table's <pad> row.
            self.encoder.token_embedding.weight[pad_token_id].zero_()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # BERT's initialisation: N(0, 0.02) weights, zero biases; LayerNorm's identity (ones, zeros).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                masked_positions: Optional[torch.Tensor] = None) -> dict[str, Optional[torch.Tensor]]:
        """Without ``labels``: logits for every position, (B, T, V). ``attention_mask`` (B, T) is 1 for
        real tokens; None when there is no padding.

        With ``labels``: the head runs on the masked positions only (labels != -100) and ``logits``
        is (M, V) for those M positions, in row-major order. The vocabulary projection is the
        largest matmul of a small MLM; skipping the ~85% of positions that carry no loss makes a
        training step several times cheaper without changing the loss or its gradient.

        ``masked_positions`` (M,): where ``labels`` is not -100, as flat row-major indices into the B*T
        positions, found by whoever masked (the data pipeline does, on the CPU). Given, the step never
        waits for the GPU; without it the positions are found here, which waits once.
        """
        x = self.encoder(input_ids, attention_mask)  # (B, T, C)
        if labels is None:
            return {"logits": self.lm_head(x), "loss": None}  # (B, T, V)
        labels = labels.flatten()  # (B*T,)
        chosen = masked_positions
        if chosen is None:
            # The count of masked positions is an output shape: nonzero waits for the GPU to know it.
            chosen = (labels != IGNORE_INDEX).nonzero().squeeze(1)  # (M,), row-major order
        logits = self.lm_head(x.flatten(0, 1).index_select(0, chosen))  # (M, V)
        # Mean over masked positions, clamped at 1: a micro-batch in which nothing was masked gives
        # a zero loss (and zero gradient) instead of NaN.
        loss = self.loss(logits, labels.index_select(0, chosen)) / max(len(chosen), 1)
        return {"logits": logits, "loss": loss}

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out the token and position embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            for emb in (self.encoder.token_embedding, self.encoder.position_embedding):
                n -= emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int, predicted_fraction: float = 1.0) -> float:
        """Training FLOPs per token (forward + backward), nanoGPT/PaLM style::

            6 * N_encoder + 12 * num_layers * h_dim * seq_len + 6 * (N_head + h_dim * vocab_size) * predicted_fraction

        where N_encoder is the encoder's parameter count without the token and position embedding tables
        (layers and LayerNorms), the second term is the attention score and value matmuls, N_head is the
        MLM head's own parameters (dense, LayerNorm, decoder bias) and ``h_dim * vocab_size`` the tied
        decoder matmul, which no parameter count holds because its weight is the token embedding. The
        head runs only on masked positions in training, so its terms are scaled by the fraction of
        positions predicted (the mask probability).
        """
        head = sum(p.numel() for name, p in self.lm_head.named_parameters() if name != "decoder.weight")
        return (6.0 * (self.num_params(non_embedding=True) - head)
                + 12.0 * self.num_layers * self.h_dim * seq_len
                + 6.0 * (head + self.h_dim * self.vocab_size) * predicted_fraction)


# ---- Hugging Face layout -----------------------------------------------------------------------
# RobertaMLM's tensors under transformers' RobertaForMaskedLM names, for `zerotrain export --format hf`.
# Both are post-LN encoders with exact-erf GELU, scaled dot-product attention over keys whose mask is 1,
# and a decoder tied to the token embedding; the differences are handled here:
# * RoBERTa numbers positions from padding_idx + 1 (rows 0..padding_idx are never used for real tokens),
#   zerotrain from 0: our table goes into rows padding_idx + 1 onwards. Real tokens of a right-padded or
#   unpadded input then get the same position vectors in both models.
# * RoBERTa adds a token-type embedding (one type): a zero row adds nothing.
# * Our packed qkv projection is split into query, key and value.

def hf_roberta_config(model: "RobertaMLM", num_heads: int, ff_dim: int, dropout: float, pad_token_id: int,
                      bos_token_id: Optional[int], eos_token_id: Optional[int]) -> dict:
    """``config.json`` of the RobertaForMaskedLM equal to ``model``."""
    enc = model.encoder
    return {
        "architectures": ["RobertaForMaskedLM"], "model_type": "roberta",
        "vocab_size": model.vocab_size, "hidden_size": model.h_dim, "num_hidden_layers": model.num_layers,
        "num_attention_heads": num_heads, "intermediate_size": ff_dim, "hidden_act": "gelu",
        "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
        "max_position_embeddings": enc.position_embedding.num_embeddings + pad_token_id + 1,
        "type_vocab_size": 1, "initializer_range": 0.02, "layer_norm_eps": enc.ln_emb.eps,
        "pad_token_id": pad_token_id, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "tie_word_embeddings": True,
    }


def hf_roberta_state_dict(sd: dict[str, torch.Tensor], num_layers: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """``sd`` (a RobertaMLM state dict) renamed and reshaped into RobertaForMaskedLM's."""
    out: dict[str, torch.Tensor] = {}
    word = sd["encoder.token_embedding.weight"]  # (V, C)
    pos = sd["encoder.position_embedding.weight"]  # (T, C)
    emb = "roberta.embeddings."
    out[emb + "word_embeddings.weight"] = word
    table = pos.new_zeros(pos.shape[0] + pad_token_id + 1, pos.shape[1])  # (T + pad + 1, C)
    table[pad_token_id + 1:] = pos
    out[emb + "position_embeddings.weight"] = table
    out[emb + "token_type_embeddings.weight"] = pos.new_zeros(1, pos.shape[1])
    out[emb + "LayerNorm.weight"], out[emb + "LayerNorm.bias"] = sd["encoder.ln_emb.weight"], sd["encoder.ln_emb.bias"]
    for i in range(num_layers):
        src, dst = f"encoder.layers.{i}.", f"roberta.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = sd[src + f"attn.qkv.{kind}"].chunk(3, dim=0)
            out[dst + f"attention.self.query.{kind}"] = q
            out[dst + f"attention.self.key.{kind}"] = k
            out[dst + f"attention.self.value.{kind}"] = v
            for ours, theirs in (("attn.out", "attention.output.dense"), ("ln_attn", "attention.output.LayerNorm"),
                                 ("ff_in", "intermediate.dense"), ("ff_out", "output.dense"),
                                 ("ln_ff", "output.LayerNorm")):
                out[dst + f"{theirs}.{kind}"] = sd[src + f"{ours}.{kind}"]
    for ours, theirs in (("lm_head.dense", "lm_head.dense"), ("lm_head.ln", "lm_head.layer_norm")):
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = sd[f"{ours}.{kind}"]
    out["lm_head.bias"] = sd["lm_head.decoder.bias"]  # transformers ties decoder.bias to it; the weight to word_embeddings
    return {k: v.contiguous() for k, v in out.items()}
