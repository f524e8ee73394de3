"""The mlm recipe on a Hugging Face masked LM (--model.name_or_path, or --model.init random with a config): a tiny
random BERT made here trains, resumes exactly, exports a folder AutoModelForMaskedLM loads with the same logits,
and fills masks; a pretrained folder is read as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import train_log

from zerotrain.tasks.mlm import MLMConfig, MLMTask
from zerotrain.train.loop import fit

TEXT = "the movie was great and i loved the plot but the acting was bad\nit was a very boring film\nthis story is fun\n"
BERT = dict(model_type="bert", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=1, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


def config(tmp_path: Path, tok: Path, run_name: str = "run", steps: int = 8, **strategy) -> MLMConfig:
    (tmp_path / "train.txt").write_text(TEXT * 30)
    (tmp_path / "bert.json").write_text(json.dumps(BERT))
    cfg = MLMConfig()
    cfg.model.init, cfg.model.config, cfg.model.max_seq_length = "random", str(tmp_path / "bert.json"), 16
    cfg.data.train_path, cfg.data.tokenizer = str(tmp_path / "train.txt"), str(tok)
    cfg.data.cache_dir, cfg.data.mask_prob = str(tmp_path / "cache"), 0.3
    cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.trainer.log_every_steps = 4, steps, 1
    cfg.trainer.num_workers, cfg.trainer.output_dir, cfg.trainer.run_name = 0, str(tmp_path), run_name
    cfg.trainer.eval_every_steps = 0
    cfg.logging.progress_bar, cfg.logging.tensorboard = False, False
    cfg.optimizer.lr, cfg.checkpoint.every_steps = 5e-3, 4
    for key, value in strategy.items():
        setattr(cfg.strategy, key, value)
    return cfg





def test_a_random_bert_trains_exports_and_fills_masks(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoModelForMaskedLM

    from zerotrain.runtime.rundir import load_run

    cfg = config(tmp_path, tiny_tokenizer_dir, steps=16, backend="ddp")
    cfg.checkpoint.every_steps = 0
    result = fit(MLMTask(cfg))
    log = train_log(result.run_dir)
    first, last = sum(log[s]["train_loss"] for s in (1, 2)) / 2, sum(log[s]["train_loss"] for s in (15, 16)) / 2
    assert last < first - 0.3, (first, last)
    hf_model = AutoModelForMaskedLM.from_pretrained(result.run_dir / "model").eval()
    run = load_run(result.run_dir)
    x = torch.tensor([[0, 5, 6, 7, 37, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=x).logits, run.model(input_ids=x).logits)
    (line,) = run.task.predict(run.model, ["the movie was <mask>"], top_k=2)
    assert line.count(",") == 1


def test_a_pretrained_folder_is_read_as_it_is(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoConfig, AutoModelForMaskedLM

    torch.manual_seed(0)
    folder = tmp_path / "bert"
    AutoModelForMaskedLM.from_config(AutoConfig.for_model(**BERT)).save_pretrained(folder)
    cfg = config(tmp_path, tiny_tokenizer_dir)
    cfg.model.init, cfg.model.name_or_path, cfg.model.config = "pretrained", str(folder), None
    task = MLMTask(cfg)
    model = task.build_model()
    saved = AutoModelForMaskedLM.from_pretrained(folder)
    torch.testing.assert_close(model.state_dict(), saved.state_dict())
    batch = task.collator()([task.build_datasets().train[i] for i in range(2)])
    out = task.training_step(model, batch)
    assert out.loss.isfinite() and out.tokens == 2 * 16
    assert task.flops_per_token(model) > 6 * sum(p.numel() for p in model.bert.encoder.parameters())


@pytest.mark.parametrize("stage", [pytest.param(1), pytest.param(3, marks=pytest.mark.slow)])
def test_resume_is_exact(tmp_path, tiny_tokenizer_dir, stage):
    straight = fit(MLMTask(config(tmp_path, tiny_tokenizer_dir, "straight", zero_stage=stage)))
    fit(MLMTask(config(tmp_path, tiny_tokenizer_dir, "split", steps=4, zero_stage=stage)))
    again = config(tmp_path, tiny_tokenizer_dir, "split", zero_stage=stage)
    again.checkpoint.resume = "auto"
    resumed = fit(MLMTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after resume"


def test_streamed_resume_continues_at_the_exact_block(tmp_path, tiny_tokenizer_dir):
    """--data.streaming: a run stopped after 4 steps and resumed logs bitwise the losses of one that never stopped
    (masks included), across the end of the stream, and the checkpoint holds the stream's offset."""
    def streamed(run_name, steps):
        cfg = config(tmp_path, tiny_tokenizer_dir, run_name=run_name, steps=steps, zero_stage=2)
        cfg.data.streaming, cfg.data.max_train_lines = True, 12
        return cfg

    straight = fit(MLMTask(streamed("straight", 8)))
    fit(MLMTask(streamed("split", 4)))
    saved = json.loads(next((tmp_path / "split").glob("checkpoints/step00000004/*.json")).read_text())
    assert saved.get("stream_offset") and saved["stream_offset"][1] > 0, saved
    assert saved["epoch"] >= 1, saved  # the stream ended at least once before the checkpoint
    again = streamed("split", 8)
    again.checkpoint.resume = "auto"
    resumed = fit(MLMTask(again))
    a, b = train_log(straight.run_dir), train_log(resumed.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step]["train_loss"] == a[step]["train_loss"], f"step {step}: loss differs after a streamed resume"
