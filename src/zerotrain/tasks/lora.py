"""LoRA fine-tuning of a causal language model on prompt/target records, with the prompt masked.

This is the ``causal-lm`` recipe (:mod:`zerotrain.tasks.causal_lm`) with LoRA always on, SFT records padded
per batch, and its own flags (``--model.lora_r``, ``--data.max_length``...). The base model stays frozen;
peft adds low-rank adapters (``lora_A``, ``lora_B``) to the chosen linear layers and only those are trained. What is exported is therefore the adapter in peft's own
layout (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
``PeftModel.from_pretrained(base, folder)``, and optionally the merged full model.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.engines.states import full_numel
from zerotrain.errors import ConfigError, UserError
from zerotrain.models import hf
from zerotrain.tasks.causal_lm import CausalLMTask
from zerotrain.train.state import unreadable

logger = logging.getLogger(__name__)


@dataclass
class LoRAModelConfig(hf.ModelSection):
    resume_safe = frozenset({"merge_on_export"})  # what the export writes, not what is trained

    name_or_path: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    """Base model: a local folder saved with save_pretrained, or a Hugging Face hub name (needs network or the HF cache)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Weights' dtype when loading; auto follows --precision.dtype (bf16/fp16 there, else fp32)."""
    lora_r: int = 8
    """Rank of the LoRA update matrices."""
    lora_alpha: int = 32
    """LoRA scaling numerator: the update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.1
    """Dropout on the LoRA branch's input during training."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Names of the linear layers that get adapters (Llama: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."""
    merge_on_export: bool = False
    """Also write the merged full model (base + adapter folded in) to <export>/merged via save_pretrained."""
    def validate(self) -> None:  # the base model's tokenizer serves a random init, so none is required
        if not self.name_or_path and self.init == "pretrained":
            raise ConfigError("--model.name_or_path", "is required with --model.init pretrained")
        if self.init == "random":
            if not self.config:
                raise ConfigError(
                    "--model.config", "is required with --model.init random (a config.json file or a folder holding one)"
                )
            if not Path(self.config).expanduser().exists():
                raise ConfigError("--model.config", f"file {self.config!r} does not exist")
            if not (self.tokenizer or self.name_or_path):
                raise ConfigError("--model.tokenizer", "is required with --model.init random")
        if self.lora_r < 1:
            raise ConfigError("--model.lora_r", f"must be >= 1, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise ConfigError("--model.lora_alpha", f"must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError("--model.lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules:
            raise ConfigError("--model.target_modules", "must name at least one module, e.g. [q_proj, v_proj]")


@dataclass
class LoRADataConfig:
    train_path: str = ""
    """Training records: .json (a list of objects), .jsonl or .jsonl.gz (one object per line)."""
    val_path: Optional[str] = None
    """Validation records in the same format (None: no evaluation)."""
    input_field: str = "input"
    """Record field holding the prompt's input."""
    target_field: str = "target"
    """Record field holding the answer the model learns to produce."""
    template: str = "{input}\n{target}"
    """How input and target are joined; the text before {target} is the prompt (masked from the loss)."""
    max_length: int = 512
    """Tokens per example (BOS + prompt + target + EOS) after truncation."""
    train_on_inputs: bool = False
    """Also compute the loss on prompt tokens (default: only on the target)."""
    bucket_by_length: bool = False
    """Group examples of similar length into the same batches to cut padding (batches stay shuffled)."""
    pad_to_multiple_of: int = 8
    """Pad each batch to a multiple of this many tokens. With --compile.enabled use 64: padded to 8, compiled
    LoRA 1.2B stalled 12-15 s once mid-run (a rebuild of the Triton kernels for a new divisibility of the
    length by 16, likely but not confirmed); padded to 64 it did not."""

    def validate(self) -> None:
        if self.pad_to_multiple_of < 1:
            raise ConfigError("--data.pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")
        if not self.train_path:
            raise ConfigError("--data.train_path", "is required: a .json or .jsonl file of input/target records")
        if "{input}" not in self.template or "{target}" not in self.template:
            raise ConfigError("--data.template", f"must contain {{input}} and {{target}}, got {self.template!r}")
        if self.template.index("{input}") > self.template.index("{target}"):
            raise ConfigError("--data.template", "{input} must come before {target}")
        if self.max_length < 2:
            raise ConfigError("--data.max_length", f"must be >= 2, got {self.max_length}")


@dataclass
class LoRAConfig(RunConfig):
    """LoRA fine-tuning of a causal LM: the shared sections plus ``model`` and ``data``."""

    model: LoRAModelConfig = field(default_factory=LoRAModelConfig)
    """Base model, LoRA hyper-parameters and export."""
    data: LoRADataConfig = field(default_factory=LoRADataConfig)
    """Prompt/target records and how they become tokens."""


class LoRATask(CausalLMTask):
    """Causal-LM LoRA fine-tuning: :class:`~zerotrain.tasks.causal_lm.CausalLMTask` with LoRA on.

    Design decisions:

    * The loss is Hugging Face's causal-LM loss on labels that are -100 on prompt and padding, so
      only target tokens (and EOS) are learned. Evaluation sums per-token losses itself so that
      the reported loss is token-weighted across batches and ranks, not a mean of batch means.
    * Export writes the adapter from the consolidated ``state_dict`` the loop passes in, never
      from the live module: under ZeRO-3 the live parameters are empty partitions, and peft would
      happily write an adapter of empty tensors. :meth:`export` refuses that case.
    """

    name = "lora"
    config_class = LoRAConfig
    description = "LoRA fine-tuning of a causal LM with prompt masking"
    length_flag = "--data.max_length"

    def __init__(self, cfg: LoRAConfig):
        super().__init__(cfg)
        self._summary: Optional[dict[str, Any]] = None

    # ---- this recipe's flags, read by the causal-lm task -------------------------------------
    def lora_settings(self) -> hf.LoRASettings:
        m = self.cfg.model
        return hf.LoRASettings(m.lora_r, m.lora_alpha, m.lora_dropout, list(m.target_modules), flag="--model.")

    def data_format(self) -> str:
        return "sft"

    def seq_len(self) -> int:
        return self.cfg.data.max_length

    def packed(self) -> bool:
        return False

    def cache_dir(self) -> None:
        return None  # records are few and tokenized in seconds

    def streaming(self) -> bool:
        return False

    def _load_base(self, pretrained: bool = True) -> nn.Module:
        return self.load_base(pretrained)

    def build_model(self, pretrained: bool = True) -> nn.Module:
        model = super().build_model(pretrained)
        trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
        total = sum(full_numel(p) for p in model.parameters())
        self._summary = {"trainable": trainable, "total": total, "fraction": trainable / max(total, 1)}
        return model

    def trainable_summary(self) -> dict[str, Any]:
        """Trainable and total parameter counts of the last model built: {trainable, total, fraction}."""
        if self._summary is None:
            raise RuntimeError("trainable_summary() is known after build_model()")
        return dict(self._summary)

    def trainable_summary_text(self) -> str:
        s = self.trainable_summary()
        return f"trainable params: {s['trainable']:,} || all params: {s['total']:,} || trainable%: {100 * s['fraction']:.4f}"

    def flops_per_token(self, model: nn.Module) -> float:
        """4 x frozen + 6 x trainable parameters.

        Every weight costs 2 FLOPs per token forward and 2 more backward for the gradient of its
        input (the gradient must flow through frozen layers to reach the adapters below them), but
        only trainable weights pay the last 2 for their own weight gradient. This is the work the
        hardware does; 6 x all parameters would overstate LoRA's MFU by up to 1.5x.
        """
        frozen = trainable = 0
        for p in model.parameters():
            n = full_numel(p)
            if p.requires_grad:
                trainable += n
            else:
                frozen += n
        return 4.0 * frozen + 6.0 * trainable

    export_hf = None
    """No ``zerotrain export --format hf``: the lora recipe's checkpoint holds the adapter, and ``--format
    safetensors`` already writes the merged model as a Hugging Face folder (``model/merged``)."""

    # ---- export ----------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write ``out_dir/adapter`` (peft layout + tokenizer) and, with merge_on_export, ``out_dir/merged``.

        ``state_dict`` is the consolidated state dict of the peft-wrapped model (keys such as
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).
        """
        out_dir = Path(out_dir)
        # Gathered once, whole: peft reads every weight for the adapter, and the merged model needs them all
        state_dict = dict(hf.strip_module_prefix(state_dict))
        adapter_dir = out_dir / "adapter"
        hf.write_adapter(model, state_dict, adapter_dir, self.tokenizer)
        logger.info("LoRA adapter written to %s", adapter_dir)
        if self.cfg.model.merge_on_export:
            merged = hf.merged_copy(lambda: self._wrap(self.load_base()), state_dict)
            merged_dir = out_dir / "merged"
            merged.save_pretrained(str(merged_dir), safe_serialization=True)
            self.tokenizer.save_pretrained(str(merged_dir))
            logger.info("merged model written to %s", merged_dir)

    # ---- inference -------------------------------------------------------------------------
    def load_exported(self, model: nn.Module, export_dir: Path) -> None:
        """Load the run's base weights and its adapter (``export_dir/adapter``) into ``model``, the
        peft model ``build_model(pretrained=False)`` built.

        The export holds only the adapter, so the base weights come from where the run took them:
        ``--model.name_or_path`` (``pretrained``), or the run's own seeded initialisation
        (``random``: the same seed and draw order as the training loop, which seeds
        ``--trainer.seed`` just before building the model). peft's own loader reads the adapter.
        """
        from peft import PeftModel

        adapter_dir = Path(export_dir) / "adapter"
        if not (adapter_dir / "adapter_config.json").is_file():
            raise UserError(f"{adapter_dir / 'adapter_config.json'} is missing: the run did not finish exporting "
                            "its LoRA adapter. Let it finish (or resume it) and try again")
        with torch.random.fork_rng(devices=[]):
            if self.cfg.model.init == "random":
                torch.manual_seed(self.cfg.trainer.seed)
            try:
                base = self.load_base(pretrained=True)
            except UserError as exc:
                raise UserError(f"the base model the adapter in {adapter_dir} was trained on cannot be loaded: "
                                f"{exc}") from None
        try:
            with hf.peft_quiet():
                loaded = PeftModel.from_pretrained(base, str(adapter_dir))
            model.load_state_dict(loaded.state_dict())
        except pickle.UnpicklingError as exc:  # peft loads a pickled adapter weights-only (load_run refuses one first)
            raise unreadable(adapter_dir, exc, ("", "Export the run's checkpoint again with zerotrain export")) from None
        except (ValueError, RuntimeError, KeyError, OSError) as exc:
            detail = " ".join(str(exc).split())
            raise UserError(f"{adapter_dir} does not fit the model the run's hparams.json describes "
                            f"({type(exc).__name__}: {detail[:300]})") from None
