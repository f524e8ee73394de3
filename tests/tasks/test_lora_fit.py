"""LoRA through the whole stack: DeepSpeed ZeRO 2 and 3, 1 and 2 processes, the adapter checked against the trained weights."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, WORDS, lora_fit_args, run_python, zerotrain_cmd

from zerotrain.checkpoint.layout import complete_checkpoints
from zerotrain.train.loop import seed_everything

@pytest.mark.slow
@pytest.mark.parametrize("stage,nproc", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_lora_adapter_matches_trained_weights(lora_files, stage, nproc):
    tmp_path, tok = lora_files
    out = zerotrain_cmd(lora_fit_args(tmp_path, tok, stage, nproc), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    adapter_dir = run / "model" / "adapter"
    assert (adapter_dir / "adapter_config.json").is_file()

    # The trained weights, rebuilt independently from DeepSpeed's (possibly sharded) checkpoint.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ckpt = complete_checkpoints(run / "checkpoints")[-1]
    trained = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    lora_keys = [k for k in trained if "lora_" in k]
    assert len(adapter) == len(lora_keys) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    for key in lora_keys:
        saved = adapter[key.replace(".default", "")]
        assert saved.numel() > 0, f"{key} is empty: a partitioned ZeRO-3 parameter was written"
        torch.testing.assert_close(saved.float(), trained[key].float())
    assert any(trained[k].abs().sum() > 0 for k in lora_keys if "lora_B" in k), "training moved lora_B"

    # And peft loads it: a fresh base with the run's seed + the adapter = the trained model.
    from peft import PeftModel

    from zerotrain.cli.fit import parse_config
    from zerotrain.tasks.lora import LoRATask

    cfg = parse_config("lora", lora_fit_args(tmp_path, tok, stage, nproc)[2:])
    task = LoRATask(cfg)
    seed_everything(cfg.trainer.seed)
    reference = task.build_model()
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected
    loaded = PeftModel.from_pretrained(_plain_base(task, cfg), adapter_dir)
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)


def _plain_base(task, cfg):
    """The base model exactly as the run initialised it (same seed, same draw order), without LoRA."""
    seed_everything(cfg.trainer.seed)
    return task._load_base()


@pytest.mark.slow
def test_hf_trainer_row_reads_the_tutorial_json(lora_files, cpu_adam_built):
    """The benchmark's Hugging Face Trainer row runs the shipped ZeRO-2 + offload preset (HJSON with a
    '#' comment) and counts the tokens of every measured step, data-loader workers or not."""
    tmp_path, tok = lora_files
    fit_flags = lora_fit_args(tmp_path, tok, stage=2, nproc=1)[2:]
    fit_flags[fit_flags.index("--trainer.num_workers") + 1] = "2"
    row_file = tmp_path / "row.json"
    preset = REPO / "src" / "zerotrain" / "presets" / "ds_zero2_offload.json"
    out = run_python([str(REPO / "benchmarks" / "hf_trainer.py"), "--recipe", "lora", "--out", str(row_file),
                      "--warmup", "1", "--", *fit_flags, "--strategy.deepspeed_config", str(preset)], cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(row_file.read_text())
    assert row["measured_steps"] == 3  # 4 steps, the first one excluded
    # Micro-batch 4, padded to a multiple of 8, at most 32 tokens: what the workers' collate produced.
    assert 0 < row["measured_tokens"] <= 3 * 4 * 32 and row["measured_tokens"] % (4 * 8) == 0
    assert row["throughput_tokens_per_s"] > 0


@pytest.mark.slow
def test_two_ranks_weigh_every_target_token_as_one_rank_does(lora_files):
    """Two ranks x micro-batch 2 train on the examples one rank x micro-batch 4 does (the plan depends on
    their product only). Each rank weighs its mean loss by its share of the step's target tokens, summed
    across ranks on the device, so the losses and gradient norms are those of the one big batch; the
    plain mean of the two ranks' means would differ, as the targets run from 1 to 8 words."""
    tmp_path, tok = lora_files
    records = [{"input": f"{WORDS[i % 20]} {WORDS[(i * 7) % 20]}",
                "target": " ".join(WORDS[(i * 3 + j) % 20] for j in range(1 + (i * 5) % 8))} for i in range(32)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    curves = {}
    for nproc, micro in ((1, "4"), (2, "2")):
        args = lora_fit_args(tmp_path, tok, stage=2, nproc=nproc)
        args[args.index("--trainer.micro_batch_size") + 1] = micro
        args[args.index("--trainer.run_name") + 1] = f"run{nproc}"
        # No LoRA dropout: its masks are drawn per rank and micro-batch shape, and would change the gradient
        out = zerotrain_cmd(args + ["--model.lora_dropout", "0", "--checkpoint.save_final", "false",
                                    "--trainer.export", "false"], cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / f"run{nproc}" / "metrics.jsonl").read_text().splitlines()]
        curves[nproc] = [(r["train_loss"], r["grad_norm"]) for r in rows if "train_loss" in r]
    assert len(curves[1]) == 4
    for (loss1, norm1), (loss2, norm2) in zip(curves[1], curves[2], strict=True):
        assert loss2 == pytest.approx(loss1, rel=1e-5) and norm2 == pytest.approx(norm1, rel=1e-4)
