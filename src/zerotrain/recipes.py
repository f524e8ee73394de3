"""The recipes shipped with zerotrain: name -> (config class, task class), imported on demand."""

from __future__ import annotations

import importlib

from zerotrain.config import RunConfig
from zerotrain.tasks.base import Task

RECIPES: dict[str, tuple[str, str, str, str]] = {
    # name: (module, config class, task class, one-line description)
    "imdb": ("zerotrain.tasks.imdb", "IMDBConfig", "IMDBTask",
             "IMDB sentiment classifier (transformer encoder, RoBERTa tokenizer)"),
    "mlm": ("zerotrain.tasks.mlm", "MLMConfig", "MLMTask",
            "RoBERTa masked-language-model pre-training (HelloDeepSpeed)"),
    "lora": ("zerotrain.tasks.lora", "LoRAConfig", "LoRATask",
             "LoRA fine-tuning of a causal LM with prompt masking"),
    "toy": ("zerotrain.tasks.toy", "ToyConfig", "ToyTask",
            "a tiny MLP on synthetic data (smoke tests, custom-task template)"),
}


def load(name: str) -> tuple[type[RunConfig], type[Task]]:
    module, cfg_cls, task_cls, _ = RECIPES[name]
    mod = importlib.import_module(module)
    return getattr(mod, cfg_cls), getattr(mod, task_cls)
