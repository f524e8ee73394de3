"""What a recipe supplies to the one training loop.

The loop (:mod:`zerotrain.train.loop`) owns batching, the engine, measurement and checkpoints. A task
owns only what differs between recipes: how to build the model and the datasets, how a batch
becomes a loss, and which evaluation metrics to report. Plug your own model and data into
zerotrain by subclassing :class:`Task` and calling :func:`zerotrain.fit`.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Optional, Sequence, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain.checkpoint.weights import (
    DEFAULT_MAX_SHARD_SIZE,
    lazy_tensors,
    read_safetensors,
    write_safetensors,
)
from zerotrain.config import RunConfig
from zerotrain.engines.states import full_numel
from zerotrain.errors import UserError

if TYPE_CHECKING:
    from zerotrain.models.shape import TransformerShape

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=RunConfig)
Batch = dict[str, torch.Tensor]


@dataclass
class Splits:
    """The datasets of a run. ``val`` is evaluated during training, ``test`` once at the end."""

    train: Dataset
    val: Optional[Dataset] = None
    test: Optional[Dataset] = None


@dataclass
class StepOutput:
    """What the loop needs from one micro-batch's forward pass."""

    loss: torch.Tensor
    """Scalar loss to back-propagate (mean over the micro-batch)."""
    tokens: int
    """Token positions the model processed (batch x sequence length), for tokens/s and MFU."""
    samples: int
    """Examples in the micro-batch, for samples/s."""
    flops: Optional[float] = None
    """Training FLOPs of this micro-batch, when they depend on its shape (e.g. padded length);
    None: ``Task.flops_per_token`` x ``tokens``."""


class Task(ABC, Generic[C]):
    """A recipe: model, data, loss and metrics. Knows nothing about DeepSpeed or torch.distributed.

    A subclass that sets ``name`` registers itself as a recipe (``zerotrain fit NAME``); any subclass, named
    or not, is reached from the command line as ``zerotrain fit my_package.my_module:MyTask``. The loop
    asks it only through the methods below. What a recipe can do beyond the abstract ones (length
    bucketing, DeepSpeed "auto" hints, predictions) it declares by overriding a method, never by
    the loop looking for attributes of its config.
    """

    name: ClassVar[str] = ""
    """Recipe name: the ``zerotrain fit NAME`` argument and the prefix of run directory names."""
    config_class: ClassVar[type[RunConfig]] = RunConfig
    """The typed config this recipe's flags are generated from."""
    description: ClassVar[str] = ""
    """One line for ``zerotrain fit --help``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            REGISTRY[cls.name] = cls

    def __init__(self, cfg: C):
        self.cfg = cfg

    def with_config(self, cfg: C) -> "Task[C]":
        """A shallow copy of this task that reads ``cfg`` (the loop's resolved copy); self is unchanged."""
        clone = copy.copy(self)
        clone.cfg = cfg
        return clone

    @abstractmethod
    def build_model(self, pretrained: bool = True) -> nn.Module:
        """Return the model, on CPU, in fp32 (the engine moves and casts it).

        ``pretrained=False`` builds the same architecture without reading any weights file: what
        ``zerotrain estimate`` sizes on the meta device and what a finished run's weights load into.
        """

    def builds_partitioned(self) -> bool:
        """Whether :meth:`build_model`, under DeepSpeed ZeRO-3, builds the model partitioned over the ranks
        (:func:`zerotrain.engines.build.model_construction`), so that no process holds it whole on its host.
        The memory model leaves the whole model out of such a run's host peak. Default: False."""
        return False

    @abstractmethod
    def build_datasets(self) -> Splits:
        """Return the datasets. Items are whatever :meth:`collator` accepts.

        The training loader's workers start, and read their first batches, right after this and before
        :meth:`build_model` (a worker forked later would share the engine's memory): the datasets and the
        collator must be complete without the model."""

    @abstractmethod
    def collator(self) -> Callable[[list[Any]], Batch]:
        """A picklable callable turning a list of dataset items into a batch of CPU tensors.

        It runs in DataLoader worker processes, so it should carry only what it needs (a pad id,
        a length cap), not the task with its tokenizer and model.
        """

    @abstractmethod
    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Forward one micro-batch (already on the device) and return its loss.

        Randomness here (dropout) must come from torch's global generators, which the checkpoint
        saves and restores, so that a resumed run repeats the uninterrupted one exactly. Randomness
        that can be drawn in the data pipeline (MLM's masks) is better drawn there: it costs the
        step no wait for the device, and seeded by epoch and index it is the same on any rank count.
        """

    @abstractmethod
    def eval_step(self, model: nn.Module, batch: Batch) -> dict[str, float]:
        """Forward one batch without gradients and return *sums* (e.g. loss_sum, correct, count)."""

    @abstractmethod
    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Turn the summed eval_step outputs (over all batches and ranks) into metrics."""

    def loss_weight(self, batch: Batch) -> Optional[float]:
        """How much this micro-batch's mean loss counts, e.g. its number of target tokens.

        None (the default): every micro-batch counts the same. With a weight, the engine scales
        the losses so that a step's gradient is that of all its micro-batches on all ranks taken as
        one batch: each target token counts once, whatever batch it fell in.
        """
        return None

    def real_tokens(self, batch: Batch) -> int:
        """Non-padding tokens of a collated CPU batch, for tokens/s (counted before the batch moves to
        the device, so it costs no synchronisation). Default: the ``attention_mask`` sum, else one
        token per example."""
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else len(next(iter(batch.values())))

    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per token for MFU, from the unsharded ``model`` before any engine exists.

        Default: 6 x all parameters (2 forward + 4 backward per weight, nanoGPT's estimate without
        the attention term). Recipes with a better formula override it and say which.
        """
        return 6.0 * sum(full_numel(p) for p in model.parameters())

    def train_lengths(self, train: Dataset) -> Optional[Sequence[int]]:
        """Length in tokens of every training item, to batch similar lengths together; None (the
        default) keeps plain shuffled batches. Recipes with variable-length items return lengths
        when their config asks for length bucketing."""
        return None

    def transformer_shape(self, model: nn.Module) -> Optional["TransformerShape"]:
        """The dimensions and row length that size ``model``'s activations without running it
        (:mod:`zerotrain.plan.activations`: ``zerotrain estimate``, and the planner where the probe cannot
        measure), from ``model`` as built, on the meta device too. None (the default): they are only measured."""
        return None

    def deepspeed_hints(self, model: nn.Module) -> dict[str, Any]:
        """Facts about the model that fill a user DeepSpeed JSON's "auto" values (DeepSpeed's
        ``hidden_size``-derived bucket sizes). Default: ``hidden_size`` from a Hugging Face style
        ``model.config`` when the model has one."""
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        return {"hidden_size": hidden} if hidden else {}

    def export(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], out_dir: Path) -> None:
        """Write the trained model to ``out_dir`` (called once, on the main process, after the last step).

        ``model`` is the unwrapped module (under ZeRO-3 its parameters are partitioned: use
        ``state_dict``, the full consolidated weights). ``state_dict`` holds the live tensors, on their
        device (the model's own parameters): copy one before changing it. Under ZeRO-3 and FSDP2 it is a read-only
        :class:`~zerotrain.checkpoint.weights.GatheredStateDict` whose every read gathers that tensor to the host:
        pass it to :func:`~zerotrain.checkpoint.weights.lazy_tensors` to write it a shard at a time, or make a
        ``dict`` of it once (the whole model on the host). The default writes ``model.safetensors``; recipes
        override it to write Hugging Face or peft layouts.

        Past 5 GB (less when the host has little memory free: a quarter of what is free) the weights go to
        Hugging Face's shards (``model-0000i-of-0000n.safetensors`` and the index), copied to the host one shard
        at a time with a log line each: a big model's export holds one shard in host memory, not the model, and
        says how far it has got.
        """
        write_safetensors(lazy_tensors(state_dict), out_dir, dtype=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE,
                          progress=lambda line: logger.info("export: %s", line))

    def load_exported(self, model: nn.Module, export_dir: Path) -> None:
        """Load into ``model`` (built with ``build_model(pretrained=False)``) what :meth:`export` wrote
        to ``export_dir``: the inverse of :meth:`export`, used by :func:`zerotrain.runtime.rundir.load_run`.

        The default reads ``model.safetensors`` or its shards (a ``module.`` prefix, as a wrapped model's keys
        carry, is dropped) and requires every tensor to match. Raises
        :class:`~zerotrain.errors.UserError` naming the file when it is missing or does not fit.
        """
        from safetensors import SafetensorError

        weights = Path(export_dir) / "model.safetensors"
        try:
            state = read_safetensors(Path(export_dir))
        except FileNotFoundError as exc:
            raise UserError(f"{exc.filename or weights} is missing: the run did not finish exporting its model. "
                            "Let it finish (or resume it) and try again") from None
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise UserError(f"{weights} (or a shard of it) cannot be read ({exc}): the file is damaged or still "
                            "being written") from None
        state = {k.removeprefix("module."): v for k, v in state.items()}
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            detail = " ".join(str(exc).split())
            raise UserError(f"{weights} does not fit the model the run's hparams.json describes "
                            f"({detail[:300]}). Was the folder's model/ copied from another run?") from None

    def run_tokenizer(self) -> Any:
        """The tokenizer this task's token ids come from, or None (the default) when it has none.

        A run folder keeps a copy of it (``<run>/tokenizer``, written with ``save_pretrained``), so that
        :func:`zerotrain.runtime.rundir.load_run`, ``zerotrain predict`` and ``zerotrain export`` read the run from any
        working directory and on another machine, whatever path the run was started with.
        """
        return None

    def predict(self, model: nn.Module, inputs: list[str], **options: Any) -> list[str]:
        """One output line per input text, from the trained ``model`` (in eval mode, on its device):
        what ``zerotrain predict RUN_DIR TEXT...`` prints.

        ``options`` are the command's settings (``top_k``, ``max_new_tokens``); a recipe reads the
        ones it uses and ignores the others. The default has nothing to predict and says so.
        """
        raise UserError(f"recipe {self.name or type(self).__name__} has no prediction to make "
                        "(zerotrain predict knows the imdb, mlm, lora, causal-lm and classify recipes)")


REGISTRY: dict[str, type[Task]] = {}
"""Recipe name -> task class, filled as task modules are imported (see :mod:`zerotrain.tasks.registry`)."""
