"""Fine-tuning any Hugging Face sequence classifier (``AutoModelForSequenceClassification``) on text + label
records: a pretrained BERT/RoBERTa/DistilBERT on IMDB, or a random one from a config.

Design decisions:

* The classes come from the training file (integer ids, or names in sorted order) or ``--data.label_names``;
  the mapping is set on the model's config (``id2label``, ``label2id``, ``num_labels``) before the model is
  built, so a pretrained encoder gets a fresh head of the right size, and the exported folder carries it.
* Records come through :mod:`zerotrain.data.source` (a file, glob, folder or saved dataset of JSON lines, JSON,
  CSV/TSV or Parquet). Texts are tokenised once (with the tokenizer's special tokens), truncated to
  ``--data.max_length``, by ``Dataset.map`` into ``--data.cache_dir`` under a fingerprint of the files, the
  tokenizer, the fields, the classes and the length, so a later run (or another rank) reads the tokens back.
  Batches are padded per batch; ``--data.bucket_by_length`` groups similar lengths.
* ``--data.streaming true`` reads the training records as they are trained on (:mod:`zerotrain.data.streaming`):
  each record is checked and tokenised as its chunk is read, and the classes must be listed
  (``--data.label_names``), since they cannot be counted before the stream is read.
* FLOPs per token are reported per batch at its padded length (weights + attention, see
  :func:`zerotrain.models.hf.transformer_flops_per_token`).
* Export writes a Hugging Face folder (config with the label mapping, weights, tokenizer) that
  ``AutoModelForSequenceClassification.from_pretrained`` loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.config import RunConfig
from zerotrain.data.collate import PadCollator
from zerotrain.data import source
from zerotrain.data.labelled import checked_labels, label_ids, label_names, labelled_rows, no_labels_in_text
from zerotrain.data.streaming import StreamedRows, first_columns, share_where, streamed_source
from zerotrain.data.tokenizer import load_tokenizer, with_pad_token
from zerotrain.errors import ConfigError, DataError
from zerotrain.models import hf
from zerotrain.models.shape import TransformerShape, transformer_shape
from zerotrain.tasks.base import Batch, Splits, StepOutput, Task

logger = logging.getLogger(__name__)

STREAM_CHUNK = 1000
"""Records read and tokenised at a time from a streamed training split."""


@dataclass
class ClassifyModelConfig(hf.ModelSection):
    """``--model``: a Hugging Face sequence classifier (e.g. FacebookAI/roberta-base; the head is new)."""


@dataclass
class ClassifyDataConfig:
    train_path: str = ""
    """Training records with a text and a label field: a file, a glob, a folder of data files or a saved dataset
    (save_to_disk). Files: .jsonl/.json, .csv/.tsv (with a header), .parquet, optionally .gz/.xz/.bz2 (IMDB's
    train.jsonl.gz)."""
    val_path: Optional[str] = None
    """Validation records in the same forms (None: no evaluation); never streamed."""
    streaming: bool = False
    """Read the training records as they are trained on, for data larger than host memory: each process reads its
    own share in file order (no shuffling), --trainer.max_steps sets the length, --data.label_names lists the
    classes, and a resume continues at the exact record (on the same number of processes)."""
    text_field: str = "text"
    """Record field holding the text."""
    label_field: str = "label"
    """Record field holding the label: a class name or an integer id."""
    label_names: Optional[list[str]] = None
    """The class names in id order (default: the training file's names sorted, or "0".."N-1" for integer labels)."""
    max_length: int = 512
    """Tokens per text, special tokens included; longer texts are truncated."""
    max_train_samples: Optional[int] = None
    """Read only the first N training records (None: all)."""
    max_eval_samples: Optional[int] = None
    """Read only the first N validation records (None: all)."""
    bucket_by_length: bool = False
    """Group texts of similar length into the same batches to cut padding (batches stay shuffled)."""
    pad_to_multiple_of: int = 8
    """Pad each batch to a multiple of this many tokens."""
    cache_dir: Optional[str] = "~/.cache/zerotrain"
    """Folder for tokenized rows (and datasets' Arrow copies of the files, in datasets/), reused by every run and
    process while the files (size, time), tokenizer and settings are unchanged (None: no cache). Shared by all
    runs rather than kept in a run's folder, so a second run on the same data starts at once."""

    def validate(self) -> None:
        if not self.train_path:
            raise ConfigError("--data.train_path", "is required: .jsonl, .csv, .parquet (or a folder, a glob, a saved "
                                                   "dataset) of text/label records")
        if self.max_length < 2:
            raise ConfigError("--data.max_length", f"must be >= 2, got {self.max_length}")
        if self.pad_to_multiple_of < 1:
            raise ConfigError("--data.pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")
        if self.streaming and not self.label_names:
            raise ConfigError("--data.label_names", "is required with --data.streaming true: the classes cannot be "
                                                    "counted before the stream is read; list them in id order, e.g. "
                                                    "[neg, pos]")
        if self.streaming and self.bucket_by_length:
            raise ConfigError("--data.bucket_by_length", "needs every length in advance: drop it with "
                                                         "--data.streaming true")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--data.{name}", f"must be >= 1 (or unset), got {value}")


@dataclass
class ClassifyConfig(RunConfig):
    """Sequence classification: the shared sections plus ``model`` and ``data``."""

    model: ClassifyModelConfig = field(default_factory=ClassifyModelConfig)
    """The classifier and its tokenizer."""
    data: ClassifyDataConfig = field(default_factory=ClassifyDataConfig)
    """Text + label records."""


class ClassifyTask(Task[ClassifyConfig]):
    """Any ``AutoModelForSequenceClassification`` on text + label records."""

    name = "classify"
    config_class = ClassifyConfig
    description = "any Hugging Face sequence classifier (BERT, RoBERTa...) on text + label records"

    def __init__(self, cfg: ClassifyConfig):
        super().__init__(cfg)
        self._tokenizer = None
        self._names: Optional[list[str]] = None
        self._sources: dict[str, source.Source] = {}
        self._loaded: dict[str, Any] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            m = self.cfg.model
            name = m.tokenizer or m.name_or_path  # GPT-style tokenizers: padding is masked, EOS serves
            self._tokenizer = with_pad_token(load_tokenizer(name, flag="--model.tokenizer"), name, "--model.tokenizer")
        return self._tokenizer

    def run_tokenizer(self):
        return self.tokenizer

    def _source(self, path: str, flag: str) -> source.Source:
        if path not in self._sources:
            src = source.resolve(path, flag)
            if src.builder == "text":
                raise no_labels_in_text(src)
            self._sources[path] = src
        return self._sources[path]

    def _records(self, path: str, flag: str, limit: Optional[int]):
        """(the split's first ``limit`` rows, their checked labels), read once per path."""
        if path not in self._loaded:
            d = self.cfg.data
            src = self._source(path, flag)
            cache = source.check_cache_dir(d.cache_dir)
            rows = src.load(None if cache is None else str(cache))
            if limit is not None:
                rows = rows.select(range(min(limit, len(rows))))
            self._loaded[path] = rows, checked_labels(src, rows, d.text_field, d.label_field)
        return self._loaded[path]

    def label_names(self) -> list[str]:
        """The class names in id order: ``--data.label_names``, else the training file's labels.

        Names found in the file are written back to ``--data.label_names``, so the run's hparams.json records the
        classes and ``load_run``/``predict``/``export`` rebuild the head without the training file."""
        if self._names is None:

            d = self.cfg.data
            given = d.label_names
            labels = [] if given else self._records(d.train_path, "--data.train_path", d.max_train_samples)[1]
            self._names = label_names(labels, given)
            if len(self._names) < 2:
                raise DataError(f"--data.train_path {d.train_path}: only the class {self._names} is present; a "
                                "classifier needs at least two (or list them with --data.label_names)")
            d.label_names = list(self._names)
        return self._names

    def builds_partitioned(self) -> bool:
        return hf.builds_partitioned(self.cfg.model.source())

    def build_model(self, pretrained: bool = True) -> nn.Module:
        names = self.label_names()
        m = self.cfg.model
        overrides = {"num_labels": len(names), "id2label": dict(enumerate(names)),
                     "label2id": {name: i for i, name in enumerate(names)}}
        if self.tokenizer.pad_token_id is not None:
            overrides["pad_token_id"] = self.tokenizer.pad_token_id  # decoders find the last token by it
        model = hf.load_model("classify", m.source(),
                              hf.resolve_dtype(m.dtype, self.cfg.precision.dtype), pretrained,
                              min_vocab=len(self.tokenizer), config_overrides=overrides)
        if self.cfg.activation_checkpointing.enabled:
            hf.enable_activation_checkpointing(model)
        # Batches are padded to their own longest text: FLOPs per token are a + b*T, both from the whole model now.
        a = hf.transformer_flops_per_token(model, 0)
        self._flops_ab = (a, hf.transformer_flops_per_token(model, 1) - a)
        logger.info("classes: %s", ", ".join(f"{i}={n}" for i, n in enumerate(names)))
        return model

    def _split(self, path: str, flag: str, limit: Optional[int]) -> source.Rows:
        """A split as ``{input_ids, labels}`` rows: tokenized by ``Dataset.map`` into the cache, or read back from it
        when the files, tokenizer, fields, classes and length are unchanged."""
        d, names = self.cfg.data, self.label_names()
        src = self._source(path, flag)
        cache = source.check_cache_dir(d.cache_dir)
        key = source.cache_key(src.identity(), self.tokenizer, d.text_field, d.label_field, names, d.max_length, limit)
        rows = source.cached_dataset(cache, "classify", key)
        if rows is None:
            records, labels = self._records(path, flag, limit)
            ids = label_ids(labels, names, path)
            tok, text_field, max_length = self.tokenizer, d.text_field, d.max_length

            def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
                tokens = tok(batch[text_field], truncation=True, max_length=max_length,
                             return_attention_mask=False)["input_ids"]
                return {"input_ids": tokens, "labels": [ids[i] for i in indices]}

            rows = source.cached_map(records.select_columns([text_field]), tokenize, key, cache, "classify",
                                     with_indices=True)
        return source.Rows(rows)

    def streaming(self) -> bool:
        """Whether the training split is read as it is trained on (--data.streaming)."""
        return self.cfg.data.streaming

    def _streamed(self, path: str, flag: str) -> StreamedRows:
        """The training records as a stream: checked, labelled and tokenised a chunk at a time."""
        d = self.cfg.data
        src = self._source(path, flag)
        if src.saved:
            src.load(streaming=True)  # refuses, in one line
        src.require_columns(first_columns(src, d.cache_dir),
                            {d.text_field: "--data.text_field", d.label_field: "--data.label_field"})
        make = labelled_rows(self.tokenizer, d.text_field, d.label_field, self.label_names(), d.max_length,
                             share_where(src))
        return streamed_source(src, d.cache_dir, make, STREAM_CHUNK, limit=d.max_train_samples)

    def build_datasets(self) -> Splits:
        d = self.cfg.data
        if self.streaming():
            train = self._streamed(d.train_path, "--data.train_path")
        else:
            train = self._split(d.train_path, "--data.train_path", d.max_train_samples)
        val = self._split(d.val_path, "--data.val_path", d.max_eval_samples) if d.val_path else None
        return Splits(train=train, val=val)

    def collator(self):
        return PadCollator(self.tokenizer.pad_token_id, self.cfg.data.pad_to_multiple_of,
                           max_len=self.cfg.data.max_length)

    def train_lengths(self, train) -> Optional[list[int]]:
        if not self.cfg.data.bucket_by_length:
            return None
        import pyarrow.compute as pc

        return pc.list_value_length(train.table.data.column("input_ids")).to_pylist()

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        B, T = batch["input_ids"].shape
        a, b = getattr(self, "_flops_ab", (None, None))
        return StepOutput(loss=out.loss, tokens=B * T, samples=B, flops=None if a is None else B * T * (a + b * T))

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()  # (B, C)
        labels = batch["labels"]
        return {"loss_sum": float(F.cross_entropy(logits, labels, reduction="sum")),
                "correct": float((logits.argmax(dim=-1) == labels).sum()), "count": float(labels.numel())}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        return {"loss": sums.get("loss_sum", 0.0) / count, "acc": sums.get("correct", 0.0) / count}

    def flops_per_token(self, model: nn.Module) -> float:
        # Only a fallback: training_step reports each batch's FLOPs at its padded length.
        return hf.transformer_flops_per_token(model, self.cfg.data.max_length)

    def transformer_shape(self, model: nn.Module) -> Optional[TransformerShape]:
        """Batches padded up to ``--data.max_length`` at most (with their mask); a few logits per row, no vocabulary."""
        return transformer_shape(model, self.cfg.data.max_length, 0, dense_mask=True)

    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """A Hugging Face folder: config (with ``id2label``/``label2id``), weights, tokenizer."""
        hf.save_hf_folder(model, state_dict, Path(out_dir), self.tokenizer)
        logger.info("Hugging Face classifier written to %s", out_dir)

    def export_hf(self, lazy: dict, out_dir: Path, dtype: torch.dtype) -> list[str]:
        """``zerotrain export --format hf``: a checkpoint written as :meth:`export` writes the finished run."""
        return hf.export_checkpoint(self, lazy, out_dir, dtype)

    def load_exported(self, model: nn.Module, export_dir: Path) -> None:
        if not hf.is_hf_folder(Path(export_dir)):
            return super().load_exported(model, export_dir)
        hf.load_hf_folder_into("classify", model, Path(export_dir))

    @torch.no_grad()
    def predict(self, model: nn.Module, inputs: list[str], batch_size: int = 32, **options: Any) -> list[str]:
        """``label<TAB>probability`` per text, the label a name of ``id2label``."""
        names = self.label_names()
        device = next(model.parameters()).device
        collate = self.collator()
        lines = []
        for start in range(0, len(inputs), batch_size):
            ids = self.tokenizer(inputs[start:start + batch_size], truncation=True,
                                 max_length=self.cfg.data.max_length, return_attention_mask=False)["input_ids"]
            batch = collate([{"input_ids": x} for x in ids])
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits  # (B, C)
            for p in logits.float().softmax(dim=-1).cpu():
                k = int(p.argmax())
                lines.append(f"{names[k]}\t{float(p[k]):.3f}")
        return lines
