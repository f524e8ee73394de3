from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zerotrain.config import TrainerConfig
from zerotrain.errors import ConfigError, DataError
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
    tok = task.tokenizer
    for epoch in range(5):
        splits.train.set_epoch(epoch)
        for i in range(4):
            block, item = splits.train.blocks[i], splits.train[i]
            assert item["input_ids"][0] == tok.bos_token_id and item["input_ids"][-1] == tok.eos_token_id
            assert (item["labels"][block == tok.eos_token_id] == -100).all()
            chosen = item["labels"] != -100
            assert torch.equal(item["labels"][chosen], block[chosen]), "labels are the original tokens"


def test_the_step_is_handed_its_masked_positions_and_computes_the_same_loss(task):
    """collate_masked finds the masked positions on the CPU; the model given them computes bitwise the
    loss it computes when it finds them itself (which waits for the GPU)."""
    splits = task.build_datasets()
    batch = task.collator()([splits.train[i] for i in range(4)])
    labels = batch["labels"]
    assert torch.equal(batch["masked_positions"], (labels.flatten() != -100).nonzero().squeeze(1))
    assert batch["masked_positions"].numel() > 0
    model = task.build_model()
    model.eval()  # no dropout: the two forwards must see the same network
    handed = model(input_ids=batch["input_ids"], labels=labels, masked_positions=batch["masked_positions"])
    found = model(input_ids=batch["input_ids"], labels=labels)
    assert torch.equal(handed["loss"], found["loss"]) and torch.equal(handed["logits"], found["logits"])


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


def test_eval_masks_depend_only_on_the_block(task):
    """With several ranks a validation block lands at another index and in another batch: its mask
    must not change, nor from one evaluation (epoch) to the next."""
    from zerotrain.data.masking import MaskedBlocks

    val = task.build_datasets().train  # more blocks than the tiny validation text
    fixed = MaskedBlocks(val.blocks, val.masker, fixed=True)
    moved = MaskedBlocks(val.blocks[[2, 0, 3, 1]], val.masker, fixed=True)
    moved.set_epoch(7)
    for i, j in enumerate([2, 0, 3, 1]):
        assert all(torch.equal(moved[i][k], fixed[j][k]) for k in ("input_ids", "labels"))
    assert any((fixed[i]["labels"] != -100).any() for i in range(4))


def test_training_masks_are_fresh_each_epoch_and_a_function_of_seed_epoch_and_index(task):
    from zerotrain.data.masking import MaskedBlocks

    train = task.build_datasets().train
    again = MaskedBlocks(train.blocks, train.masker, seed=task.cfg.trainer.seed)

    def labels(ds, epoch):
        ds.set_epoch(epoch)
        return torch.stack([ds[i]["labels"] for i in range(len(ds))])

    assert torch.equal(labels(train, 3), labels(again, 3))
    assert not torch.equal(labels(train, 0), labels(train, 1))
    other_seed = MaskedBlocks(train.blocks, train.masker, seed=task.cfg.trainer.seed + 1)
    assert not torch.equal(labels(train, 0), labels(other_seed, 0))


@pytest.mark.parametrize("workers, persistent", [(0, False), (1, False), (2, True)])
def test_the_stream_tells_the_dataset_its_epoch_and_a_resumed_stream_masks_alike(task, workers, persistent):
    """micro_batch_stream sets the dataset's epoch before each epoch's pass: forked workers copy it, persistent
    ones (the training stream's) get it through EpochSynced. Every way, the masks are those of one process."""
    from zerotrain.data.loader import make_loader, micro_batch_stream
    from zerotrain.data.sampling import EpochBatches

    train = task.build_datasets().train

    def stream(epoch, skip, n, workers=workers):
        sampler = EpochBatches(len(train), 2, rank=0, world_size=1, seed=0, shuffle=False)
        loader = make_loader(train, sampler, task.collator(), workers, 0, persistent=persistent)
        it = micro_batch_stream(loader, sampler, epoch, skip)
        return [next(it)[2]["labels"] for _ in range(n)], sampler.batches_per_epoch

    full, per_epoch = stream(0, 0, 0)
    full, _ = stream(0, 0, 2 * per_epoch + 2)
    resumed, _ = stream(1, 1, 1)
    assert torch.equal(resumed[0], full[per_epoch + 1])
    assert not torch.equal(full[0], full[per_epoch]), "epoch 1 reads block 0 again, with a fresh mask"
    in_process, _ = stream(0, 0, 2 * per_epoch + 2, workers=0)
    assert all(torch.equal(a, b) for a, b in zip(full, in_process, strict=True))


@pytest.mark.parametrize("form", ["train.jsonl", "train.csv", "train.parquet", "saved", "parts", "parts/*.txt"])
def test_records_a_saved_dataset_and_a_folder_give_the_text_files_blocks(task, tmp_path, form):
    """The training text as records of every format (blank lines as empty texts), a saved dataset and a folder of
    two text files: the same packed blocks as the .txt file."""
    import csv

    import datasets

    want = task.build_datasets().train.blocks
    lines = (TEXT * 20).split("\n")[:-1]
    if form == "train.jsonl":
        (tmp_path / form).write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(lines)))
    elif form == "train.csv":
        with open(tmp_path / form, "w", newline="") as f:
            csv.writer(f).writerows([["id", "text"]] + [[i, t or " "] for i, t in enumerate(lines)])
    elif form == "train.parquet":
        pa = pytest.importorskip("pyarrow", reason="Parquet files are read through pyarrow, which is not installed")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": lines}), tmp_path / form)
    elif form == "saved":
        datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(tmp_path / form))
    else:
        (tmp_path / "parts").mkdir()
        (tmp_path / "parts" / "a.txt").write_text("\n".join(lines[:9]) + "\n")
        (tmp_path / "parts" / "b.txt").write_text("\n".join(lines[9:]) + "\n")
    task.cfg.data.train_path = str(tmp_path / form)
    assert torch.equal(MLMTask(task.cfg).build_datasets().train.blocks, want)


def test_a_second_build_reads_the_cached_tokens_without_reading_the_files(task, monkeypatch):
    from zerotrain.data import source

    first = task.build_datasets()
    cache = Path(task.cfg.data.cache_dir)
    assert len(list(cache.glob("mlm-*.arrow"))) == 2  # train and validation

    def boom(*args, **kwargs):
        raise AssertionError("read or tokenized again: the cache was not used")

    again = MLMTask(task.cfg)
    tok = again.tokenizer  # loaded (and its encoding checked) before tokenizing is forbidden
    monkeypatch.setattr(source.Source, "load", boom)
    monkeypatch.setattr(type(tok), "__call__", boom)
    splits = again.build_datasets()
    assert torch.equal(splits.train.blocks, first.train.blocks) and torch.equal(splits.val.blocks, first.val.blocks)
    monkeypatch.undo()
    task.cfg.model.max_seq_length = 8  # packing runs on the cached tokens: another block length, same cache
    assert MLMTask(task.cfg).build_datasets().train.blocks.shape[1] == 8
    assert len(list(cache.glob("mlm-*.arrow"))) == 2


def test_a_csv_without_the_text_field_names_its_line(task, tmp_path):
    (tmp_path / "bad.csv").write_text("body\nthe movie\n")
    task.cfg.data.train_path = str(tmp_path / "bad.csv")
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad.csv'}:2: missing field 'text' .* set --data.text_field"):
        MLMTask(task.cfg).build_datasets()
