"""Host ms of backward + step, one-rank ZeRO-1/2, with the flat epilogue of flat_epilogue.patch on and off in turns.

    git apply benchmarks/results/cpu/session25/flat_epilogue.patch
    PYTHONPATH=src python benchmarks/results/cpu/session25/flat_epilogue_host.py STAGE
"""
import os, sys, time, statistics
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29562", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import torch, deepspeed
from zerotrain.engines.ds_private import zero_host
from zerotrain.engines.ds_private.zero_clip import clip_without_sync, mask_norms_without_sync
torch.set_num_threads(1)
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(40)])
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True, "check_grad_overflow": False},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "timers": {"throughput": {"enabled": False}},
       "zero_optimization": {"stage": stage, "contiguous_gradients": False, "overlap_comm": False}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
opt = engine.optimizer
mask_norms_without_sync(True); clip_without_sync(opt); zero_host.norm_in_one_launch(opt); zero_host.rebind_only_moved_weights(opt)
assert zero_host.skip_one_rank_reduction(opt)
flat = {k: opt.__dict__[k] for k in ("reduce_gradients", "overlapping_partition_gradients_reduce_epilogue") if k in opt.__dict__}
assert flat, "zero_host.py without the flat epilogue: apply flat_epilogue.patch (this folder) first"
x = torch.randn(4, 16, dtype=torch.bfloat16)
res = {"old": [], "new": []}
def run(n):
    ts = []
    for i in range(n):
        loss = engine(x).float().pow(2).mean()
        t0 = time.perf_counter()
        engine.backward(loss)
        engine.step()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts
run(50)
for b in range(16):
    for m in (("old", "new") if b % 2 else ("new", "old")):
        if m == "old":
            for k in flat: opt.__dict__.pop(k, None)
        else:
            opt.__dict__.update(flat)
        res[m].append(statistics.median(run(100)))
print(stage, {m: round(statistics.median(v), 3) for m, v in res.items()}, "pairs new<old:", sum(n < o for n, o in zip(res["new"], res["old"])), "/16")
