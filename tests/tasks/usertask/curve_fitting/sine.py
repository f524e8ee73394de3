"""A task written the way a user would, in a package of their own: fit y = sin(a x) with a small tanh network.

It imports only zerotrain's public Task interface and registers no recipe name, so ``zerotrain fit`` can
reach it only as ``curve_fitting.sine:SineTask``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import Dataset

from zerotrain.config import RunConfig
from zerotrain.tasks.base import Splits, StepOutput, Task


@dataclass
class SineModel:
    hidden: int = 16
    """Units in each of the two tanh layers."""


@dataclass
class SineData:
    points: int = 128
    """Training points on [-pi, pi]."""
    frequency: float = 2.0
    """a in y = sin(a x)."""


@dataclass
class SineConfig(RunConfig):
    model: SineModel = field(default_factory=SineModel)
    """The network."""
    data: SineData = field(default_factory=SineData)
    """The curve."""


class Curve(Dataset):
    """Evenly spaced samples of the curve, shifted by ``offset`` of a step (the validation points sit between)."""

    def __init__(self, points: int, frequency: float, offset: float = 0.0):
        step = 2 * math.pi / points
        self.x = torch.tensor([-math.pi + (i + offset) * step for i in range(points)]).unsqueeze(-1)  # (N, 1)
        self.y = torch.sin(frequency * self.x)  # (N, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pairs(items):
    xs, ys = zip(*items)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}  # (B, 1) each


class SineTask(Task[SineConfig]):
    config_class = SineConfig
    description = "fit a sine curve (a user's own task)"

    def build_model(self, pretrained: bool = True) -> nn.Module:
        h = self.cfg.model.hidden
        return nn.Sequential(nn.Linear(1, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def build_datasets(self) -> Splits:
        d = self.cfg.data
        return Splits(train=Curve(d.points, d.frequency), val=Curve(d.points // 4, d.frequency, offset=0.5))

    def collator(self):
        return pairs

    def training_step(self, model, batch) -> StepOutput:
        x = batch["x"].to(next(model.parameters()).dtype)
        loss = nn.functional.mse_loss(model(x).float(), batch["y"])
        return StepOutput(loss=loss, tokens=len(x), samples=len(x))

    def eval_step(self, model, batch) -> dict[str, float]:
        x = batch["x"].to(next(model.parameters()).dtype)
        err = (model(x).float() - batch["y"]) ** 2
        return {"sq": float(err.sum()), "n": len(x)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"mse": sums["sq"] / max(1.0, sums["n"])}

    def predict(self, model, inputs: list[str], **options) -> list[str]:
        with torch.no_grad():
            weight = next(model.parameters())
            x = torch.tensor([[float(text)] for text in inputs], dtype=weight.dtype, device=weight.device)  # (N, 1)
            return [f"{float(y):.4f}" for y in model(x).float().squeeze(-1)]
