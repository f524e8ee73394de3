"""Where metrics go: metrics.jsonl always, TensorBoard by default, W&B when asked. Rank 0 only."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional

from zerotrain.config import LoggingConfig
from zerotrain.errors import UserError

log = logging.getLogger("zerotrain")


def setup_logging(is_main: bool) -> None:
    """Rank 0 logs at INFO; the other ranks only warn, so N processes don't print N copies."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[zerotrain] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)


class Tracker:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, hparams: dict[str, Any], is_main: bool,
                 resumed_at: Optional[int] = None):
        """``resumed_at``: the checkpoint step a resumed run starts from. What a killed run logged after
        it is hidden from TensorBoard (its ``purge_step``), as the loop removes it from metrics.jsonl."""
        self.is_main = is_main
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not is_main:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resumed_at is None else resumed_at + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / "tb_dir"), purge_step=purge)
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise UserError("--logging.wandb needs the wandb package: pip install 'zerotrain[wandb]'") from None
            self._wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.wandb_run_name or run_dir.name, tags=cfg.wandb_tags or None,
                config=hparams, mode=cfg.wandb_mode, dir=str(run_dir),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        clean = {k: v for k, v in metrics.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        for key, value in clean.items():
            if isinstance(value, (int, float)):
                if self._tb is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
