from __future__ import annotations

import math

import pytest
import torch

from zerotrain.config import TrainerConfig
from zerotrain.errors import ConfigError
from zerotrain.tasks.mlm import MLMConfig, MLMDataConfig, MLMModelConfig, MLMTask

TEXT = "the movie was great and i loved the plot but the acting was bad\nit was a very boring film\n\nthis story is fun\n"


@pytest.fixture
def task(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "train.txt").write_text(TEXT * 20)
    (tmp_path / "val.txt").write_text(TEXT * 4)
    cfg = MLMConfig(
        model=MLMModelConfig(num_layers=2, num_heads=2, h_dim=16, ff_dim=32, dropout=0.1, max_seq_length=16),
        data=MLMDataConfig(train_path=str(tmp_path / "train.txt"), val_path=str(tmp_path / "val.txt"),
                           tokenizer=str(tiny_tokenizer_dir), cache_dir=str(tmp_path / "cache")),
        trainer=TrainerConfig(max_steps=1, micro_batch_size=4),
    ).validate()
    return MLMTask(cfg)


def test_train_and_eval_steps_on_the_plain_model(task):
    model = task.build_model()
    assert model.vocab_size == len(task.tokenizer)
    splits = task.build_datasets()
    assert len(splits.train) > 4 and len(splits.val) >= 2
    batch = task.collator()([splits.train[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 16) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].shape == (4, 16)

    model.train()
    out = task.training_step(model, batch)
    assert torch.isfinite(out.loss) and out.tokens == 64 and out.samples == 4
    out.loss.backward()
    assert model.encoder.layers[0].attn.qkv.weight.grad is not None

    model.eval()
    val_batch = task.collator()([splits.val[i] for i in range(2)])
    sums = task.eval_step(model, val_batch)
    assert sums == task.eval_step(model, val_batch), "validation masks must be reproducible"
    assert set(sums) == {"loss_sum", "masked", "correct"} and sums["masked"] > 0
    metrics = task.eval_metrics(sums)
    assert set(metrics) == {"loss", "ppl", "mlm_acc"}
    assert math.isfinite(metrics["loss"]) and 0.0 <= metrics["mlm_acc"] <= 1.0
    assert metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))
    assert task.flops_per_token(model) == model.flops_per_token(16, predicted_fraction=task.cfg.data.mask_prob)


def test_special_tokens_are_never_masked(task):
    splits = task.build_datasets()
    batch = task.collator()([splits.train[i] for i in range(4)])
    tok = task.tokenizer
    for _ in range(20):
        masked, labels = task._mask(batch, generator=None)
        assert (masked[:, 0] == tok.bos_token_id).all() and (masked[:, -1] == tok.eos_token_id).all()
        assert (labels[batch["input_ids"] == tok.eos_token_id] == -100).all()


def test_holdout_when_no_val_path(task):
    task.cfg.data.val_path = None
    splits = task.build_datasets()
    n_train, n_val = len(splits.train), len(splits.val)
    assert n_val == max(1, (n_train + n_val) // 100)
    # The held-out blocks are the last ones of the packed training text.
    assert splits.train.blocks.data_ptr() + n_train * 16 * 4 == splits.val.blocks.data_ptr()


@pytest.mark.parametrize(
    "section, change, flag",
    [
        ("model", dict(h_dim=30, num_heads=8), "--model.h_dim"),
        ("model", dict(dropout=1.0), "--model.dropout"),
        ("data", dict(mask_prob=1.5), "--data.mask_prob"),
        ("data", dict(random_replace_prob=0.6, unmask_replace_prob=0.6), "--data.random_replace_prob"),
    ],
)
def test_validation_names_the_flag(section, change, flag):
    cfg = MLMConfig(trainer=TrainerConfig(max_steps=1))
    for key, value in change.items():
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        cfg.validate()


def test_eval_masks_do_not_depend_on_batch_composition(task):
    """With several ranks, a row lands in a different batch: its validation mask must not change."""
    splits = task.build_datasets()
    rows = [splits.train[i] for i in range(4)]
    whole, whole_labels = task._eval_mask(task.collator()(rows))
    part, part_labels = task._eval_mask(task.collator()(rows[2:]))
    assert torch.equal(whole[2:], part) and torch.equal(whole_labels[2:], part_labels)
    assert (whole_labels != -100).any()
