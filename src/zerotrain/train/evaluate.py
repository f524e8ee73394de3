"""Validation during training and the test at the end: the evaluator component of the loop."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Dataset

from zerotrain.config import TrainerConfig
from zerotrain.data.loader import make_loader
from zerotrain.data.sampling import eval_shard
from zerotrain.engines.base import Engine, to_device
from zerotrain.runtime.collectives import all_gather_object
from zerotrain.tasks.base import Task


class Evaluator:
    """Runs ``task.eval_step`` over a split on every rank and reduces the sums into metrics."""

    def __init__(self, task: Task, engine: Engine, trainer: TrainerConfig):
        self.task, self.engine, self.cfg = task, engine, trainer

    def should_validate(self, step: int, at_epoch_end: bool, last_step: bool) -> bool:
        """At the end of training, and every ``eval_every_steps`` steps (0: at the end of each epoch)."""
        every = self.cfg.eval_every_steps
        return last_step or (step % every == 0 if every else at_epoch_end)

    def run(self, dataset: Dataset, prefix: str) -> dict[str, float]:
        """Metrics of ``dataset`` named ``<prefix>_<metric>`` (e.g. val_loss). Collective."""
        engine = self.engine
        batches = eval_shard(len(dataset), engine.micro_batch_size, engine.rank, engine.world_size)
        batches = batches[:self.cfg.eval_max_batches]
        # Every rank runs the same number of forwards: under ZeRO-3 each forward is a collective
        # (parameter all-gather), so a rank with one batch fewer would leave the others waiting.
        # Ranks short of batches repeat one and discard the result.
        rounds = int(engine.all_reduce_max(len(batches)))
        filler = batches[0] if batches else [0]
        plan = batches + [filler] * (rounds - len(batches))
        loader = make_loader(dataset, plan, self.task.collator(), self.cfg.num_workers, self.cfg.seed)
        engine.eval()
        sums: dict[str, float] = {}
        with torch.no_grad(), engine.eval_context():
            for i, batch in enumerate(loader):
                out = self.task.eval_step(engine.forward_model, to_device(batch, engine.device))
                if i < len(batches):
                    for k, v in out.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
        engine.train()
        # Ranks with no batch still join the reduction, with zeros for every key another rank has.
        keys = sorted({k for ks in all_gather_object(sorted(sums)) for k in ks})
        sums = engine.all_reduce_sum({k: sums.get(k, 0.0) for k in keys})
        return {f"{prefix}_{k}": v for k, v in self.task.eval_metrics(sums).items()}


def fmt(metrics: dict[str, float], keys: Optional[list[str]] = None) -> str:
    # Counts (ints, e.g. test_reviews) print as counts, not as 2000.0000.
    return ", ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}"
                     for k, v in metrics.items() if keys is None or k in keys)
