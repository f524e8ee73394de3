"""The IMDB sentiment recipe: the DeepSpeed tutorial's classifier, fixed and made reproducible.

Differences from the tutorial, each for a reason:

* the review vector averages real tokens only, and attention ignores padding (the tutorial's
  scores depended on how much padding a review's batch had);
* reviews are truncated to ``max_len`` (the tutorial crashed on long reviews) and tokenised once,
  with an on-disk cache;
* batches are padded to their longest review, not to ``max_len``;
* the test split is still cut into two seeded halves (validation, test), as in the tutorial, so
  results stay comparable with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain.checkpoint.weights import read_safetensors
from zerotrain.config import RunConfig
from zerotrain.data.collate import PadCollator
from zerotrain.data.imdb import (
    LABEL_NAMES,
    ReviewDataset,
    balanced_subset,
    clean_text,
    load_split,
    split_test_in_halves,
    tokenize_reviews,
)
from zerotrain.data.tokenizer import load_tokenizer, with_pad_token
from zerotrain.errors import ConfigError, DataError, UserError
from zerotrain.models.sentiment import SentimentClassifier
from zerotrain.runtime.rundir import load_run
from zerotrain.tasks.base import Batch, Splits, StepOutput, Task

log = logging.getLogger(__name__)


@dataclass
class SentimentModelConfig:
    resume_safe = frozenset({"init_from_mlm"})  # read at the first start only: a resume loads its weights

    embed_dim: int = 256
    """Model width (token embedding and every encoder layer). Must be divisible by num_heads."""
    hidden_dim: int = 1024
    """Width of each encoder layer's feed-forward block and of the classification head."""
    num_heads: int = 8
    """Attention heads per encoder layer."""
    num_layers: int = 6
    """Transformer encoder layers."""
    max_len: int = 1024
    """Longest review in tokens, <s> and </s> included; longer reviews are truncated."""
    dropout: float = 0.2
    """Dropout after the embeddings, inside each layer and in the head."""
    init_from_mlm: Optional[str] = None
    """Start from an MLM run: its model/model.safetensors or the run folder. Every tensor whose name and
    shape both match one of the classifier (in practice the token embedding and any encoder layers built
    the same way) is copied; the rest keeps its random initialisation. None: train from scratch."""

    def validate(self) -> None:
        for name in ("embed_dim", "hidden_dim", "num_heads", "num_layers", "max_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--model.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                "--model.embed_dim",
                f"({self.embed_dim}) must be divisible by --model.num_heads ({self.num_heads})",
            )
        if self.embed_dim % 2:
            raise ConfigError("--model.embed_dim", f"must be even (sine/cosine positions), got {self.embed_dim}")
        if self.max_len < 3:
            raise ConfigError("--model.max_len", f"must be >= 3 (<s>, one token, </s>), got {self.max_len}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--model.dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass
class SentimentDataConfig:
    resume_safe = frozenset({"cache_dir"})  # where the tokenised reviews are kept, not what they hold

    path: str = "stanfordnlp/imdb"
    """Hub dataset name, or a local folder (train/test as .jsonl.gz, .jsonl, .csv, .parquet, or an aclImdb tree) or file."""
    tokenizer: str = "roberta-base"
    """Hub tokenizer name, or a local folder with tokenizer.json (offline: the repository's examples/data/roberta-tokenizer)."""
    max_train_samples: Optional[int] = None
    """Train on a class-balanced subset of this many reviews, drawn with --trainer.seed (None: all 25,000)."""
    max_eval_samples: Optional[int] = None
    """Cap the validation and the test half each at this many class-balanced reviews (None: 12,500 each)."""
    cache_dir: Optional[str] = "~/.cache/zerotrain"
    """Folder for cached token ids (keyed by texts, tokenizer and max_len); None disables the cache."""
    bucket_by_length: bool = False
    """Group reviews of similar length into the same batches to cut padding (batches stay shuffled)."""
    pad_to_multiple_of: int = 8
    """Pad each batch to a multiple of this many tokens. Each padded length a run meets pays for kernel selection
    the first time; a small model waits on the host, not on the padding, so 64 (16 lengths up to 1,024) can
    beat 8."""

    def validate(self) -> None:
        if self.pad_to_multiple_of < 1:
            raise ConfigError("--data.pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")
        if not self.path:
            raise ConfigError("--data.path", "must name a hub dataset or a local folder/file")
        if not self.tokenizer:
            raise ConfigError("--data.tokenizer", "must name a hub tokenizer or a local folder")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise ConfigError(f"--data.{name}", f"must be >= 2 (one review per class) or None, got {value}")


@dataclass
class IMDBConfig(RunConfig):
    """The IMDB sentiment recipe's config: the shared sections plus model and data."""

    model: SentimentModelConfig = field(default_factory=SentimentModelConfig)
    """The transformer classifier."""
    data: SentimentDataConfig = field(default_factory=SentimentDataConfig)
    """Reviews and tokenizer."""


def _read_weights(path: str, flag: str) -> dict[str, torch.Tensor]:
    """A run folder's exported weights (``model/``, one file or Hugging Face's shards), that folder itself, or one
    ``.safetensors`` file."""
    from safetensors.torch import load_file


    p = Path(path).expanduser()
    if p.is_dir():
        for folder in (p / "model", p):
            if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
                try:
                    return read_safetensors(folder)
                except FileNotFoundError as exc:
                    raise UserError(f"{flag}: {exc.filename} is missing (a shard the index names). "
                                    "Pass a run folder whose export finished") from None
        raise UserError(f"{flag}: no model/model.safetensors in {p}. Pass a finished run folder or the .safetensors file")
    if not p.is_file():
        raise UserError(f"{flag}: {p} does not exist. Pass a finished run folder or its model/model.safetensors")
    return load_file(str(p))


# zerotrain's RoBERTa MLM layer -> torch's nn.TransformerEncoderLayer: both are post-LN with a packed
# [q; k; v] input projection, so the tensors carry over one to one.
_MLM_TO_CLASSIFIER = [
    ("encoder.token_embedding.", "token_embedding."),
    (".attn.qkv.weight", ".self_attn.in_proj_weight"), (".attn.qkv.bias", ".self_attn.in_proj_bias"),
    (".attn.out.", ".self_attn.out_proj."), (".ff_in.", ".linear1."), (".ff_out.", ".linear2."),
    (".ln_attn.", ".norm1."), (".ln_ff.", ".norm2."),
]


def _classifier_name(mlm_name: str) -> str:
    for old, new in _MLM_TO_CLASSIFIER:
        mlm_name = mlm_name.replace(old, new)
    return mlm_name


def init_from_mlm(model: nn.Module, path: str) -> int:
    """Copy from the MLM weights at ``path`` the token embedding and the encoder layers.

    Names are translated from the ``mlm`` recipe's model (see ``_MLM_TO_CLASSIFIER``); a tensor is
    copied when its translated name and its shape match (the same tokenizer, width, FFN size and at
    most as many layers). The MLM's learned positions, embedding LayerNorm and head are not used.
    The classifier then uses GELU, as the MLM layers were trained with it.

    Returns how many tensors were copied; raises :class:`UserError` naming --model.init_from_mlm
    when none match (a copy of nothing is almost certainly a mistake, not a choice).
    """
    source = _read_weights(path, "--model.init_from_mlm")
    target = model.state_dict()
    renamed = {_classifier_name(k): v for k, v in source.items()}
    copied = {k: v for k, v in renamed.items() if k in target and target[k].shape == v.shape}
    if not copied:
        raise UserError(
            f"--model.init_from_mlm: none of the {len(source)} tensors in {path} matches a classifier tensor "
            f"by name and shape (classifier names: {', '.join(list(target)[:4])}, ...). "
            "Check that the MLM run used the same tokenizer and embed_dim"
        )
    with torch.no_grad():
        for k, v in copied.items():
            target[k].copy_(v)
    return len(copied)


class IMDBTask(Task[IMDBConfig]):
    """Binary sentiment classification of IMDB reviews with :class:`SentimentClassifier`."""

    name = "imdb"
    config_class = IMDBConfig
    description = "IMDB sentiment classifier (transformer encoder, RoBERTa tokenizer)"

    @cached_property
    def tokenizer(self):
        return with_pad_token(load_tokenizer(self.cfg.data.tokenizer), self.cfg.data.tokenizer, "--data.tokenizer")

    def run_tokenizer(self):
        return self.tokenizer

    def build_model(self, pretrained: bool = True) -> nn.Module:
        """The classifier; with ``--model.init_from_mlm``, GELU layers filled from the MLM run
        (``pretrained=False`` builds the same architecture without reading the MLM weights)."""
        m = self.cfg.model
        model = SentimentClassifier(
            vocab_size=len(self.tokenizer),
            embed_dim=m.embed_dim,
            hidden_dim=m.hidden_dim,
            num_heads=m.num_heads,
            num_layers=m.num_layers,
            max_len=m.max_len,
            dropout=m.dropout,
            pad_token_id=self.tokenizer.pad_token_id,
            activation_checkpointing=self.cfg.activation_checkpointing.enabled,
            activation="gelu" if m.init_from_mlm else "relu",
        )
        if m.init_from_mlm and pretrained:
            n = init_from_mlm(model, m.init_from_mlm)
            log.info("copied %d tensors from the MLM model %s", n, m.init_from_mlm)
        # Batches are padded to their own longest review: FLOPs per token are a + b*T. Both
        # coefficients come from the whole model now, before an engine may shard its parameters.
        a = model.flops_per_token(0)
        self._flops_ab = (a, model.flops_per_token(1) - a)
        return model

    def _tokenize(self, texts: list[str]) -> list:
        return tokenize_reviews(texts, self.tokenizer, self.cfg.model.max_len, cache_dir=self.cfg.data.cache_dir)

    def build_datasets(self) -> Splits:
        d, seed = self.cfg.data, self.cfg.trainer.seed
        train_texts, train_labels = load_split(d.path, "train")
        if len(set(train_labels)) < 2:
            # A classifier trained on one class learns the constant answer and reports high accuracy.
            only = LABEL_NAMES[train_labels[0]] if train_labels else "no"
            raise DataError(f"--data.path {d.path}: the training split has only {only} reviews "
                            f"({len(train_labels)} in all). It needs both labels, 0 (negative) and 1 (positive)")
        keep = balanced_subset(train_labels, d.max_train_samples, seed)
        train_texts = [train_texts[i] for i in keep]
        train_labels = [train_labels[i] for i in keep]

        test_texts, test_labels = load_split(d.path, "test")
        halves = []
        for offset, idx in enumerate(split_test_in_halves(len(test_texts), seed)):
            labels = [test_labels[i] for i in idx]
            sub = [idx[j] for j in balanced_subset(labels, d.max_eval_samples, seed + 1 + offset)]
            halves.append(ReviewDataset(self._tokenize([test_texts[i] for i in sub]), [test_labels[i] for i in sub]))
        return Splits(train=ReviewDataset(self._tokenize(train_texts), train_labels), val=halves[0], test=halves[1])

    def collator(self):
        return PadCollator(self.tokenizer.pad_token_id, self.cfg.data.pad_to_multiple_of, max_len=self.cfg.model.max_len)

    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        out = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        B, T = batch["input_ids"].shape
        a, b = self._flops_ab  # set by build_model
        return StepOutput(loss=out["loss"], tokens=B * T, samples=B, flops=B * T * (a + b * T))

    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        with torch.no_grad():
            logits = model(batch["input_ids"], batch["attention_mask"])["logits"].float()  # (B, 2)
            labels = batch["labels"]
            loss_sum = nn.functional.cross_entropy(logits, labels, reduction="sum")
            correct = (logits.argmax(dim=-1) == labels).sum()
        return {"loss_sum": float(loss_sum), "correct": float(correct), "count": float(labels.numel())}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        # "reviews" states the subset the accuracy is measured on (e.g. test_reviews=1000 on CPU).
        return {"loss": sums.get("loss_sum", 0.0) / count, "acc": sums.get("correct", 0.0) / count,
                "reviews": int(sums.get("count", 0.0))}

    def train_lengths(self, train: Dataset) -> Optional[list[int]]:
        if not self.cfg.data.bucket_by_length:
            return None
        return [len(ids) for ids in train.token_ids]

    def flops_per_token(self, model: nn.Module) -> float:
        # Only a fallback: training_step reports each batch's FLOPs at its padded length.
        return model.flops_per_token(self.cfg.model.max_len)

    def classify(self, model: nn.Module, texts: list[str], batch_size: int = 32) -> list[tuple[str, float]]:
        """``(label, probability of that label)`` per text, label "negative" or "positive".

        Texts are cleaned and truncated to ``max_len`` as training reviews were; ``model`` is in
        eval mode on its device.
        """
        device = next(model.parameters()).device
        ids = tokenize_reviews([clean_text(t) for t in texts], self.tokenizer, self.cfg.model.max_len)
        collate = self.collator()
        results: list[tuple[str, float]] = []
        with torch.no_grad():
            for start in range(0, len(ids), batch_size):
                batch = collate([(x, 0) for x in ids[start:start + batch_size]])
                logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))["logits"]  # (B, 2)
                probs = logits.float().softmax(dim=-1).cpu()  # (B, 2)
                for p in probs:
                    k = int(p.argmax())
                    results.append((LABEL_NAMES[k], float(p[k])))
        return results

    def predict(self, model: nn.Module, inputs: list[str], **options) -> list[str]:
        """``label<TAB>probability`` per review (see :meth:`classify`)."""
        return [f"{label}\t{prob:.3f}" for label, prob in self.classify(model, inputs)]


def predict(
    run_dir: str | Path,
    texts: list[str],
    device: str = "cpu",
    tokenizer: Optional[str] = None,
) -> list[tuple[str, float]]:
    """Classify ``texts`` with the model a finished imdb run exported.

    A thin wrapper over :func:`zerotrain.runtime.rundir.load_run` (which reads ``<run_dir>/hparams.json``
    and ``<run_dir>/model``) and :meth:`IMDBTask.classify`; ``tokenizer`` (a folder or hub name)
    replaces the run's when its path no longer resolves. Returns ``(label, probability of that
    label)`` per text, label "negative" or "positive".
    """

    run = load_run(run_dir, {"data.tokenizer": tokenizer} if tokenizer is not None else None, device=device)
    if not isinstance(run.task, IMDBTask):
        raise UserError(f"{run.run_dir} is a run of the {run.recipe} recipe, not imdb: "
                        "use zerotrain.runtime.rundir.load_run and its task's predict")
    return run.task.classify(run.model, texts)
