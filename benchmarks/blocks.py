"""What the in-process A/B scripts (zero_step_host.py, engine_host.py) share: variants timed in blocks that take
turns, each block's median drawn per variant, a quantile of the samples, and the result files with their provenance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable


def plot_block_medians(series: dict[str, list[float]], ylabel: str, title: str, path: Path) -> None:
    """One line per variant over its blocks' medians (nothing drawn without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, blocks in series.items():
        ax.plot(range(1, len(blocks) + 1), blocks, marker="o", label=name)
    ax.set_xlabel("block (variants take turns)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def provenance() -> dict[str, Any]:
    """The GPU, versions, commit and exact command a result file carries (zerotrain's own record, as every run
    directory has it)."""
    import torch

    from zerotrain.runtime.rundir import environment

    env = environment()
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "torch": env["versions"]["torch"], "deepspeed": env["versions"]["deepspeed"], "python": env["python"],
            "commit": env["commit"], "command": " ".join(["python", *sys.argv])}


def write_result(result: dict[str, Any], out: Path, name: str, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None]) -> None:
    """``out/name.json``, ``.md`` and ``.png``; the Markdown printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))
    plot(result, out / f"{name}.png")
    print(markdown(result))
