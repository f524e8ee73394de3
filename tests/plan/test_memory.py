"""The model-state memory estimator and the planner behind ``zerotrain estimate``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.cli import main
from zerotrain.plan.memory import plan
from zerotrain.engines.states import Buckets, ParamCounts, count_params, model_state_memory
from zerotrain.plan.strategies import STRATEGIES

GIB = 2**30


def test_count_params_on_the_meta_device():
    with torch.device("meta"):
        emb = nn.Embedding(100, 8)
        head = nn.Linear(8, 100, bias=False)
        head.weight = emb.weight  # tied: counted once
        model = nn.Sequential(emb, nn.Linear(8, 8), head).to(torch.bfloat16)
    model[1].weight.requires_grad_(False)
    c = count_params(model)
    assert (c.total, c.trainable, c.largest_layer, c.largest_trainable) == (800 + 72, 800 + 8, 800, 800)
    assert (c.total_bytes, c.trainable_bytes) == (2 * 872, 2 * 808)


def test_each_stage_partitions_what_it_should():
    """Ψ = T = 1000 on 4 GPUs in bf16: weights 2, gradients 2, optimizer 16 bytes per parameter."""
    c = ParamCounts(total=1000, trainable=1000, largest_layer=100, total_bytes=4000, trainable_bytes=4000,
                    largest_trainable=80)

    def mem(name):
        m = model_state_memory(c, STRATEGIES[name], world_size=4, precision="bf16", buckets=Buckets(10))
        return m.gpu_bytes, m.cpu_bytes

    bucket = 2 * 10
    assert mem("zero0") == (2000 + 2000 + 16000, 0)
    assert mem("zero1") == (2000 + 2000 + 4000 + bucket, 0)
    assert mem("zero2") == (2000 + 500 + 4000 + bucket, 0)
    assert mem("zero3") == (500 + 500 + 4000 + 2 * 2 * 100 + bucket, 0)
    # Offloaded ZeRO-2 partition (250 parameters): fp32 master weights and gradients, a bf16 copy, two moments
    # (its gradients go to the host bucket by bucket, through a buffer the size of the largest layer)
    assert mem("zero2_offload") == (2000 + bucket + 2 * 80, (4 + 4 + 2 + 8) * 250)
    # ZeRO-3's offloaded partition: fp32 master weights and gradients, the flat bf16 gradient partition the reduced
    # gradients land in, two moments (no gradients left on the GPU); with the 16-bit weights too, or without
    assert mem("zero3_offload") == (2 * 2 * 100 + bucket, (4 + 4 + 2 + 8) * 250 + 500)
    assert mem("zero3_offload_optimizer") == (500 + 2 * 2 * 100 + bucket, (4 + 4 + 2 + 8) * 250)
    # Plain PyTorch keeps the built fp32 weights; gradients twice over (DDP's buckets), Adam's two moments.
    assert mem("ddp") == (4000 + 8000 + 8000, 0)
    # Accumulating under ZeRO-1/2 offload: DeepSpeed's sum of the gradient partition on the host, in the weights' dtype
    for name, precision, extra in (("zero2_offload", "bf16", 2 * 1000 / 4), ("zero2_offload", "fp32", 4 * 1000 / 4),
                                   ("zero3_offload", "bf16", 0), ("zero2", "bf16", 0)):
        once, accumulated = (model_state_memory(c, STRATEGIES[name], 4, precision, Buckets(10), grad_accum=k).cpu_bytes
                             for k in (1, 4))
        assert accumulated - once == extra, (name, precision)


def test_a_host_keeps_room_for_the_process_beside_its_offloaded_states():
    """Offloaded states that fill the host to the byte do not fit: the process itself needs memory too. The 6.74B's
    119 GiB of pinned ZeRO-3 states on a 125 GiB host were killed in the first step. A row that offloads nothing is
    not judged on the host."""
    from zerotrain.plan.memory import GIB, PROCESS_HOST_BYTES, plan

    c = ParamCounts(total=10**9, trainable=10**9, largest_layer=10**7, total_bytes=2 * 10**9, trainable_bytes=2 * 10**9)
    only = {"zero3_offload_optimizer": STRATEGIES["zero3_offload_optimizer"]}
    states = model_state_memory(c, only["zero3_offload_optimizer"], 1, "bf16").cpu_bytes
    for process, fits in ((0.0, True), (PROCESS_HOST_BYTES, False)):
        [row] = plan(c, 1, "bf16", 80 * GIB, states + GIB, 1, strategies=only, process_bytes=process)
        assert row.fits is fits
    [gpu_only] = plan(c, 8, "bf16", 80 * GIB, GIB, 8, strategies={"zero2": STRATEGIES["zero2"]},
                      process_bytes=PROCESS_HOST_BYTES)
    assert gpu_only.fits


def test_zero3_pins_its_offloaded_gradients_one_sub_group_at_a_time():
    """ZeRO-3 pins the master weights' gradients as one block per sub-group, so each rounds up on its own, and the
    flat gradient partition as one block; the master weights and Adam's moments are not pinned. 6.74B parameters
    pinned took a 125 GiB host past its limit in the first step (74 GiB in use before it): the model says 119 GiB of
    states, 113 unpinned. A JSON's ``data_types.grad_accum_dtype`` sizes the flat partition."""
    from zerotrain.engines.states import Buckets as B

    c = ParamCounts(total=3000, trainable=3000, largest_layer=100, total_bytes=6000, trainable_bytes=6000)
    strategy = STRATEGIES["zero3_offload_optimizer"]
    cpu = model_state_memory(c, strategy, 1, "bf16", B(10, pin_memory=True, sub_group_size=1000)).cpu_bytes
    assert cpu == 4 * 3000 + 3 * 4096 + 8192 + 8 * 3000  # 4000-byte gradient groups in 4096-byte blocks; 6000 in 8192
    unpinned = model_state_memory(c, strategy, 1, "bf16", B(10, pin_memory=False, sub_group_size=1000)).cpu_bytes
    assert unpinned == (4 + 4 + 2 + 8) * 3000
    fp32_accum = B.from_ds_config({"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 3}})
    assert fp32_accum.grad_accum_element == 4 and B.from_ds_config({}).grad_accum_element is None
    assert model_state_memory(c, strategy, 1, "bf16", fp32_accum).cpu_bytes == (4 + 4 + 4 + 8) * 3000
    seven_b = ParamCounts(total=6_738_415_616, trainable=6_738_415_616, largest_layer=131_072_000,
                          total_bytes=2 * 6_738_415_616, trainable_bytes=2 * 6_738_415_616)
    gib = [model_state_memory(seven_b, strategy, 1, "bf16", B(pin_memory=pin)).cpu_bytes / 2**30 for pin in (True, False)]
    assert [round(g) for g in gib] == [119, 113]


def test_pinned_offload_partitions_round_up_to_a_power_of_two():
    """PyTorch's pinned-memory allocator rounds each block up to a power of two; DeepSpeed pins three of the
    four host copies of a ZeRO-1/2 offload partition (Adam's moments are not pinned)."""
    c = ParamCounts(total=1000, trainable=1000, largest_layer=100, total_bytes=4000, trainable_bytes=4000)
    pin = Buckets.from_ds_config({"zero_optimization": {"reduce_bucket_size": 10, "offload_optimizer":
                                                        {"device": "cpu", "pin_memory": True}}})
    assert pin.pin_memory and not Buckets.from_ds_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).pin_memory
    cpu = model_state_memory(c, STRATEGIES["zero2_offload"], 4, "bf16", pin).cpu_bytes
    assert cpu == 1024 + 1024 + 512 + 8 * 250
    # The 5.06B-parameter MLM of BENCHMARKS.md on one GPU: 32 + 32 + 16 GiB pinned, 37.7 GiB of moments
    big = ParamCounts(total=5_057_946_713, trainable=5_057_946_713, largest_layer=4096 * 16384,
                      total_bytes=4 * 5_057_946_713, trainable_bytes=4 * 5_057_946_713)
    cpu = model_state_memory(big, STRATEGIES["zero2_offload"], 1, "bf16", pin).cpu_bytes
    assert cpu == 80 * GIB + 8 * 5_057_946_713


def test_reduce_buckets_follow_the_deepspeed_config():
    """Two buckets with overlap_comm (stages 1-2), none without contiguous_gradients, read from the JSON."""
    c = ParamCounts(total=1000, trainable=1000, largest_layer=100, total_bytes=4000, trainable_bytes=4000)
    plain = model_state_memory(c, STRATEGIES["zero2"], 1, "bf16", Buckets(10)).gpu_bytes
    overlap = Buckets.from_ds_config({"zero_optimization": {"reduce_bucket_size": 10, "overlap_comm": True}})
    assert model_state_memory(c, STRATEGIES["zero2"], 1, "bf16", overlap).gpu_bytes == plain + 2 * 10
    assert model_state_memory(c, STRATEGIES["zero3"], 1, "bf16", overlap).gpu_bytes == (
        model_state_memory(c, STRATEGIES["zero3"], 1, "bf16", Buckets(10)).gpu_bytes)
    # DeepSpeed's ZeRO-1/2 keep contiguous gradients (and their bucket) under optimizer offload, whatever the JSON says.
    offloaded = {"zero_optimization": {"stage": 2, "contiguous_gradients": False, "offload_optimizer": {"device": "cpu"}}}
    assert Buckets.from_ds_config(offloaded).contiguous_gradients
    assert not Buckets.from_ds_config({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}).contiguous_gradients
    no_buffer = Buckets(10, contiguous_gradients=False)
    assert model_state_memory(c, STRATEGIES["zero2"], 1, "bf16", no_buffer).gpu_bytes == plain - 2 * 10


def test_lora_pays_for_frozen_weights_only_once():
    """1B frozen + 1M trainable: every stage needs the 16-bit weights; the optimizer barely counts."""
    c = ParamCounts(total=10**9, trainable=10**6, largest_layer=10**7, total_bytes=2 * 10**9 + 4 * 10**6,
                    trainable_bytes=4 * 10**6)
    zero0 = model_state_memory(c, STRATEGIES["zero0"], 1, "bf16").gpu_bytes
    assert zero0 == 2 * 10**9 + 18 * 10**6
    offload = model_state_memory(c, STRATEGIES["zero2_offload"], 1, "bf16")
    # offloading takes 18 MB off the GPU (the optimizer state and the adapters' gradients) for 18 MB on the
    # host (with a bf16 copy of the adapters): not worth its cost for LoRA
    assert (zero0 - offload.gpu_bytes + offload.bucket_bytes, offload.cpu_bytes) == (18 * 10**6, 18 * 10**6)


def test_the_planner_picks_the_first_strategy_that_fits():
    """Full training of 1B parameters on 8 GPUs of 16 GiB: DDP and ZeRO-0 need ~18.6 GiB; ZeRO-1 fits."""
    c = ParamCounts(total=10**9, trainable=10**9, largest_layer=10**8, total_bytes=4 * 10**9, trainable_bytes=4 * 10**9)
    rows = plan(c, world_size=8, precision="bf16", gpu_bytes=16 * GIB, host_bytes=512 * GIB, procs_per_host=8)
    assert [r.name for r in rows] == list(STRATEGIES)
    fits = {r.name: r.fits for r in rows}
    assert not fits["ddp"] and not fits["zero0"] and fits["zero1"]
    assert next(r.name for r in rows if r.fits) == "zero1"
    # Keeping 10 GiB for activations rules ZeRO-1 (6.5 GiB of states) out; ZeRO-2 (4.9 GiB) is next.
    rows = plan(c, 8, "bf16", 16 * GIB, 512 * GIB, procs_per_host=8, reserve_bytes=10 * GIB)
    assert next(r.name for r in rows if r.fits) == "zero2"
    # Host memory bounds the offloads: 8 processes x 2 GB of optimizer state do not fit in 8 GiB,
    # however much GPU memory there is; with 64 GiB of host memory they do.
    offloads = [name for name in STRATEGIES if name.endswith("_offload")]
    assert offloads, "no offload strategy to check"
    fits = {r.name: r.fits for r in plan(c, 8, "bf16", 100 * GIB, 8 * GIB, procs_per_host=8)}
    assert fits["zero2"] and not any(fits[name] for name in offloads)
    fits = {r.name: r.fits for r in plan(c, 8, "bf16", 100 * GIB, 64 * GIB, procs_per_host=8)}
    assert all(fits[name] for name in offloads)


def test_estimate_command_prints_the_table_and_a_pick(capsys):
    assert main(["estimate", "toy", "--gpu_memory_gib", "16", "--host_memory_gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "| zero3_offload |" in out and "Pick: ddp" in out and "--strategy.backend ddp" in out


def test_estimate_command_says_when_nothing_fits(capsys):
    assert main(["estimate", "toy", "--gpu_memory_gib", "1e-7", "--host_memory_gib", "1e-7"]) == 1
    assert "Nothing fits" in capsys.readouterr().out


def test_estimate_command_rejects_a_bad_flag(capsys):
    assert main(["estimate", "toy", "--strategy.zero_stage", "7"]) == 2
    assert "--strategy.zero_stage" in capsys.readouterr().err


def test_estimate_reads_a_pretrained_models_config_not_its_weights(tmp_path, tiny_tokenizer_dir, capsys):
    """A saved causal LM (the LoRA recipe's default --model.init pretrained) is sized from its config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"not read")  # proves the weights are not loaded
    n_params = sum(p.numel() for p in model.parameters())
    argv = ["estimate", "lora", "--model.name_or_path", str(tmp_path / "llama"), "--model.tokenizer",
            str(tiny_tokenizer_dir), "--data.train_path", "unused.jsonl", "--gpu_memory_gib", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    adapters = 8 * (32 + 32) * 2 * 2  # r x (in + out) for q_proj and v_proj in 2 layers: the defaults
    assert f"lora: {n_params + adapters:,} parameters, {adapters:,} trainable" in out and "Pick:" in out


def test_estimate_is_a_library_call_with_rows_and_a_pick():
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report
    from zerotrain.tasks.toy import ToyTask

    cfg = parse_config("toy", ["--launch.nproc_per_node", "2"])
    report = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64, reserve_gib=1)
    # NVMe offload only with a disk to offload to (--strategy.nvme_path)
    assert [row.name for row in report.rows] == [name for name in STRATEGIES if name != "zero3_nvme"]
    assert report.pick == "ddp" and report.world_size == 2 and report.precision == "bf16"
    assert report.counts.total == sum(p.numel() for p in ToyTask(cfg).build_model().parameters())
    assert report.gpu_bytes == 16 * GIB and report.host_bytes == 64 * GIB and report.reserve_bytes == GIB
    # The caller's config is left as it was (estimate fills max_steps and resolves auto on a copy).
    assert cfg.trainer.max_steps is None and cfg.precision.dtype == "auto"
    text = format_report(report)
    assert text.splitlines()[0].startswith("toy: ") and "| zero3_offload |" in text and "Pick: ddp" in text


def test_estimate_sizes_each_strategy_from_the_deepspeed_json_it_would_run_with():
    """ZeRO-0 in bf16 runs under DeepSpeed's autocast (fp32 weights, as the plain engine) and ZeRO-1
    with optimizer offload keeps its reduce bucket (contiguous gradients), whatever strategy the flags name."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate

    cfg = parse_config("toy", ["--precision.dtype", "bf16", "--strategy.zero_stage", "3",
                               "--strategy.reduce_bucket_size", "1000000"])
    rows = {row.name: row.memory for row in estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64).rows}
    assert rows["zero0"].gpu_bytes == rows["ddp"].gpu_bytes
    assert rows["zero1_offload"].bucket_bytes == 2 * 1_000_000 and rows["zero0"].bucket_bytes == 0


def test_estimate_sizes_every_row_when_a_users_json_pins_what_a_strategy_would_change(tmp_path):
    """"stage": "auto" next to an optimizer offload is valid for the user's ZeRO-2 but not for the ZeRO-0
    row: that row is sized from the user's JSON rather than failing the whole estimate."""
    import json

    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}}}))
    cfg = parse_config("toy", ["--strategy.backend", "deepspeed", "--strategy.zero_stage", "2",
                               "--strategy.deepspeed_config", str(ds)])
    report = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64)
    # FSDP2 does not read a DeepSpeed file: its rows are left out
    assert [row.name for row in report.rows] == [n for n in STRATEGIES if n != "zero3_nvme"
                                                 and not n.startswith("fsdp2")] and report.pick is not None


def test_estimate_without_known_gpu_memory_judges_nothing(monkeypatch, capsys):
    import zerotrain.plan.estimate

    monkeypatch.setattr(zerotrain.plan.estimate, "gpu_memory_bytes", lambda: None)
    assert main(["estimate", "toy", "--host_memory_gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory unknown (no GPU here: pass --gpu_memory_gib)" in out and "| ddp |" in out and "| ? |" in out
    assert "Pick" not in out and "Nothing fits" not in out


@pytest.mark.parametrize("flag,value", [("--gpu_memory_gib", "-3"), ("--gpu_memory_gib", "0"),
                                        ("--host_memory_gib", "0"), ("--reserve_gib", "-1")])
def test_estimate_refuses_a_memory_size_that_is_not_one(capsys, flag, value):
    assert main(["estimate", "toy", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"zerotrain estimate: error: {flag} must be a number {'>=' if flag == '--reserve_gib' else '>'} 0 (GiB), "
        f"got {float(value):g}"]


@pytest.mark.slow  # a fresh python process (run_python)
def test_estimate_does_not_import_the_fit_command(tmp_path):
    from helpers import run_python

    code = ("import sys, zerotrain.cli.estimate, zerotrain.plan.estimate\n"
            "print(sorted(m for m in sys.modules if m.startswith('zerotrain.cli.')))")
    out = run_python(["-c", code], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['zerotrain.cli.estimate']"


def test_nvme_offload_puts_the_states_on_disk_and_swap_buffers_on_the_host():
    """ZeRO-Infinity: Adam's 16 bytes a parameter and the bf16 weights go to the NVMe disk; the host keeps
    DeepSpeed's pinned swap buffers (one fp32 sub-group per optimizer buffer, buffer_size elements per
    parameter buffer), not the states, as it would under CPU offload."""
    c = ParamCounts(total=10**10, trainable=10**10, largest_layer=10**8, total_bytes=2 * 10**10,
                    trainable_bytes=2 * 10**10, largest_trainable=10**8)
    nvme = STRATEGIES["zero3_offload"].__class__("deepspeed", 3, offload_optimizer="nvme", offload_param="nvme")
    cpu = model_state_memory(c, STRATEGIES["zero3_offload"], 1, "bf16")
    disk = model_state_memory(c, nvme, 1, "bf16")
    assert cpu.nvme_bytes == 0 and cpu.cpu_bytes == 16 * 10**10 + 2 * 10**10 + 2 * 10**10
    assert disk.nvme_bytes == 16 * 10**10 + 2 * 10**10
    # 4 buffers x 1e9-element sub-groups x fp32; the bf16 gradient partition; 5 x 1e8 x bf16 weight buffers
    assert disk.cpu_bytes == 4 * 4 * 10**9 + 2 * 10**10 + 5 * 10**8 * 2
    assert disk.gpu_bytes == cpu.gpu_bytes  # the GPU side is the same
    small = Buckets.from_ds_config({"zero_optimization": {"sub_group_size": 10**8, "offload_optimizer": {
        "device": "nvme", "buffer_count": 6}, "offload_param": {"device": "nvme", "buffer_count": 3, "buffer_size": 10**7}}})
    assert model_state_memory(c, nvme, 1, "bf16", small).cpu_bytes == 6 * 4 * 10**8 + 2 * 10**10 + 3 * 10**7 * 2
    pinned = Buckets(pin_memory=True)  # the gradient partition pinned: a power of two
    assert model_state_memory(c, nvme, 1, "bf16", pinned).cpu_bytes == 4 * 4 * 10**9 + 2**35 + 5 * 10**8 * 2
    # On two GPUs each process holds half the states on disk; a sub-group is never more than a partition.
    tiny = ParamCounts(total=1000, trainable=1000, largest_layer=100, total_bytes=2000, trainable_bytes=2000)
    two = model_state_memory(tiny, nvme, 2, "bf16")
    assert two.nvme_bytes == (16 * 1000 + 2 * 1000) / 2 and two.cpu_bytes == 4 * 4 * 500 + 2 * 500 + 5 * 10**8 * 2


def test_estimate_shows_a_configured_nvme_offload_with_its_disk(tmp_path, capsys):
    args = ["estimate", "toy", "--gpu_memory_gib", "16", "--host_memory_gib", "64", "--strategy.zero_stage", "3",
            "--strategy.offload_optimizer", "nvme", "--strategy.offload_param", "nvme",
            "--strategy.nvme_path", str(tmp_path / "swap")]
    assert main(args) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| zero3_nvme |"))
    assert "on NVMe per process (GiB)" in out and row.endswith(" yes |")


def test_an_nvme_offload_that_outgrows_its_disk_does_not_fit(monkeypatch, tmp_path):
    from zerotrain.plan import estimate as estimate_mod
    from zerotrain.config.flags import parse_config

    cfg = parse_config("toy", ["--strategy.zero_stage", "3", "--strategy.offload_optimizer", "nvme",
                               "--strategy.nvme_path", str(tmp_path)])
    roomy = estimate_mod.estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64)
    monkeypatch.setattr(estimate_mod, "_free_disk", lambda folder: 10.0)  # bytes: less than the toy's states
    full = estimate_mod.estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64)
    assert roomy.rows[-1].name == full.rows[-1].name == "yours: zero3 nvme"  # optimizer on NVMe, weights on the GPU: not a candidate
    assert roomy.rows[-1].memory.nvme_bytes > 10 and roomy.rows[-1].fits and not full.rows[-1].fits


def test_estimate_picks_a_configured_nvme_offload_when_it_alone_fits(tmp_path):
    """When only the NVMe row fits (no GPU nor host room for the others), it is the pick, printed with the
    flags that select it."""
    import dataclasses

    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report

    cfg = parse_config("toy", ["--strategy.zero_stage", "3", "--strategy.offload_optimizer", "nvme",
                               "--strategy.offload_param", "nvme", "--strategy.nvme_path", str(tmp_path)])
    report = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64)
    only_nvme = [dataclasses.replace(row, fits=row.name == "zero3_nvme") for row in report.rows]
    report = dataclasses.replace(report, rows=only_nvme)
    assert report.pick == "zero3_nvme"
    text = format_report(report)
    assert "Pick: zero3_nvme" in text and "--strategy.offload_optimizer nvme --strategy.offload_param nvme" in text


def test_estimate_sizes_unpinned_offload_without_the_power_of_two():
    """--strategy.offload_pin_memory false: the offloaded ZeRO-2 states are their bytes (fp32 master and
    gradients, the bf16 copy, both moments: 18 a parameter), not rounded up to pinned blocks; rows
    without an offload are unchanged."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate

    def rows(pin):
        cfg = parse_config("toy", ["--strategy.offload_pin_memory", pin])
        return {row.name: row.memory for row in estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=64).rows}

    pinned, unpinned = rows("true"), rows("false")
    n = count_toy_trainable()
    assert unpinned["zero2_offload"].cpu_bytes == 18 * n
    assert pinned["zero2_offload"].cpu_bytes > unpinned["zero2_offload"].cpu_bytes
    assert pinned["zero2"] == unpinned["zero2"]


def count_toy_trainable():
    from zerotrain.tasks import registry as recipes
    from zerotrain.config.flags import parse_config
    from zerotrain.engines.states import count_params

    with torch.device("meta"):
        model = recipes.get("toy")(parse_config("toy", [])).build_model(pretrained=False)
    return count_params(model).trainable


def test_estimate_names_the_unpinned_offload_when_nothing_fits_pinned():
    """A 1.1B toy on a 5 GiB GPU and a 26 GiB host: only ZeRO-2 offload fits the GPU, and its host states
    fit only unpinned (28.5 GiB pinned, 19.1 GiB not, each beside the process's own 6 GiB). The report says so
    with the flags; a config that pins the offload itself gets the plain 'nothing fits'."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report

    def report(*flags):
        cfg = parse_config("toy", ["--model.width", str(2**26), *flags])
        return estimate("toy", cfg, gpu_memory_gib=5, host_memory_gib=26)

    default = report()
    assert default.pick is None and default.unpinned is not None and default.unpinned.name == "zero2_offload"
    text = format_report(default)
    assert "Nothing fits pinned" in text and "--strategy.offload_pin_memory false" in text
    pinned = report("--strategy.offload_pin_memory", "true")
    assert pinned.pick is None and pinned.unpinned is None and "Nothing fits:" in format_report(pinned)


def test_estimate_with_a_users_file_does_not_retry_unpinned(tmp_path):
    """With --strategy.deepspeed_config the file decides pinning: no unpinned re-estimate (which would set a
    flag the file contradicts and fail on it), the plain 'nothing fits'."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report

    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}}}')
    cfg = parse_config("toy", ["--model.width", str(2**26), "--strategy.deepspeed_config", str(path)])
    report = estimate("toy", cfg, gpu_memory_gib=5, host_memory_gib=20)
    assert report.pick is None and report.unpinned is None and "Nothing fits:" in format_report(report)


def test_the_unpinned_alternative_can_be_a_configured_nvme_offload(tmp_path, monkeypatch):
    """ZeRO-3 with NVMe offload keeps the flat gradient partition on the host, pinned by default: a 9B toy on an
    80 GiB host fits only unpinned, and the report names that row (not among the built-in strategies). (Its one
    4.8B-element parameter also sizes the weights' five swap buffers, about 45 GiB of the host.)"""
    from zerotrain.plan import estimate as estimate_mod
    from zerotrain.config.flags import parse_config

    monkeypatch.setattr(estimate_mod, "_free_disk", lambda folder: 1e15)
    cfg = parse_config("toy", ["--model.width", str(2**29), "--strategy.zero_stage", "3",
                               "--strategy.offload_optimizer", "nvme", "--strategy.offload_param", "nvme",
                               "--strategy.nvme_path", str(tmp_path)])
    report = estimate_mod.estimate("toy", cfg, gpu_memory_gib=80, host_memory_gib=80)
    assert report.pick is None and report.unpinned is not None and report.unpinned.name == "zero3_nvme"
    line = estimate_mod.format_report(report).splitlines()[-1]
    assert "--strategy.offload_optimizer nvme" in line and line.endswith("--strategy.offload_pin_memory false")


@pytest.mark.parametrize("bf16, optimizer, host", [({}, 16, 18), ({"bf16_master_weights_and_grads": True}, 12, 14),
                                                   ({"bf16_master_weights_and_grads": True,
                                                     "bf16_optimizer_states": True}, 8, 10)])
def test_bf16_master_weights_and_optimizer_states_in_bytes_per_parameter(bf16, optimizer, host):
    """Adam in bf16: fp32 master weights, gradients and moments are 16 bytes a parameter; bf16 master weights (and
    their gradients) 12; bf16 moments too 8. Offloaded under ZeRO-2 the host holds those plus a bf16 copy."""
    psi = 10**6
    c = ParamCounts(total=psi, trainable=psi, largest_layer=psi, total_bytes=2 * psi, trainable_bytes=2 * psi,
                    largest_trainable=psi)
    ds = {"bf16": {"enabled": True, **bf16}, "zero_optimization": {"stage": 1, "reduce_bucket_size": 10}}
    buckets = Buckets.from_ds_config(ds)
    zero1 = model_state_memory(c, STRATEGIES["zero1"], 1, "bf16", buckets)
    assert zero1.gpu_bytes == (2 + 2 + optimizer) * psi + 2 * 10
    ds["zero_optimization"].update(stage=2, offload_optimizer={"device": "cpu", "pin_memory": False})
    offload = model_state_memory(c, STRATEGIES["zero2_offload"], 1, "bf16", Buckets.from_ds_config(ds))
    assert offload.cpu_bytes == host * psi
    ds["zero_optimization"]["stage"] = 0  # no ZeRO optimizer: DeepSpeed keeps no master weights of its own
    assert Buckets.from_ds_config(ds).master_element == 4


def test_estimate_sizes_bf16_states():
    """`zerotrain estimate` with bf16 master weights and moments: its ZeRO rows hold 8 bytes a trainable parameter
    fewer than with fp32 ones (the toy model here; the same arithmetic lets a larger model fit), and the stages
    that cannot keep them are not offered."""
    from zerotrain.config import PrecisionConfig, StrategyConfig
    from zerotrain.plan.estimate import estimate
    from zerotrain.tasks.toy import ToyConfig

    reports = [estimate("toy", ToyConfig(strategy=StrategyConfig(zero_stage=1),
                                         precision=PrecisionConfig(dtype="bf16", master_weights=low,
                                                                   optimizer_states=low)), 16, 64)
               for low in ("fp32", "bf16")]
    rows = [{row.name: row.memory for row in report.rows} for report in reports]
    trainable = reports[0].counts.trainable
    for name in ("zero1", "zero2", "zero3"):
        assert rows[0][name].gpu_bytes - rows[1][name].gpu_bytes == 8 * trainable, name
    assert "zero0" in rows[0] and "zero0" not in rows[1]  # DeepSpeed keeps bf16 states under ZeRO 1-3 only


def test_estimate_names_the_nvme_disk_when_nothing_else_fits(tmp_path, capsys):
    """Without --strategy.nvme_path, a model that fits neither GPU nor host is pointed at a disk; with it, the
    zero3_nvme row shows what it puts there and the report the free space beside it."""
    tight = ["estimate", "toy", "--gpu_memory_gib", "1e-7", "--host_memory_gib", "1e-7"]
    assert main(tight) == 1
    assert "Nothing fits: put the weights and optimizer states on a fast local disk (--strategy.nvme_path DIR" \
        in capsys.readouterr().out
    main(tight + ["--strategy.nvme_path", str(tmp_path / "swap")])
    out = capsys.readouterr().out
    assert "| zero3_nvme |" in out and "on NVMe per process (GiB)" in out
    assert f"GiB free on the disk of {tmp_path / 'swap'} (--strategy.nvme_path)" in out
    assert "--strategy.nvme_path DIR" not in out


def test_a_model_built_partitioned_under_zero3_never_sits_whole_on_the_host():
    """The host's peak counts the model as the recipe builds it on the CPU, except under ZeRO-3 for a recipe that
    builds it partitioned (its probe says so): no host holds it whole then. Other engines build it whole."""
    import dataclasses

    from helpers import fake_probe

    from zerotrain.plan.memory import GIB, predict

    counts = ParamCounts(total=10**9, trainable=10**9, largest_layer=10**7, total_bytes=4 * 10**9,
                         trainable_bytes=4 * 10**9, tensors=200)
    probe = dataclasses.replace(fake_probe(), host_before_model_bytes=1 * GIB)

    def host(strategy: str, partitioned) -> float:
        p = dataclasses.replace(probe, builds_partitioned=partitioned)
        return predict(counts, STRATEGIES[strategy], 8, False, 1, "bf16", p).host_bytes

    assert host("zero3", True) == pytest.approx(2 * GIB)  # the process as probed, nothing built whole
    assert host("zero3", None) == host("zero3", False) == pytest.approx(1 * GIB + 4e9)  # an older probe: held
    assert host("zero2", True) == host("fsdp2", True) == pytest.approx(1 * GIB + 4e9)
    assert host("zero3_offload", False) - host("zero3_offload", True) == pytest.approx(1 * GIB + 4e9 - 2 * GIB)


@pytest.mark.parametrize("init, lora, partitioned", [
    ("random", False, True), ("random", True, False), ("pretrained", True, True), ("pretrained", False, True)])
def test_which_causal_lm_builds_are_partitioned_under_zero3(init, lora, partitioned):
    """What the memory model reads: pretrained weights are read into the partitions; a random init is built
    partitioned unless LoRA draws its weights again (whole) after the build."""
    from zerotrain.tasks.causal_lm import CausalLMConfig, CausalLMTask

    cfg = CausalLMConfig()
    cfg.model.init, cfg.model.lora.r = init, 4 if lora else 0
    assert CausalLMTask(cfg).builds_partitioned() is partitioned


def test_the_other_recipes_say_how_they_build_under_zero3():
    """LoRA's own recipe reads a pretrained base into the partitions; the MLM's own encoder is built whole, a
    Hugging Face masked LM partitioned; a classifier is a Hugging Face model."""
    from zerotrain.tasks.classify import ClassifyConfig, ClassifyTask
    from zerotrain.tasks.lora import LoRAConfig, LoRATask
    from zerotrain.tasks.mlm import MLMConfig, MLMTask
    from zerotrain.tasks.toy import ToyConfig, ToyTask

    assert LoRATask(LoRAConfig()).builds_partitioned() is True
    own, hf_mlm = MLMConfig(), MLMConfig()
    hf_mlm.model.name_or_path = "roberta-base"
    assert (MLMTask(own).builds_partitioned(), MLMTask(hf_mlm).builds_partitioned()) == (False, True)
    assert ClassifyTask(ClassifyConfig()).builds_partitioned() is True
    assert ToyTask(ToyConfig()).builds_partitioned() is False  # the default: counted whole, the safe side


def test_zero3_keeps_the_first_sub_groups_of_a_shared_optimizer_on_the_gpu():
    """``offload_optimizer.ratio`` 0.5 of three sub-groups keeps int(0.5 x 3) = 1 on the GPU: its fp32 master weights,
    gradients and Adam's two moments (16 bytes a parameter) and the scratch of the GPU's AdamW step (one sub-group
    in fp32) move there; the flat bf16 gradient partition stays whole on the host."""
    from zerotrain.engines.states import Buckets as B

    c = ParamCounts(total=3000, trainable=3000, largest_layer=100, total_bytes=6000, trainable_bytes=6000)
    strategy = STRATEGIES["zero3_offload_optimizer"]
    whole = model_state_memory(c, strategy, 1, "bf16", B(10, sub_group_size=1000))
    shared = model_state_memory(c, strategy, 1, "bf16", B(10, sub_group_size=1000, optimizer_on_host=0.5))
    assert whole.cpu_bytes - shared.cpu_bytes == 16 * 1000
    assert shared.gpu_bytes - whole.gpu_bytes == 16 * 1000 + 4 * 1000
    assert shared.cpu_bytes == (4 + 4 + 8) * 2000 + 2 * 3000
    on_gpu = model_state_memory(c, strategy, 1, "bf16", B(10, sub_group_size=1000, optimizer_on_host=0.0))
    assert on_gpu.cpu_bytes == 2 * 3000 and on_gpu.gpu_bytes - whole.gpu_bytes == 16 * 3000 + 4 * 1000
    zero3 = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}
    assert B.from_ds_config({"zero_optimization": zero3}).optimizer_on_host == 0.25
    for other in ({**zero3, "stage": 2}, {**zero3, "offload_optimizer": {"device": "nvme", "ratio": 0.25}}):
        assert B.from_ds_config({"zero_optimization": other}).optimizer_on_host == 1.0  # DeepSpeed splits neither


def test_estimate_proposes_part_of_the_optimizer_on_the_gpu_where_nothing_else_fits():
    """A 1.1B toy on a 16 GiB GPU: ZeRO-3 keeps too much on the GPU, its optimizer offload too much on the host (24.8
    GiB), pinned or not. Its tensors make three sub-groups (537M, 604M and 8 elements: a group closes once it holds
    1e8 or more): the shares 0.95 to 0.7 keep none on the GPU, 0.65 to 0.35 the first, one layout named by its
    highest share. It fits a 20 GiB host unpinned only, and the flags say so; on a 22 GiB host, pinned; on a 26 GiB
    host it is named beside ZeRO-1's whole optimizer unpinned. A share the user set, or bf16 master weights (which the
    split does not take), are not searched."""
    from zerotrain.config.flags import parse_config
    from zerotrain.plan.estimate import estimate, format_report

    cfg = parse_config("toy", ["--model.width", str(2**26)])
    assert estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=16).shared == []
    report = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=20)
    assert report.pick is None and report.unpinned is None
    assert [(share, loose) for share, loose, _ in report.shared] == [(0.65, True)]
    _, _, row = report.shared[-1]
    assert row.name == "zero3_offload_optimizer" and row.fits
    assert row.memory.gpu_bytes < 16 * GIB and row.memory.cpu_bytes + 6 * GIB < 20 * GIB
    line = format_report(report).splitlines()[-1]
    assert line.endswith("--strategy.offload_optimizer_ratio 0.65 --strategy.offload_pin_memory false")
    roomier = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=22)
    assert [(share, loose) for share, loose, _ in roomier.shared] == [(0.65, False)]
    assert format_report(roomier).splitlines()[-1].endswith("--strategy.offload_optimizer_ratio 0.65")
    # Where the whole optimizer fits the host unpinned only, the pinned share is named beside it: plan measures which
    both = estimate("toy", cfg, gpu_memory_gib=16, host_memory_gib=26)
    assert both.unpinned.name == "zero1_offload" and [(s, loose) for s, loose, _ in both.shared] == [(0.65, False)]
    unpinned_line, share_line = format_report(both).splitlines()[-2:]
    assert unpinned_line.endswith("--strategy.offload_pin_memory false") and share_line.startswith("Or, with part")
    assert share_line.endswith("--strategy.offload_optimizer_ratio 0.65")
    set_by_user = parse_config("toy", ["--model.width", str(2**26), "--strategy.zero_stage", "3",
                                       "--strategy.offload_optimizer", "cpu", "--strategy.offload_optimizer_ratio", "0.9"])
    again = estimate("toy", set_by_user, gpu_memory_gib=16, host_memory_gib=16)
    assert again.shared == [] and "Nothing fits:" in format_report(again)
    bf16_master = parse_config("toy", ["--model.width", str(2**26), "--precision.dtype", "bf16", "--strategy.zero_stage", "2",
                                       "--precision.master_weights", "bf16", "--precision.optimizer_states", "bf16"])
    nothing = estimate("toy", bf16_master, gpu_memory_gib=6, host_memory_gib=12)  # fits nowhere, not even unpinned
    assert nothing.pick is None and nothing.unpinned is None and nothing.shared == []


def test_zero3_cuts_sub_groups_as_deepspeed_does_closing_each_at_its_size_or_more():
    """DeepSpeed 0.19's _create_fp16_sub_groups adds each rank's share of the tensors in order and closes a group once
    it holds sub_group_size elements or more: groups overshoot by up to a tensor, and the rest forms a last one."""
    from zerotrain.engines.states import sub_groups

    assert sub_groups(0, (60, 60, 60, 50, 10), 1, 100) == [120, 110, 10]
    assert sub_groups(0, (60, 60, 61), 2, 50) == [60, 31]  # ceil(61 / 2): each rank's share
    assert sub_groups(0, (30, 30), 1, 100) == [60]
    assert sub_groups(300, (), 1, 100) == [100, 100, 100]  # without sizes: equal groups
