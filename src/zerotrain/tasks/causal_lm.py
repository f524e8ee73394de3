"""Full-parameter (or LoRA) training of any Hugging Face causal LM: pre-training on raw text, supervised
fine-tuning on prompt/response records and on chat conversations.

Design decisions:

* The model is whatever ``AutoModelForCausalLM`` builds from ``--model.name_or_path`` or, with
  ``--model.init random``, from ``--model.config``; loading is :mod:`zerotrain.models.hf`'s, shared with the
  ``lora``, ``classify`` and ``mlm`` recipes.
* Raw text is always packed (rows of exactly ``--data.seq_len``); SFT and chat examples are packed with
  ``--data.pack`` (default) or padded per batch, optionally grouped by length. Packed rows carry
  ``position_ids`` that restart at each example and no attention mask, which transformers reads as packed
  sequences: attention stays within each document for models that build their mask with its masking utilities
  (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX and most decoders of transformers 5); the log says which applies.
* The loss is Hugging Face's causal-LM loss on labels that are -100 on prompts, padding and each document's
  first token, weighted by target tokens across micro-batches and ranks (:meth:`loss_weight`).
* ``--model.lora.r`` > 0 trains LoRA adapters on a frozen base instead; the export then holds the merged model
  (and the adapter in ``adapter/``). The ``lora`` recipe is this task with LoRA always on and its own flags.
* Export writes a Hugging Face folder (config, weights, tokenizer, generation config) that
  ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import glob
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from jinja2 import TemplateSyntaxError
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.data.collate import IGNORE_INDEX, PadCollator
from zerotrain.data import source
from zerotrain.data.lm import PACK_CHUNK, chat_rows, collate_packed, render_chat, sft_rows, text_rows
from zerotrain.data.sft import _adds_bos, split_template
from zerotrain.data.streaming import StreamedRows, first_columns, share_where, streamed_source
from zerotrain.data.tokenizer import load_tokenizer, with_pad_token
from zerotrain.errors import ConfigError, DataError, UserError
from zerotrain.models import hf
from zerotrain.models.shape import TransformerShape, head_dim, transformer_shape
from zerotrain.tasks.base import Batch, Splits, StepOutput, Task

logger = logging.getLogger(__name__)


@dataclass
class LoRASection:
    r: int = 0
    """Rank of the LoRA update matrices; 0 (the default) trains every parameter instead."""
    alpha: int = 32
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the LoRA branch's input during training."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (GPT-2: c_attn; GPT-NeoX: query_key_value)."""

    def validate(self) -> None:
        if self.r < 0:
            raise ConfigError("--model.lora.r", f"must be >= 0 (0: no LoRA), got {self.r}")
        if self.r and self.alpha <= 0:
            raise ConfigError("--model.lora.alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--model.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.r and not self.target_modules:
            raise ConfigError("--model.lora.target_modules", "must name at least one module, e.g. [q_proj, v_proj]")


@dataclass
class CausalLMModelConfig(hf.ModelSection):
    lora: LoRASection = field(default_factory=LoRASection)
    """LoRA instead of full-parameter training (--model.lora.r > 0)."""

    def validate(self) -> None:
        super().validate()
        self.lora.validate()


@dataclass
class CausalLMDataConfig:
    resume_safe = frozenset({"cache_dir"})  # where the tokenised text is kept, not what it holds

    train_path: str = ""
    """Training data: a file, a glob, a folder of data files or a saved dataset (save_to_disk). Files: .txt (a
    document per line), .json/.jsonl, .csv/.tsv, .parquet (records), optionally .gz/.xz/.bz2. Text: documents in
    --data.text_field; sft: prompt/response records; chat: records with a list of messages."""
    val_path: Optional[str] = None
    """Validation data in the same format (None: no evaluation); never streamed."""
    streaming: bool = False
    """Read the training data as it is trained on, for corpora larger than host memory: each process reads its
    own share in file order (no shuffling), --trainer.max_steps sets the length, and a resume continues at the
    exact row (on the same number of processes)."""
    format: Literal["auto", "text", "sft", "chat"] = "auto"
    """text: raw documents (pre-training); sft: prompt/response records, the prompt masked; chat: conversations
    rendered with the chat template, only assistant turns learned. auto: chat when the first record has
    --data.messages_field, sft when it has --data.input_field, else text."""
    seq_len: int = 1024
    """Tokens per packed row (and the longest example)."""
    pack: bool = True
    """Pack several examples into each row (text is always packed); false pads each batch to its longest."""
    document_mask: bool = True
    """Packed rows: each document attends only to itself, from position 0; false gives a row one causal mask and
    positions 0..seq_len-1 across its documents (as chunked pre-training corpora are usually trained), which
    runs the fastest attention kernels."""
    text_field: str = "text"
    """text: the field (column) holding a document in .jsonl and .parquet files."""
    input_field: str = "input"
    """sft: the record field holding the prompt's input."""
    target_field: str = "target"
    """sft: the record field holding the response the model learns to produce."""
    template: str = "{input}\n{target}"
    """sft: how input and target are joined; the text before {target} is the prompt (masked from the loss)."""
    messages_field: str = "messages"
    """chat: the record field holding the list of {role, content} messages."""
    chat_template: Optional[str] = None
    """chat: a Jinja chat template (a file, or the template itself) for a tokenizer that has none."""
    train_on_inputs: bool = False
    """sft/chat: also learn the prompt (non-assistant) tokens."""
    bucket_by_length: bool = False
    """Unpacked: group examples of similar length into the same batches to cut padding (batches stay shuffled)."""
    pad_to_multiple_of: int = 8
    """Unpacked: pad each batch to a multiple of this many tokens."""
    max_train_lines: Optional[int] = None
    """text: read only the first N non-blank training documents (None: all)."""
    cache_dir: Optional[str] = "~/.cache/zerotrain"
    """Folder for tokenized rows (and datasets' Arrow copies of the files, in datasets/), reused by every run and
    process while the files (size, time), tokenizer and settings are unchanged (None: no cache). Shared by all
    runs rather than kept in a run's folder, so a second run on the same data starts at once."""

    def validate(self) -> None:
        if not self.train_path:
            raise ConfigError("--data.train_path", "is required: a text file, or .jsonl records (sft, chat)")
        if self.seq_len < 2:
            raise ConfigError("--data.seq_len", f"must be >= 2, got {self.seq_len}")
        if self.pad_to_multiple_of < 1:
            raise ConfigError("--data.pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")
        if "{input}" not in self.template or "{target}" not in self.template:
            raise ConfigError("--data.template", f"must contain {{input}} and {{target}}, got {self.template!r}")
        if self.template.index("{input}") > self.template.index("{target}"):
            raise ConfigError("--data.template", "{input} must come before {target}")
        if self.max_train_lines is not None and self.max_train_lines < 1:
            raise ConfigError("--data.max_train_lines", f"must be >= 1 (or unset), got {self.max_train_lines}")


@dataclass
class CausalLMConfig(RunConfig):
    """Causal-LM training: the shared sections plus ``model`` and ``data``."""

    model: CausalLMModelConfig = field(default_factory=CausalLMModelConfig)
    """The model, its tokenizer and LoRA."""
    data: CausalLMDataConfig = field(default_factory=CausalLMDataConfig)
    """Text, records or conversations and how they become rows of tokens."""


def _compile_chat_template(text: str) -> None:
    """Compile ``text`` as transformers' ``apply_chat_template`` does (its sandbox with ``{% break %}``,
    ``{% continue %}`` and ``{% generation %}``), so that a template it renders is never refused here; raises
    jinja2's ``TemplateSyntaxError`` for one that does not parse. Without that private helper (another
    transformers), plain Jinja with loop controls; ``{% generation %}`` then waits for the first record."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(text)
        except TemplateSyntaxError as exc:
            if "'generation'" not in str(exc.message):
                raise
        return
    _compile_jinja_template(text)


def _first_documents(texts: list, n: int) -> int:
    """How many leading rows hold the first ``n`` non-blank documents (--data.max_train_lines)."""
    seen = 0
    for i, text in enumerate(texts):
        if isinstance(text, str) and text.strip():
            seen += 1
            if seen == n:
                return i + 1
    return len(texts)


def _masking_module_builds_packed_mask(model: nn.Module) -> bool:
    """Whether ``model``'s modeling module builds its attention mask with transformers' masking utilities,
    which turn restarting ``position_ids`` (and no attention mask) into a packed-sequence mask."""
    base = getattr(model, "get_base_model", lambda: model)()
    module = sys.modules.get(type(base).__module__)
    return module is not None and hasattr(module, "create_causal_mask")


class CausalLMTask(Task[CausalLMConfig]):
    """Any ``AutoModelForCausalLM``, full-parameter or LoRA, on text, prompt/response records or conversations."""

    name = "causal-lm"
    config_class = CausalLMConfig
    description = "any Hugging Face causal LM: pre-training on text, SFT on records or chats, full or LoRA"
    peft_task_type = "CAUSAL_LM"
    length_flag = "--data.seq_len"
    """The flag that sets the longest example, for error messages."""

    def __init__(self, cfg: CausalLMConfig):
        super().__init__(cfg)
        self._tokenizer = None
        self._sources: dict[str, source.Source] = {}
        self._loaded: dict[str, Any] = {}

    # ---- what differs between this recipe and lora (their flags) -------------------------------
    def source(self) -> hf.ModelSource:
        return self.cfg.model.source()

    def lora_settings(self) -> Optional[hf.LoRASettings]:
        """The LoRA adapters to train, or None for full-parameter training."""
        lora = self.cfg.model.lora
        if lora.r <= 0:
            return None
        return hf.LoRASettings(lora.r, lora.alpha, lora.dropout, list(lora.target_modules), flag="--model.lora")

    def data_format(self) -> str:
        return self.cfg.data.format

    def seq_len(self) -> int:
        return self.cfg.data.seq_len

    def packed(self) -> bool:
        return self.cfg.data.pack or self._format(self.cfg.data.train_path) == "text"

    def document_mask(self) -> bool:
        """Packed rows: whether each document attends only to itself (--data.document_mask)."""
        return self.cfg.data.document_mask

    # ---- model -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            m = self.cfg.model
            # Padding positions are masked (label -100, and attention or their own packed sequence), so
            # reusing EOS as pad changes nothing the model learns, and it needs no new embedding row.
            name = m.tokenizer or m.name_or_path
            self._tokenizer = with_pad_token(load_tokenizer(name, flag="--model.tokenizer"), name, "--model.tokenizer")
        return self._tokenizer

    def run_tokenizer(self):
        return self.tokenizer

    def _dtype(self) -> torch.dtype:
        return hf.resolve_dtype(self.cfg.model.dtype, self.cfg.precision.dtype)

    def load_base(self, pretrained: bool = True) -> nn.Module:
        """The causal LM as loaded, without LoRA.

        A random base under LoRA is built whole, by ``from_config``, under ZeRO-3 too: its frozen weights are never
        saved with the adapter, and export and predict redraw them from the run's seed, in the whole model's draw
        order."""
        model = hf.load_model("causal-lm", self.source(), self._dtype(), pretrained, min_vocab=len(self.tokenizer),
                              redrawn=self.lora_settings() is not None)
        if self._flex_attention_pays(model):
            model.set_attn_implementation("flex_attention")
        return model

    def _flex_attention_pays(self, model: nn.Module) -> bool:
        """Whether ``--model.attn_implementation auto`` means flex_attention: packed rows whose documents are kept
        apart, on a GPU, for a model that supports it. transformers' default (sdpa) then gets a dense mask of
        each row and runs a slower kernel than its causal one; flex_attention skips the blocks the documents
        do not share (Llama-shaped 1.1B, seq 2048, one H200: 55,868 -> 70,810 tokens/s;
        docs/benchmarks/causal_lm_1b_h200_202611.md). Its compiled kernel needs heads of 16 dimensions or more
        (PyTorch 2.11 refuses 8 when it compiles the first step): smaller heads keep sdpa."""
        return (getattr(self.cfg.model, "attn_implementation", "auto") == "auto" and self.packed()
                and self.document_mask() and torch.cuda.is_available()
                and head_dim(getattr(model, "config", None)) >= 16
                and getattr(model, "_supports_flex_attn", False) and hasattr(model, "set_attn_implementation")
                and hf.attention_implementation(model) == "sdpa")

    def _wrap(self, base: nn.Module) -> nn.Module:
        lora = self.lora_settings()
        checkpointing = self.cfg.activation_checkpointing.enabled
        if lora is None:
            if checkpointing:
                hf.enable_activation_checkpointing(base)
            return base
        return hf.add_lora(base, lora, self.peft_task_type, checkpointing)

    def builds_partitioned(self) -> bool:
        return hf.builds_partitioned(self.source(), redrawn=self.lora_settings() is not None)

    def build_model(self, pretrained: bool = True) -> nn.Module:
        model = self._wrap(self.load_base(pretrained))
        if self.lora_settings() is not None:
            logger.info("LoRA: %s", hf.trainable_summary(model))
        if self.packed() and not self.document_mask():
            logger.info("packed rows of %d tokens: one causal mask and positions over the whole row "
                        "(--data.document_mask false)", self.seq_len())
        elif self.packed():
            if _masking_module_builds_packed_mask(model):
                how = (f"attention kept within documents by transformers' packed-sequence mask "
                       f"(attn_implementation={hf.attention_implementation(model)})")
            else:
                how = (f"attention NOT kept within documents: {type(model).__name__} builds its own mask "
                       "(documents in a row see the ones before them)")
            logger.info("packed rows of %d tokens: positions restart at each document, %s", self.seq_len(), how)
        return model

    # ---- data ------------------------------------------------------------------------------
    def cache_dir(self) -> Optional[str]:
        """Where tokenized data is cached (None: nowhere)."""
        return self.cfg.data.cache_dir

    def streaming(self) -> bool:
        """Whether the training split is read as it is trained on (--data.streaming)."""
        return self.cfg.data.streaming

    def _source(self, path: str, flag: str) -> source.Source:
        if path not in self._sources:
            self._sources[path] = source.resolve(path, flag)
        return self._sources[path]

    def _format(self, path: str, flag: str = "--data.train_path") -> str:
        """text, sft or chat: --data.format, or (auto) from the fields of the data's records."""
        fmt = self.data_format()
        if fmt != "auto":
            return fmt
        p = Path(path).expanduser()
        if not (p.exists() or glob.has_magic(path)):  # a finished run read again elsewhere: the text default
            return "text"
        src = self._source(path, flag)
        if src.builder == "text":
            return "text"
        columns = self._columns(src)
        d = self.cfg.data
        if d.messages_field in columns:
            return "chat"
        if d.input_field in columns and d.target_field in columns:
            return "sft"
        return "text"

    def _columns(self, src: source.Source) -> list[str]:
        if self.streaming() and not src.saved:
            return first_columns(src, self.cache_dir())
        return self._raw(src).column_names

    def _raw(self, src: source.Source):
        if src.path not in self._loaded:
            self._loaded[src.path] = src.load(self.cache_dir())
        return self._loaded[src.path]

    def _chat_tokenizer(self):
        tok = self.tokenizer
        template = self.cfg.data.chat_template
        if template:
            p = Path(template).expanduser()
            tok.chat_template = p.read_text(encoding="utf-8") if p.is_file() else template
        if not getattr(tok, "chat_template", None):
            raise UserError("--data.chat_template: the tokenizer has no chat template, so chat records cannot be "
                            "rendered; pass a Jinja template (a file or the text) or a tokenizer that has one")
        try:  # a template that does not parse, found before any record is read
            _compile_chat_template(tok.chat_template if isinstance(tok.chat_template, str) else "")
        except TemplateSyntaxError as exc:
            whose = (f"--data.chat_template {template}" if template
                     else f"the chat template of {self.cfg.model.tokenizer or self.cfg.model.name_or_path}")
            raise UserError(f"{whose}: the Jinja template does not parse (line {exc.lineno}: {exc.message}); fix it "
                            "or pass another --data.chat_template") from None
        return tok

    def _text_column(self, src: source.Source) -> str:
        return "text" if src.builder == "text" else self.cfg.data.text_field

    def row_maker(self, src: source.Source, fmt: str, where) -> Any:
        """The function that turns a chunk of ``src``'s records (columns) into rows, for this format."""
        d, pad = self.cfg.data, self.tokenizer.pad_token_id
        if fmt == "text":
            return text_rows(self._text_column(src), self.tokenizer, self.seq_len(), pad, where)
        if fmt == "chat":
            return chat_rows(self._chat_tokenizer, d.messages_field, self.seq_len(), d.train_on_inputs, pad,
                             self.packed(), where)
        return sft_rows(self.tokenizer, d.template, self.seq_len(), d.train_on_inputs, d.input_field, d.target_field,
                        pad, self.packed(), where, self.length_flag)

    def _needed(self, src: source.Source, fmt: str) -> dict[str, str]:
        d = self.cfg.data
        if fmt == "text":
            return {} if src.builder == "text" else {d.text_field: "--data.text_field"}
        if fmt == "chat":
            return {d.messages_field: "--data.messages_field"}
        return {d.input_field: "--data.input_field", d.target_field: "--data.target_field"}

    def _settings(self, fmt: str) -> list[Any]:
        """What a split's rows depend on besides its files and the tokenizer: part of the cache key."""
        d = self.cfg.data
        common = [fmt, self.seq_len(), self.packed(), PACK_CHUNK]
        if fmt == "text":
            return common + [d.text_field]
        if fmt == "chat":
            return common + [d.messages_field, d.chat_template, d.train_on_inputs]
        return common + [d.input_field, d.target_field, d.template, d.train_on_inputs]

    def _split(self, path: str, flag: str, limit: Optional[int] = None):
        """A split's rows through ``datasets``: tokenized (and packed) by ``Dataset.map`` into the cache, or read
        back from it when the files, tokenizer and settings are unchanged."""
        src, fmt = self._source(path, flag), self._format(path, flag)
        cache = source.check_cache_dir(self.cache_dir())
        key = source.cache_key(src.identity(), self.tokenizer, *self._settings(fmt), limit)
        rows = source.cached_dataset(cache, "causal-lm", key)
        if rows is None:
            raw = self._raw(src)
            src.require_columns(raw.column_names, self._needed(src, fmt), raw)
            if limit is not None:
                raw = raw.select(range(_first_documents(raw[self._text_column(src)], limit)))
            rows = source.cached_map(raw, self.row_maker(src, fmt, src.where), key, cache, "causal-lm",
                                     batch_size=PACK_CHUNK, with_indices=True)
        if len(rows) == 0:
            raise DataError(f"{path} ({flag}): no example of two tokens or more to train on")
        return source.Rows(rows.with_format("numpy") if self.packed() else rows)

    def _streamed(self, path: str, flag: str) -> StreamedRows:
        src, fmt = self._source(path, flag), self._format(path, flag)
        if src.saved:
            src.load(streaming=True)  # refuses, in one line
        src.require_columns(self._columns(src), self._needed(src, fmt))
        limit = self.cfg.data.max_train_lines if fmt == "text" else None
        column = self._text_column(src)
        keep = (lambda r: isinstance(r[column], str) and bool(r[column].strip())) if limit is not None else None
        return streamed_source(src, self.cache_dir(), self.row_maker(src, fmt, share_where(src)), PACK_CHUNK,
                               keep, limit)

    def build_datasets(self) -> Splits:
        d = self.cfg.data
        if self.data_format() == "auto":
            d.format = self._format(d.train_path)  # hparams.json records it: predict needs no data files
        limit = d.max_train_lines if self._format(d.train_path) == "text" else None
        if self.streaming():
            train = self._streamed(d.train_path, "--data.train_path")
        else:
            train = self._split(d.train_path, "--data.train_path", limit)
        val = self._split(d.val_path, "--data.val_path") if d.val_path else None
        return Splits(train=train, val=val)

    def collator(self):
        if self.packed():

            return collate_packed
        return PadCollator(self.tokenizer.pad_token_id, self.cfg.data.pad_to_multiple_of, max_len=self.seq_len())

    def train_lengths(self, train) -> Optional[list[int]]:
        if self.packed() or not self.cfg.data.bucket_by_length:
            return None
        import pyarrow.compute as pc

        # The lengths from Arrow's offsets, without turning the token column into Python lists
        return pc.list_value_length(train.table.data.column("input_ids")).to_pylist()

    def real_tokens(self, batch: Batch) -> int:
        if "tokens" in batch:
            return int(batch["tokens"].sum())
        return super().real_tokens(batch)

    # ---- steps -----------------------------------------------------------------------------
    def _forward(self, model: nn.Module, batch: Batch, labels: bool):
        # use_cache=False: a KV cache is useless in training, and without one transformers reads packed rows'
        # restarting position ids as separate sequences.
        kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
        if "position_ids" in batch:
            if self.document_mask():
                kwargs["position_ids"] = batch["position_ids"]
        else:
            kwargs["attention_mask"] = batch["attention_mask"]
        if labels:
            kwargs["labels"] = batch["labels"]
        return model(**kwargs)

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        out = self._forward(model, batch, labels=True)
        b, t = batch["input_ids"].shape  # (B, T)
        return StepOutput(loss=out.loss, tokens=b * t, samples=b)

    def loss_weight(self, batch: Batch) -> float:
        """Target tokens the causal-LM loss averages over (labels shift by one: position t predicts t+1)."""
        return float((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        logits = self._forward(model, batch, labels=False).logits  # (B, T, V)
        # Position t predicts token t+1, as in HF's causal-LM loss
        shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
        shift_labels = batch["labels"][:, 1:]  # (B, T-1)
        loss_sum = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        tokens = (shift_labels != IGNORE_INDEX).sum()
        return {"loss_sum": float(loss_sum), "tokens": float(tokens)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        tokens = sums.get("tokens", 0.0)
        if tokens <= 0:
            return {"loss": float("nan"), "ppl": float("nan")}
        loss = sums["loss_sum"] / tokens
        return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf")}

    def flops_per_token(self, model: nn.Module) -> float:
        """6 x trainable + 4 x frozen matmul weights + attention's 12 x layers x width x seq_len (see
        :func:`zerotrain.models.hf.transformer_flops_per_token`): LoRA's frozen base skips its weight gradients."""
        return hf.transformer_flops_per_token(model, self.seq_len())

    def transformer_shape(self, model: nn.Module) -> Optional[TransformerShape]:
        """Rows of ``--data.seq_len`` tokens (packed, or the longest padded batch), every position scored over the
        vocabulary; packed rows and padded batches both make transformers build a (seq x seq) mask."""
        return transformer_shape(model, self.seq_len(), self.seq_len(), dense_mask=True)

    # ---- export ----------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """A Hugging Face folder in ``out_dir``: config, weights, tokenizer, generation config. With LoRA, the
        merged model, and the adapter in ``out_dir/adapter``."""
        out_dir = Path(out_dir)
        state_dict = hf.strip_module_prefix(state_dict)
        if self.lora_settings() is None:
            hf.save_hf_folder(model, state_dict, out_dir, self.tokenizer, generation=True)
        else:
            state_dict = dict(state_dict)  # gathered once, whole: peft reads every weight, the merged model needs them
            hf.write_adapter(model, state_dict, out_dir / "adapter", self.tokenizer)
            merged = hf.merged_copy(lambda: self._wrap(self.load_base(pretrained=False)), state_dict)
            hf.save_hf_folder(merged, None, out_dir, self.tokenizer, generation=True)
        logger.info("Hugging Face model written to %s", out_dir)

    def export_hf(self, lazy: dict, out_dir: Path, dtype: torch.dtype) -> list[str]:
        """``zerotrain export --format hf``: a checkpoint written as :meth:`export` writes the finished run."""
        return hf.export_checkpoint(self, lazy, out_dir, dtype)

    def load_exported(self, model: nn.Module, export_dir: Path) -> None:
        """The folder :meth:`export` wrote (a Hugging Face folder, merged with LoRA) into ``model``; a folder of
        plain ``model.safetensors`` (``zerotrain export --format safetensors``) through the default reader."""
        export_dir = Path(export_dir)
        if not hf.is_hf_folder(export_dir):
            return super().load_exported(model, export_dir)
        if self.lora_settings() is None:
            return hf.load_hf_folder_into("causal-lm", model, export_dir)
        # The merged weights are the base's with the adapters folded in: they go into the wrapped layers' base
        # weights (peft's ``.base_layer``), and the adapters are zeroed, so the model computes the merged one.
        plain = self.load_base(pretrained=False)
        hf.load_hf_folder_into("causal-lm", plain, export_dir)
        merged = plain.state_dict()
        with torch.no_grad():
            for name, tensor in model.get_base_model().state_dict().items():
                if "lora_" in name:
                    if "lora_B" in name:
                        tensor.zero_()
                    continue
                tensor.copy_(merged[name.replace(".base_layer", "")])

    # ---- inference -------------------------------------------------------------------------
    def prompt_ids(self, text: str) -> list[int]:
        """The tokens a prompt ``text`` becomes, as training made them: the chat template's user turn and
        generation prompt (chat), the template's head (sft), BOS + text (text)."""

        tok, fmt = self.tokenizer, self._format(self.cfg.data.train_path)
        if fmt == "chat":
            return render_chat(self._chat_tokenizer(), [{"role": "user", "content": text}], True, "the prompt")
        if fmt == "sft":
            head, _ = split_template(self.cfg.data.template)
            text = head.replace("{input}", text)  # str.replace, not str.format, as in training
        start = [tok.bos_token_id] if _adds_bos(tok) or (fmt == "text" and tok.bos_token_id is not None) else []
        return start + list(tok(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: list[str], max_new_tokens: int = 32, **options: Any) -> list[str]:
        """The greedy continuation of each input (prompted as in training, :meth:`prompt_ids`): at most
        ``max_new_tokens`` new tokens, stopping at EOS; newlines and tabs are written as ``\\n`` and ``\\t`` so
        that each input gets one line."""
        tok = self.tokenizer
        device = next(model.parameters()).device
        lines = []
        for text in inputs:
            x = torch.tensor([self.prompt_ids(text)], dtype=torch.long, device=device)  # (1, T)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            new = out[0, x.shape[1]:].tolist()
            if tok.eos_token_id in new:
                new = new[:new.index(tok.eos_token_id)]
            lines.append(tok.decode(new, skip_special_tokens=True).replace("\n", "\\n").replace("\t", "\\t"))
        return lines
