"""A toy task: a small MLP regressing a fixed random linear map. The smallest example of a custom task.

It is what tests use to check the engine, the loop and resume without tokenisers or text, and
it shows everything a user has to write to plug their own model and data into zerotrain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import TensorDataset

from zerotrain.config import ConfigError, RunConfig
from zerotrain.tasks.base import Splits, StepOutput, Task


@dataclass
class ToyModelConfig:
    width: int = 32
    """Hidden width of the MLP."""
    dropout: float = 0.1
    """Dropout after the hidden layer (exercises RNG restore on resume)."""

    def validate(self) -> None:
        if self.width < 1:
            raise ConfigError("--model.width", f"must be >= 1, got {self.width}")


@dataclass
class ToyDataConfig:
    num_examples: int = 256
    """Training examples."""
    dim: int = 8
    """Input and output dimension."""
    num_val_examples: int = 64
    """Validation examples."""


@dataclass
class ToyConfig(RunConfig):
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    """The MLP."""
    data: ToyDataConfig = field(default_factory=ToyDataConfig)
    """The synthetic data."""


class ToyTask(Task[ToyConfig]):
    name = "toy"
    config_class = ToyConfig
    description = "a tiny MLP on synthetic data (smoke tests, custom-task template)"

    def build_model(self, pretrained: bool = True) -> nn.Module:
        d, w = self.cfg.data.dim, self.cfg.model.width
        return nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Dropout(self.cfg.model.dropout), nn.Linear(w, d))

    def build_datasets(self) -> Splits:
        g = torch.Generator().manual_seed(1234)  # the data is fixed, whatever the training seed
        d, n, v = self.cfg.data.dim, self.cfg.data.num_examples, self.cfg.data.num_val_examples
        x = torch.randn(n + v, d, generator=g)
        y = x @ torch.randn(d, d, generator=g) / d**0.5
        return Splits(train=TensorDataset(x[:n], y[:n]), val=TensorDataset(x[n:], y[n:]))

    def collator(self):
        return stack_pairs

    def training_step(self, model, batch) -> StepOutput:
        pred = model(batch["x"].to(_dtype_of(model)))
        loss = nn.functional.mse_loss(pred.float(), batch["y"])
        return StepOutput(loss=loss, tokens=batch["x"].shape[0], samples=batch["x"].shape[0])

    def eval_step(self, model, batch) -> dict[str, float]:
        pred = model(batch["x"].to(_dtype_of(model))).float()
        return {"sq_err": float(((pred - batch["y"]) ** 2).mean(-1).sum()), "count": batch["x"].shape[0]}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"mse": sums["sq_err"] / max(1.0, sums["count"])}


def stack_pairs(examples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    xs, ys = zip(*examples)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}  # (B, dim) each


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
