"""The RoBERTa masked-language-model recipe (HelloDeepSpeed's train_bert, on the one zerotrain loop).

Text (local files through ``datasets``, or a hub dataset) is tokenized once into ``--data.cache_dir`` and packed
into full ``<s> ... </s>`` blocks (see :mod:`zerotrain.data.text`), and the data
pipeline masks each block as it reads it (:class:`~zerotrain.data.masking.MaskedBlocks`): every epoch
sees fresh masks, as RoBERTa's dynamic masking does, a resumed run sees the same ones, and validation
masks depend only on a block's content, so validation numbers are the same on every evaluation, every
run and any number of ranks. The step is handed where the masked positions are, so it never waits for
the GPU to find them.

``--data.streaming true`` reads local training text as it is trained on (:mod:`zerotrain.data.streaming`):
blocks are packed a chunk of documents at a time and each is masked by a function of the run's seed and its
content (:func:`~zerotrain.data.masking.mask_streamed`). Validation then comes from ``--data.val_path`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.checkpoint.export import _export_hf_roberta
from zerotrain.config import RunConfig
from zerotrain.data.io import looks_local as is_local_source
from zerotrain.data.masking import BlockMasker, MaskedBlocks, collate_masked
from zerotrain.data.text import load_packed, streamed_blocks
from zerotrain.data.tokenizer import load_tokenizer
from zerotrain.errors import ConfigError, DataError, UserError
from zerotrain.models import hf
from zerotrain.models.shape import TransformerShape, transformer_shape
from zerotrain.models.roberta_mlm import RobertaMLM
from zerotrain.tasks.base import Batch, Splits, StepOutput, Task

VAL_HOLDOUT_FRACTION = 0.01
MAX_PPL_LOSS = 20.0
"""ppl is exp(min(loss, 20)): far above any vocabulary's uniform perplexity, never inf in logs."""


@dataclass
class MLMModelConfig:
    name_or_path: Optional[str] = None
    """Any Hugging Face masked LM (AutoModelForMaskedLM): a local folder saved with save_pretrained or a hub name.
    None (the default): zerotrain's own RoBERTa encoder, sized by the fields below."""
    init: Literal["pretrained", "random"] = "pretrained"
    """With a Hugging Face model: pretrained loads the weights of name_or_path; random builds an untrained one
    from --model.config."""
    config: Optional[str] = None
    """init=random: a Hugging Face config.json (or a folder holding one), e.g. a BERT or RoBERTa architecture."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    """A Hugging Face model's weights' dtype when loading; auto follows --precision.dtype."""
    num_layers: int = 6
    """Encoder layers."""
    num_heads: int = 8
    """Attention heads per layer; h_dim must be divisible by it."""
    h_dim: int = 256
    """Hidden size (width of the residual stream)."""
    ff_dim: int = 512
    """Inner size of the feed-forward block."""
    dropout: float = 0.1
    """Dropout on embeddings, attention weights and residual branches."""
    max_seq_length: int = 512
    """Tokens per packed block, including <s> and </s>."""

    def uses_hf(self) -> bool:
        """Whether the model is a Hugging Face masked LM rather than zerotrain's own encoder."""
        return bool(self.name_or_path) or self.init == "random"

    def validate(self) -> None:
        if self.init == "random":
            if not self.config:
                raise ConfigError("--model.config", "is required with --model.init random (a Hugging Face config.json "
                                                    "file or a folder holding one)")
            if not Path(self.config).expanduser().exists():
                raise ConfigError("--model.config", f"file {self.config!r} does not exist")
        for flag, value in (("--model.num_layers", self.num_layers), ("--model.num_heads", self.num_heads),
                            ("--model.h_dim", self.h_dim), ("--model.ff_dim", self.ff_dim)):
            if value < 1:
                raise ConfigError(flag, f"must be >= 1, got {value}")
        if self.h_dim % self.num_heads:
            raise ConfigError("--model.h_dim", f"({self.h_dim}) must be divisible by --model.num_heads ({self.num_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--model.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.max_seq_length < 3:
            raise ConfigError("--model.max_seq_length", f"must be >= 3 (<s>, a token, </s>), got {self.max_seq_length}")


@dataclass
class MLMDataConfig:
    resume_safe = frozenset({"cache_dir"})  # where the packed blocks are kept, not what they hold

    train_path: str = "wikitext:wikitext-2-raw-v1"
    """Training text: a file, a glob, a folder of data files, a saved dataset (save_to_disk), or a hub dataset
    name[:config]. Files: .txt/.raw (a document per line), .jsonl/.json, .csv/.tsv, .parquet (records),
    optionally .gz/.xz/.bz2."""
    val_path: Optional[str] = None
    """Validation text, same forms. Default: the hub dataset's validation split, or the last 1% of the training blocks for local files
    (none with --data.streaming). Never streamed."""
    streaming: bool = False
    """Read the local training text as it is trained on, for corpora larger than host memory: each process reads its
    own share in file order (no shuffling), --trainer.max_steps sets the length, and a resume continues at the
    exact block (on the same number of processes)."""
    text_field: str = "text"
    """Field (column) that holds the text in records (.jsonl, .json, .csv, .parquet, saved and hub datasets)."""
    tokenizer: str = "roberta-base"
    """Tokenizer: a hub name or a local folder with tokenizer.json (offline: the repository's examples/data/roberta-tokenizer)."""
    mask_prob: float = 0.15
    """Fraction of (non-special) tokens chosen for prediction."""
    random_replace_prob: float = 0.1
    """Of the chosen tokens, the fraction replaced by a random token."""
    unmask_replace_prob: float = 0.1
    """Of the chosen tokens, the fraction left unchanged (the rest become <mask>)."""
    max_train_lines: Optional[int] = None
    """Read only the first N non-blank training lines (None: all)."""
    max_val_lines: Optional[int] = None
    """Read only the first N non-blank validation lines (None: all)."""
    cache_dir: Optional[str] = "~/.cache/zerotrain"
    """Folder for tokenized rows (and datasets' Arrow copies of the files, in datasets/), reused by every run and
    process while the files (size, time), tokenizer and settings are unchanged (None: no cache). Shared by all
    runs rather than kept in a run's folder, so a second run on the same data starts at once."""

    def validate(self) -> None:
        if not self.train_path:
            raise ConfigError("--data.train_path", "is required")
        if not 0.0 < self.mask_prob <= 1.0:  # 0: no token is predicted, the loss is 0 and nothing is learnt
            raise ConfigError("--data.mask_prob", f"must be in (0, 1] (the fraction of tokens the model learns to "
                              f"predict, e.g. 0.15), got {self.mask_prob}")
        for flag, value in (("--data.random_replace_prob", self.random_replace_prob),
                            ("--data.unmask_replace_prob", self.unmask_replace_prob)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(flag, f"must be in [0, 1], got {value}")
        if self.random_replace_prob + self.unmask_replace_prob > 1.0:
            raise ConfigError("--data.random_replace_prob",
                              f"+ --data.unmask_replace_prob must be <= 1, got "
                              f"{self.random_replace_prob} + {self.unmask_replace_prob}")
        for flag, value in (("--data.max_train_lines", self.max_train_lines),
                            ("--data.max_val_lines", self.max_val_lines)):
            if value is not None and value < 1:
                raise ConfigError(flag, f"must be >= 1 (or unset), got {value}")


@dataclass
class MLMConfig(RunConfig):
    model: MLMModelConfig = field(default_factory=MLMModelConfig)
    """Encoder dimensions."""
    data: MLMDataConfig = field(default_factory=MLMDataConfig)
    """Text, tokenizer and masking."""


class MLMTask(Task[MLMConfig]):
    """Masked-language modelling with a RoBERTa-style encoder. Batches are full packed blocks."""

    name = "mlm"
    config_class = MLMConfig
    description = "RoBERTa masked-language-model pre-training (HelloDeepSpeed)"

    def __init__(self, cfg: MLMConfig):
        super().__init__(cfg)
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tok = load_tokenizer(self.cfg.data.tokenizer)
            if tok.mask_token_id is None or tok.bos_token_id is None or tok.eos_token_id is None:
                raise UserError(f"--data.tokenizer: {self.cfg.data.tokenizer!r} lacks a <mask>, <s> or </s> token, "
                                "which masked-language modelling needs")
            self._tokenizer = tok
        return self._tokenizer

    def run_tokenizer(self):
        return self.tokenizer

    def builds_partitioned(self) -> bool:
        return self.cfg.model.uses_hf()  # zerotrain's own encoder is built whole

    def build_model(self, pretrained: bool = True) -> nn.Module:
        m = self.cfg.model
        if m.uses_hf():
            model = hf.load_model("masked-lm", hf.ModelSource(m.name_or_path or "", m.init, m.config),
                                  hf.resolve_dtype(m.dtype, self.cfg.precision.dtype), pretrained,
                                  min_vocab=len(self.tokenizer))
            longest = getattr(model.config, "max_position_embeddings", None)
            if isinstance(longest, int) and m.max_seq_length > longest:
                raise ConfigError("--model.max_seq_length", f"({m.max_seq_length}) is longer than the "
                                                            f"{longest} positions the model has")
            if self.cfg.activation_checkpointing.enabled:
                hf.enable_activation_checkpointing(model)
            return model
        pad = self.tokenizer.pad_token_id
        return RobertaMLM(
            vocab_size=len(self.tokenizer), num_layers=m.num_layers, num_heads=m.num_heads, h_dim=m.h_dim,
            ff_dim=m.ff_dim, dropout=m.dropout, max_seq_length=m.max_seq_length,
            pad_token_id=pad if pad is not None else self.tokenizer.eos_token_id,
            activation_checkpointing=self.cfg.activation_checkpointing.enabled,
        )

    def build_datasets(self) -> Splits:
        d, T = self.cfg.data, self.cfg.model.max_seq_length
        common = dict(tokenizer=self.tokenizer, max_seq_length=T, text_field=d.text_field, cache_dir=d.cache_dir)
        if d.streaming:
            train = streamed_blocks(d.train_path, masker=self.masker(), seed=self.cfg.trainer.seed,
                                    max_lines=d.max_train_lines, flag="--data.train_path", **common)
            val = None
            if d.val_path is not None:
                blocks = load_packed(d.val_path, split="validation", max_lines=d.max_val_lines, flag="--data.val_path",
                                     **common)
                val = MaskedBlocks(blocks, self.masker(), fixed=True)
            return Splits(train=train, val=val)
        train = load_packed(d.train_path, split="train", max_lines=d.max_train_lines, flag="--data.train_path", **common)
        if d.val_path is not None:
            val = load_packed(d.val_path, split="validation", max_lines=d.max_val_lines, flag="--data.val_path", **common)
        elif not is_local_source(d.train_path):
            val = load_packed(d.train_path, split="validation", max_lines=d.max_val_lines,
                              flag="--data.train_path", **common)
        else:
            if train.shape[0] < 2:
                raise DataError(f"{d.train_path}: {train.shape[0]} block(s) of {T} tokens is too few to hold out "
                                "validation blocks; pass --data.val_path or more text")
            n_val = max(1, int(train.shape[0] * VAL_HOLDOUT_FRACTION))
            train, val = train[:-n_val], train[-n_val:]
        masker = self.masker()
        return Splits(train=MaskedBlocks(train, masker, seed=self.cfg.trainer.seed),
                      val=MaskedBlocks(val, masker, fixed=True))

    def masker(self) -> BlockMasker:
        tok, d = self.tokenizer, self.cfg.data
        specials = sorted({t for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if t is not None})
        return BlockMasker(tuple(specials), tok.mask_token_id, len(tok), d.mask_prob, d.random_replace_prob,
                           d.unmask_replace_prob)

    def collator(self):
        return collate_masked

    def deepspeed_hints(self, model: nn.Module) -> dict[str, Any]:
        if self.cfg.model.uses_hf():
            return super().deepspeed_hints(model)
        return {"hidden_size": self.cfg.model.h_dim}

    def transformer_shape(self, model: nn.Module) -> Optional[TransformerShape]:
        """A Hugging Face masked LM: full blocks of ``--model.max_seq_length`` without a mask, every position scored
        over the vocabulary (its head scores them all). zerotrain's own encoder: None (measured only)."""
        if not self.cfg.model.uses_hf():
            return None
        T = self.cfg.model.max_seq_length
        return transformer_shape(model, T, T, dense_mask=False)

    def _masked_logits(self, model: nn.Module, batch: Batch):
        """(loss, logits of the masked positions (M, V)). A Hugging Face masked LM scores every position and
        takes the labels' -100 as the ones to skip; zerotrain's encoder is handed the masked positions."""
        positions = batch["masked_positions"]  # (M,)
        if self.cfg.model.uses_hf():
            out = model(input_ids=batch["input_ids"], labels=batch["labels"])
            logits = out.logits.flatten(0, 1).index_select(0, positions)  # (B*T, V) -> (M, V)
            return out.loss, logits
        # Packed blocks are full (collate_masked): no mask, so attention runs its fastest kernel.
        out = model(input_ids=batch["input_ids"], attention_mask=None, labels=batch["labels"],
                    masked_positions=positions)
        return out["loss"], out["logits"]

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        loss, _ = self._masked_logits(model, batch)
        B, T = batch["input_ids"].shape
        return StepOutput(loss=loss, tokens=B * T, samples=B)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        positions = batch["masked_positions"]  # (M,)
        _, picked = self._masked_logits(model, batch)  # full blocks, as in training
        target = batch["labels"].flatten().index_select(0, positions)  # (M,)
        picked = picked.float()  # (M, V)
        loss_sum = F.cross_entropy(picked, target, reduction="sum") if target.numel() else picked.sum()
        return {
            "loss_sum": float(loss_sum.item()),
            "masked": float(target.numel()),
            "correct": float((picked.argmax(dim=-1) == target).sum().item()),
        }

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        masked = max(sums.get("masked", 0.0), 1.0)
        loss = sums.get("loss_sum", 0.0) / masked
        # The loop prefixes these with the split: val_loss, val_ppl, val_mlm_acc.
        return {
            "loss": loss,
            "ppl": math.exp(min(loss, MAX_PPL_LOSS)),
            "mlm_acc": sums.get("correct", 0.0) / masked,
        }

    def flops_per_token(self, model: nn.Module) -> float:
        if self.cfg.model.uses_hf():
            return hf.transformer_flops_per_token(model, self.cfg.model.max_seq_length)
        return model.flops_per_token(self.cfg.model.max_seq_length, predicted_fraction=self.cfg.data.mask_prob)

    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir) -> None:
        """A Hugging Face masked LM is written as a Hugging Face folder; zerotrain's encoder as ``model.safetensors``."""
        if not self.cfg.model.uses_hf():
            return super().export(model, state_dict, out_dir)
        hf.save_hf_folder(model, state_dict, Path(out_dir), self.tokenizer)

    def export_hf(self, lazy: dict, out_dir, dtype: torch.dtype) -> list[str]:
        """``zerotrain export --format hf``: a Hugging Face masked LM as :meth:`export` writes it; zerotrain's encoder
        converted to RobertaForMaskedLM."""
        if self.cfg.model.uses_hf():
            return hf.export_checkpoint(self, lazy, Path(out_dir), dtype)

        return _export_hf_roberta(self, lazy, Path(out_dir), dtype)

    def load_exported(self, model: nn.Module, export_dir) -> None:
        if self.cfg.model.uses_hf() and hf.is_hf_folder(Path(export_dir)):
            return hf.load_hf_folder_into("masked-lm", model, Path(export_dir))
        return super().load_exported(model, export_dir)

    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: list[str], top_k: int = 5, **options: Any) -> list[str]:
        """Fill-mask: for every ``<mask>`` of each text (the tokenizer's mask token), the ``top_k``
        likeliest tokens with their probabilities, ``token prob, token prob, ...``; the groups of a
        text's masks, left to right, are joined by `` | ``. A text without a mask is refused."""
        tok = self.tokenizer
        device = next(model.parameters()).device
        longest = self.cfg.model.max_seq_length
        k = max(1, min(top_k, len(tok)))
        lines = []
        for i, text in enumerate(inputs, 1):
            ids = tok(text, add_special_tokens=True)["input_ids"]
            x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
            positions = (x[0] == tok.mask_token_id).nonzero().flatten().tolist()
            if not positions:
                raise UserError(f"text {i} has no {tok.mask_token}: write {tok.mask_token} where a word is to be "
                                f"predicted, e.g. \"the movie was {tok.mask_token}\"")
            if len(ids) > longest:
                raise UserError(f"text {i} is {len(ids)} tokens long with <s> and </s>, more than the "
                                f"{longest} the model was trained on (--model.max_seq_length): shorten it")
            logits = model(input_ids=x, attention_mask=torch.ones_like(x))["logits"][0]  # (T, V)
            groups = []
            for pos in positions:
                probs, top = logits[pos].float().softmax(dim=-1).topk(k)  # (k,) each
                groups.append(", ".join(f"{self._token_text(j)} {p:.3f}" for p, j in zip(probs.tolist(), top.tolist())))
            lines.append(" | ".join(groups))
        return lines

    def _token_text(self, token_id: int) -> str:
        """A vocabulary entry as text: the word for byte-level BPE's ``Ġword``, the token itself when blank."""
        text = self.tokenizer.decode([token_id]).strip()
        return text or repr(self.tokenizer.convert_ids_to_tokens(token_id))

