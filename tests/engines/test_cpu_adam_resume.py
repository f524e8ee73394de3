"""DeepSpeedCPUAdam (the optimizer of every offload) resumed from a checkpoint takes the same steps as the run that
never stopped, bitwise, wherever it stops: its C++ side keeps beta1^t and beta2^t beside a step count that no
checkpoint holds, and a resumed optimizer would compute them afresh where the uninterrupted one multiplied."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_llama_lm, train_log

from zerotrain.tasks.causal_lm import CausalLMConfig, CausalLMTask
from zerotrain.train.loop import fit

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, tok: Path, run: str, steps: int, stage: int) -> CausalLMConfig:
    cfg = tiny_llama_lm(tmp_path, tok, run, steps)
    cfg.checkpoint.every_steps = 2
    cfg.strategy.zero_stage, cfg.strategy.offload_optimizer = stage, "cpu"
    return cfg


@pytest.mark.parametrize("stage", [2, 3])
def test_a_cpu_offload_resumed_at_step_2_takes_the_uninterrupted_steps(tmp_path, tiny_tokenizer_dir, cpu_adam_built,
                                                                        stage):
    """At step 2: pow(0.999, 3) and 0.999 cubed differ in float32, so a counter computed afresh changes step 3."""
    straight = fit(CausalLMTask(_config(tmp_path, tiny_tokenizer_dir, "straight", 6, stage)))
    fit(CausalLMTask(_config(tmp_path, tiny_tokenizer_dir, "split", 2, stage)))
    again = _config(tmp_path, tiny_tokenizer_dir, "split", 6, stage)
    again.checkpoint.resume = "auto"
    resumed = fit(CausalLMTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [(b[s]["train_loss"], b[s]["grad_norm"]) for s in a] == [(a[s]["train_loss"], a[s]["grad_norm"]) for s in a]
