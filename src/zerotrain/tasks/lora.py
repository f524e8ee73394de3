"""LoRA fine-tuning of a causal language model on prompt/target records, with the prompt masked.

The base model stays frozen; peft adds low-rank adapters (``lora_A``, ``lora_B``) to the chosen
linear layers and only those are trained. What is exported is therefore the adapter in peft's own
layout (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
``PeftModel.from_pretrained(base, folder)``, and optionally the merged full model.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.data.collate import IGNORE_INDEX, PadCollator
from zerotrain.data.io import hub_offline, looks_local
from zerotrain.data.sft import _adds_bos, build_examples, load_records, split_template
from zerotrain.data.tokenizer import load_tokenizer
from zerotrain.errors import ConfigError, UserError
from zerotrain.tasks.base import Batch, Splits, StepOutput, Task

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def _peft_quiet():
    """peft (0.21) reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model, and
    transformers 5 warns (FutureWarning) on every read. The call is peft's, not the user's: ignore that one
    warning while peft wraps, and nothing else."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


@dataclass
class LoRAModelConfig:
    name_or_path: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    """Base model: a local folder saved with save_pretrained, or a Hugging Face hub name (needs network or the HF cache)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained loads the weights of name_or_path; random builds an untrained model from --model.config (tests, smoke runs)."""
    config: Optional[str] = None
    """init=random: a config.json file (or a folder holding one) describing the architecture, e.g. configs/tiny_llama_config.json."""
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
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub name; default --model.name_or_path."""

    def validate(self) -> None:
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


class LoRATask(Task[LoRAConfig]):
    """Causal-LM LoRA fine-tuning.

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

    def __init__(self, cfg: LoRAConfig):
        super().__init__(cfg)
        self._tokenizer = None
        self._summary: Optional[dict[str, Any]] = None

    # ---- model -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            m = self.cfg.model
            tok = load_tokenizer(m.tokenizer or m.name_or_path, flag="--model.tokenizer")
            if tok.pad_token is None:
                # Padding positions are masked (attention 0, label -100), so reusing EOS as pad
                # changes nothing the model learns, and it needs no new embedding row.
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
        return self._tokenizer

    def run_tokenizer(self):
        return self.tokenizer

    def _dtype(self) -> torch.dtype:
        choice = self.cfg.model.dtype
        if choice == "auto":
            choice = self.cfg.precision.dtype if self.cfg.precision.dtype in ("bf16", "fp16") else "fp32"
        return _DTYPES[choice]

    def _load_base(self, pretrained: bool = True) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        m = self.cfg.model
        dtype = self._dtype()
        if m.init == "random":
            if not m.config:
                raise ConfigError("--model.config", "is required with --model.init random")
            try:
                config = AutoConfig.from_pretrained(str(Path(m.config).expanduser()))
            except (OSError, ValueError) as exc:
                raise UserError(
                    f"--model.config: cannot read a model config from {m.config!r} "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
                ) from None
            vocab = len(self.tokenizer)
            if getattr(config, "vocab_size", vocab) < vocab:
                raise ConfigError(
                    "--model.config",
                    f"vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab} tokens; "
                    "raise vocab_size in the config file or use a matching --model.tokenizer",
                )
            return AutoModelForCausalLM.from_config(config, dtype=dtype)

        path = Path(m.name_or_path).expanduser()
        local = looks_local(m.name_or_path)
        if local and not path.is_dir():
            raise UserError(f"--model.name_or_path: model folder {m.name_or_path!r} does not exist")
        source = str(path) if local else m.name_or_path
        if not local:
            hub_offline()  # offline, fail at once with the message below instead of minutes of retries
        try:
            if not pretrained:  # the architecture from config.json; the weights are never read
                return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
            return AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        except (OSError, ValueError) as exc:
            where = f"folder {m.name_or_path!r}" if local else f"hub name {m.name_or_path!r}"
            raise UserError(
                f"--model.name_or_path: could not load a causal LM from the {where} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}). Offline, pass a local folder saved with "
                "save_pretrained via --model.name_or_path, or use --model.init random --model.config FILE"
            ) from None

    def _wrap(self, base: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        m = self.cfg.model
        if self.cfg.activation_checkpointing.enabled:
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # The embedding is frozen, so its output does not require grad. Reentrant checkpointing
            # then sees a segment with no grad-requiring input and returns outputs without grad, and
            # the LoRA weights inside silently get no gradient. Non-reentrant checkpointing does not
            # have that failure, but marking the embedding output as requiring grad keeps it safe
            # whichever variant a model's checkpointing uses, at the cost of one small extra grad.
            base.enable_input_require_grads()
            # The KV cache is useless in training and HF disables it under checkpointing anyway (with a warning)
            if getattr(base, "config", None) is not None:
                base.config.use_cache = False
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=m.lora_r,
            lora_alpha=m.lora_alpha,
            lora_dropout=m.lora_dropout,
            target_modules=list(m.target_modules),
        )
        try:
            with _peft_quiet():
                return get_peft_model(base, lora)
        except ValueError as exc:
            raise ConfigError("--model.target_modules", f"{list(m.target_modules)}: {str(exc).splitlines()[0]}") from None

    def build_model(self, pretrained: bool = True) -> nn.Module:
        model = self._wrap(self._load_base(pretrained))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        self._summary = {"trainable": trainable, "total": total, "fraction": trainable / max(total, 1)}
        logger.info("LoRA: %s", self.trainable_summary_text())
        return model

    def trainable_summary(self) -> dict[str, Any]:
        """Trainable and total parameter counts of the last model built: {trainable, total, fraction}."""
        if self._summary is None:
            raise RuntimeError("trainable_summary() is known after build_model()")
        return dict(self._summary)

    def trainable_summary_text(self) -> str:
        s = self.trainable_summary()
        return f"trainable params: {s['trainable']:,} || all params: {s['total']:,} || trainable%: {100 * s['fraction']:.4f}"

    # ---- data ------------------------------------------------------------------------------
    def _examples(self, path: str) -> list[dict[str, list[int]]]:
        d = self.cfg.data
        records = load_records(path, d.input_field, d.target_field)
        return build_examples(records, self.tokenizer, d.template, d.max_length, d.train_on_inputs,
                              d.input_field, d.target_field, source=str(path))

    def build_datasets(self) -> Splits:
        d = self.cfg.data
        if not d.train_path:
            raise ConfigError("--data.train_path", "is required")
        train = self._examples(d.train_path)
        val = self._examples(d.val_path) if d.val_path else None
        return Splits(train=train, val=val)

    def collator(self) -> PadCollator:
        return PadCollator(self.tokenizer.pad_token_id, self.cfg.data.pad_to_multiple_of, max_len=self.cfg.data.max_length)

    def train_lengths(self, train: list[dict[str, list[int]]]) -> Optional[list[int]]:
        if not self.cfg.data.bucket_by_length:
            return None
        return [len(example["input_ids"]) for example in train]

    # ---- steps -----------------------------------------------------------------------------
    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        # use_cache=False: Hugging Face's causal LMs otherwise fill a KV cache in training too (copies per
        # layer, nothing reads them), and a compiled block would be re-traced as each layer's cache fills.
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    use_cache=False)
        b, t = batch["input_ids"].shape  # (B, T)
        return StepOutput(loss=out.loss, tokens=b * t, samples=b)

    def loss_weight(self, batch: Batch) -> float:
        """Target tokens the causal-LM loss averages over (labels shift by one: position t predicts t+1)."""
        return float((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits  # (B, T, V)
        # Position t predicts token t+1, as in HF's causal-LM loss
        shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
        shift_labels = batch["labels"][:, 1:]  # (B, T-1)
        loss_sum = F.cross_entropy(
            shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        tokens = (shift_labels != IGNORE_INDEX).sum()
        return {"loss_sum": float(loss_sum), "tokens": float(tokens)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = sums.get("tokens", 0.0)
        if tokens <= 0:
            return {"loss": float("nan"), "ppl": float("nan")}
        loss = sums["loss_sum"] / tokens
        return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf")}

    def flops_per_token(self, model: nn.Module) -> float:
        """4 x frozen + 6 x trainable parameters.

        Every weight costs 2 FLOPs per token forward and 2 more backward for the gradient of its
        input (the gradient must flow through frozen layers to reach the adapters below them), but
        only trainable weights pay the last 2 for their own weight gradient. This is the work the
        hardware does; 6 x all parameters would overstate LoRA's MFU by up to 1.5x.
        """
        frozen = trainable = 0
        for p in model.parameters():
            n = p.numel()
            if p.requires_grad:
                trainable += n
            else:
                frozen += n
        return 4.0 * frozen + 6.0 * trainable

    # ---- export ----------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write ``out_dir/adapter`` (peft layout + tokenizer) and, with merge_on_export, ``out_dir/merged``.

        ``state_dict`` is the consolidated state dict of the peft-wrapped model (keys such as
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).
        """
        from peft import get_peft_model_state_dict

        out_dir = Path(out_dir)
        if state_dict and all(k.startswith("module.") for k in state_dict):
            state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
        adapter = get_peft_model_state_dict(model, state_dict=state_dict, save_embedding_layers=False)
        empty = [k for k, v in adapter.items() if v.numel() == 0]
        if not adapter or empty:
            raise RuntimeError(
                "refusing to write an empty LoRA adapter "
                f"({'no adapter tensors in the state dict' if not adapter else f'{len(empty)} empty tensors, e.g. {empty[0]}'}). "
                "Under ZeRO-3 parameters are partitioned: export from the consolidated state dict "
                "(stage3_gather_16bit_weights_on_model_save / zero_to_fp32), not the live module"
            )
        adapter_dir = out_dir / "adapter"
        adapter_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(adapter_dir), state_dict=state_dict, safe_serialization=True,
                              save_embedding_layers=False)
        self.tokenizer.save_pretrained(str(adapter_dir))
        logger.info("LoRA adapter written to %s", adapter_dir)

        if self.cfg.model.merge_on_export:
            # A fresh CPU copy: the live model may sit on a GPU or be ZeRO-3 partitioned, and
            # merging in place would also change the module the engine still holds.
            fresh = self._wrap(self._load_base())
            fresh.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()}, strict=True)
            merged = fresh.merge_and_unload()
            if getattr(merged, "config", None) is not None:
                merged.config.use_cache = True  # turned off for checkpointed training; generation wants it
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
                base = self._load_base(pretrained=True)
            except UserError as exc:
                raise UserError(f"the base model the adapter in {adapter_dir} was trained on cannot be loaded: "
                                f"{exc}") from None
        try:
            with _peft_quiet():
                loaded = PeftModel.from_pretrained(base, str(adapter_dir))
            model.load_state_dict(loaded.state_dict())
        except (ValueError, RuntimeError, KeyError, OSError) as exc:
            detail = " ".join(str(exc).split())
            raise UserError(f"{adapter_dir} does not fit the model the run's hparams.json describes "
                            f"({type(exc).__name__}: {detail[:300]})") from None

    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: list[str], max_new_tokens: int = 32, **options: Any) -> list[str]:
        """The greedy continuation of each input, prompted as in training: ``--data.template`` up to
        ``{target}`` with the input in place of ``{input}`` (and BOS first when the tokenizer adds
        one). At most ``max_new_tokens`` new tokens, stopping at EOS; newlines and tabs in the
        continuation are written as ``\\n`` and ``\\t`` so that each input gets one line."""

        tok = self.tokenizer
        head, _ = split_template(self.cfg.data.template)
        start = [tok.bos_token_id] if _adds_bos(tok) else []
        device = next(model.parameters()).device
        lines = []
        for text in inputs:
            # str.replace, not str.format, as in training: inputs may contain braces
            ids = start + list(tok(head.replace("{input}", text), add_special_tokens=False)["input_ids"])
            x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            new = out[0, x.shape[1]:].tolist()
            if tok.eos_token_id in new:
                new = new[:new.index(tok.eos_token_id)]
            lines.append(tok.decode(new, skip_special_tokens=True).replace("\n", "\\n").replace("\t", "\\t"))
        return lines
