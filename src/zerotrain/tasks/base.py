"""What a recipe supplies to the one training loop.

The loop (:mod:`zerotrain.loop`) owns batching, the engine, measurement and checkpoints. A task
owns only what differs between recipes: how to build the model and the datasets, how a batch
becomes a loss, and which evaluation metrics to report. Plug your own model and data into
zerotrain by subclassing :class:`Task` and calling :func:`zerotrain.fit`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Optional, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain.config import RunConfig
from zerotrain.metrics import numel

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
    """A recipe: model, data, loss and metrics. Knows nothing about DeepSpeed or torch.distributed."""

    name: str = "task"
    """Short name, used as the prefix of run directory names."""

    def __init__(self, cfg: C):
        self.cfg = cfg

    @abstractmethod
    def build_model(self) -> nn.Module:
        """Return the model, on CPU, in fp32 (the engine moves and casts it)."""

    @abstractmethod
    def build_datasets(self) -> Splits:
        """Return the datasets. Items are whatever :meth:`collate` accepts."""

    @abstractmethod
    def collate(self, examples: list[Any]) -> Batch:
        """Turn a list of dataset items into a batch of CPU tensors (runs in DataLoader workers)."""

    @abstractmethod
    def training_step(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Forward one micro-batch (already on the device) and return its loss.

        Randomness here (masking, dropout) must come from torch's global generators, which the
        checkpoint saves and restores, so that a resumed run repeats the uninterrupted one exactly.
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

    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per token for MFU. Default: 6 x trainable-and-frozen parameters (forward + backward)."""
        return 6.0 * sum(numel(p) for p in model.parameters())

    def example_length(self, example: Any) -> int:
        """Length of one dataset item in tokens, for length-bucketed batches. Override to enable them."""
        raise NotImplementedError

    def export(self, model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write the trained model to ``out_dir`` (called once, on the main process, after the last step).

        ``model`` is the unwrapped module (under ZeRO-3 its parameters are partitioned: use
        ``state_dict``, the full consolidated weights). The default writes ``model.safetensors``;
        recipes override it to write Hugging Face or peft layouts.
        """
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        # clone(): tied weights share storage, which safetensors refuses to write twice.
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in state_dict.items()}, str(out_dir / "model.safetensors"))
