"""The typed configuration tree of a zerotrain run.

Every recipe's config is a :class:`RunConfig` subclass that adds its own ``model`` and ``data``
sections; the shared sections (optimizer, scheduler, strategy, precision, compile, activation_checkpointing,
launch) are the same for every task. The CLI is generated from these dataclasses by jsonargparse,
so the docstring under each field is its ``--help`` text, and precedence is
defaults < ``--config FILE`` < command-line flags.

Validation lives here, next to the fields: :meth:`RunConfig.validate` raises
:class:`~zerotrain.errors.ConfigError` with the flag name (``--strategy.zero_stage``) and what to do.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional

from zerotrain.engines import optimizers
from zerotrain.errors import ConfigError, UserError

Precision = Literal["auto", "fp32", "fp16", "bf16"]
OffloadDevice = Literal["none", "cpu", "nvme"]


ALL_SAFE = frozenset({"*"})
"""A section's ``resume_safe`` that admits a change of any of its settings on resume."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """adamw (default), adam, sgd, adagrad, or a torch.optim.Optimizer class path (torch.optim.RMSprop, my_package.module:MyOptimizer). DeepSpeed runs Adam as FusedAdam on GPU, DeepSpeedCPUAdam under CPU offload."""
    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Weight decay."""
    momentum: float = 0.0
    """SGD momentum (sgd, or a class path that takes it); 0 keeps no momentum buffer."""

    def validate(self) -> None:
        if optimizers.kind(self.name) is None:  # a class path: that it imports and is an optimizer
            optimizers.resolve_class(self.name)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("--optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.lr <= 0:
            raise ConfigError("--optimizer.lr", f"must be > 0, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("--optimizer.betas", f"both betas must be in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            raise ConfigError("--optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if not self.eps > 0:
            raise ConfigError("--optimizer.eps", f"must be > 0 (e.g. 1e-8), got {self.eps}")


@dataclass
class SchedulerConfig:
    name: Literal["constant", "warmup_linear", "cosine", "step"] = "constant"
    """Learning-rate schedule: constant (after warm-up), linear warm-up then linear decay to 0, cosine decay to min_lr_ratio, or StepLR."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Cosine schedule: final learning rate as a fraction of the peak."""
    gamma: float = 0.1
    """StepLR: multiply the learning rate by gamma every step_size units."""
    step_size: int = 1
    """StepLR: how many step_units between two decays."""
    step_unit: Literal["epochs", "steps"] = "epochs"
    """StepLR: whether step_size counts epochs (as torch's StepLR stepped per epoch) or optimizer steps."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError("--scheduler.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("--scheduler.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.step_size < 1:
            raise ConfigError("--scheduler.step_size", f"must be >= 1, got {self.step_size}")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError("--scheduler.gamma", f"must be in (0, 1], got {self.gamma}")


@dataclass
class StrategyConfig:
    """How the model is distributed: backend, ZeRO stage, offloads, buckets, accumulation, clipping."""

    resume_safe = frozenset({"nvme_path", "offload_pin_memory", "overlap_comm", "contiguous_gradients",
                             "reduce_bucket_size", "allgather_bucket_size", "auto", "deepspeed_config",
                             "gradient_accumulation_steps", "reshard_after_forward", "backend", "zero_stage"})
    """Settings a resume may change (see :func:`resume_changes`): where and how fast, not what is computed. A
    DeepSpeed file is compared by what it sets (recorded in hparams.json), not by its path; accumulation with
    the micro-batch by the checkpoint, which keeps the global batch; the backend and ZeRO stage by the
    checkpoint too, which admits only the crossings an engine can load (``checkpoint.manager.check_compatible``)."""

    backend: Literal["deepspeed", "ddp", "fsdp2"] = "deepspeed"
    """deepspeed (ZeRO), plain PyTorch DDP (the baseline 'without DeepSpeed'), or fsdp2: PyTorch's fully_shard on each transformer block and the root (parameters, gradients and optimizer states sharded, as ZeRO-3)."""
    zero_stage: int = 0
    """ZeRO stage: 0 (off), 1 (optimizer states), 2 (+gradients), 3 (+parameters) partitioned across data-parallel ranks."""
    offload_optimizer: OffloadDevice = "none"
    """Keep optimizer states (and run the optimizer step) on cpu or nvme. Needs zero_stage >= 1 (nvme: stage 3)."""
    offload_optimizer_ratio: float = 1.0
    """With offload_optimizer cpu at zero_stage 3: the share of the optimizer kept on the host (its fp32 master weights, their gradients and its states, and their update); the rest stays on the GPU and steps there. Below 1 it trains models whose optimizer outgrows the host, in the GPU memory the weights and activations leave (DeepSpeed's offload_optimizer.ratio, counted in sub-groups of the optimizer; `zerotrain estimate` proposes a value where nothing else fits). Needs --optimizer.name adamw, fp32 master weights, and the weights on the GPU or the cpu. A resume keeps the run's value."""
    offload_param: OffloadDevice = "none"
    """Keep parameters on cpu or nvme between uses. Needs zero_stage 3."""
    nvme_path: Optional[str] = None
    """Folder on a fast local disk for nvme offload (required when an offload is nvme)."""
    offload_pin_memory: Optional[bool] = None
    """Pin the offloaded states in host memory (DeepSpeed's ``pin_memory``); default: on GPUs. PyTorch rounds each
    pinned block up to a power of two, so pinning can take up to twice the host memory: false trades faster
    host-GPU copies for up to half the host memory (``zerotrain estimate`` sizes either).
    Without an offload it does nothing."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    overlap_comm: bool = False
    """ZeRO: overlap gradient reduction with the backward pass (uses more memory for buckets)."""
    contiguous_gradients: bool = True
    """ZeRO: copy gradients into one contiguous buffer as they are produced (less fragmentation). The fast
    path turns it off at stages 1-2 without optimizer offload (same results, less host time a step)."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO: elements reduced at once."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO 1/2: elements all-gathered at once."""
    fast_path: bool = True
    """DeepSpeed settings that remove host overhead without changing the math (see zerotrain.config.ds_config.fast_path); false keeps DeepSpeed's defaults, to compare."""
    auto: bool = False
    """Plan first (as `zerotrain plan` does: measure, predict, try the best few for a few seconds each) and train with the fastest configuration that fits: backend, ZeRO stage, offload, micro-batch and accumulation (same global batch), activation checkpointing. The plan is kept under <output_dir>/.plans and reused on this machine until the flags or the versions of torch, DeepSpeed or zerotrain change."""
    reshard_after_forward: bool = True
    """fsdp2: free each block's gathered parameters after its forward and gather them again for its backward (ZeRO-3's memory); false keeps them from forward to backward (one all-gather fewer a step, the whole model's 16-bit parameters held at the forward's end)."""
    deepspeed_config: Optional[str] = None
    """A DeepSpeed JSON/HJSON file of your own. Its "auto" values are filled from this config; explicit values win and are checked."""

    def unused_flags(self) -> list[str]:
        """The flags set away from their defaults that :attr:`backend` does not read: another engine's settings
        (DeepSpeed's buckets and fast path under fsdp2 or ddp, fsdp2's resharding elsewhere), said in the log."""
        deepspeed = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "fast_path")
        fsdp2 = ("reshard_after_forward",)
        other = {"deepspeed": fsdp2, "fsdp2": deepspeed}.get(self.backend, deepspeed + fsdp2)
        defaults = {f.name: f.default for f in fields(self)}
        return [f"--strategy.{name}" for name in other if getattr(self, name) != defaults[name]]

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("--strategy.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        if not 0.0 <= self.offload_optimizer_ratio <= 1.0:
            raise ConfigError("--strategy.offload_optimizer_ratio",
                              f"must be in [0, 1] (the optimizer's share on the host), got {self.offload_optimizer_ratio}")
        if self.offload_optimizer_ratio < 1.0 and self.backend != "deepspeed":
            raise ConfigError("--strategy.offload_optimizer_ratio", f"is DeepSpeed's (ZeRO-3 with the optimizer on the "
                              f"cpu); --strategy.backend {self.backend} has no such split: leave it at 1, or use "
                              "--strategy.backend deepspeed")
        if self.backend == "ddp":
            if self.zero_stage or self.offload_optimizer != "none" or self.offload_param != "none":
                raise ConfigError(
                    "--strategy.backend",
                    "ddp is plain PyTorch: it has no ZeRO stages or offload. "
                    "Use --strategy.backend deepspeed, or drop --strategy.zero_stage/--strategy.offload_*",
                )
            if self.deepspeed_config:
                raise ConfigError("--strategy.deepspeed_config", "is only read with --strategy.backend deepspeed")
        if self.backend == "fsdp2":
            if self.zero_stage:
                raise ConfigError("--strategy.zero_stage", "is DeepSpeed's; fsdp2 always shards parameters, gradients "
                                  "and optimizer states. Drop --strategy.zero_stage, or use --strategy.backend deepspeed")
            if "nvme" in (self.offload_optimizer, self.offload_param):
                flag = "--strategy.offload_optimizer" if self.offload_optimizer == "nvme" else "--strategy.offload_param"
                raise ConfigError(flag, "fsdp2 offloads to cpu only (nvme is DeepSpeed's "
                                  "ZeRO-Infinity): pass cpu, or --strategy.backend deepspeed --strategy.zero_stage 3")
            if self.auto:
                raise ConfigError("--strategy.auto", "chooses the backend itself (DeepSpeed, plain PyTorch or fsdp2): "
                                  "drop one of --strategy.auto and --strategy.backend fsdp2")
            if self.deepspeed_config:
                raise ConfigError("--strategy.deepspeed_config", "is only read with --strategy.backend deepspeed")
            return self._validate_common()
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ConfigError(
                "--strategy.offload_param",
                f"parameter offload needs ZeRO stage 3, but --strategy.zero_stage is {self.zero_stage}. "
                "Use --strategy.zero_stage 3, or --strategy.offload_optimizer alone",
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ConfigError(
                "--strategy.offload_optimizer",
                "optimizer offload needs ZeRO stage 1, 2 or 3. Set --strategy.zero_stage",
            )
        if self.offload_optimizer_ratio < 1.0 and not self.deepspeed_config and (
                self.zero_stage != 3 or self.offload_optimizer != "cpu"):  # a file decides, checked once resolved
            raise ConfigError("--strategy.offload_optimizer_ratio",
                              f"{self.offload_optimizer_ratio} splits the optimizer between the host and the GPU, which "
                              "DeepSpeed does at ZeRO-3 with the optimizer on the cpu only: pass --strategy.zero_stage 3 "
                              "--strategy.offload_optimizer cpu, or leave the ratio at 1")
        if self.offload_optimizer_ratio < 1.0 and self.offload_param == "nvme":
            raise ConfigError("--strategy.offload_optimizer_ratio", "below 1 beside --strategy.offload_param nvme, "
                              "which DeepSpeed 0.19 does not build (it keeps the master weights of swapped weights on "
                              "the host): pass --strategy.offload_param cpu or none, or leave the ratio at 1")
        if "nvme" in (self.offload_optimizer, self.offload_param):
            if not self.nvme_path:
                raise ConfigError("--strategy.nvme_path", "is required when an offload device is nvme")
            if self.offload_optimizer == "nvme" and self.zero_stage != 3:
                raise ConfigError("--strategy.offload_optimizer", "nvme optimizer offload needs --strategy.zero_stage 3")
        self._validate_common()

    def _validate_common(self) -> None:
        if self.gradient_accumulation_steps < 1:
            raise ConfigError(
                "--strategy.gradient_accumulation_steps", f"must be >= 1, got {self.gradient_accumulation_steps}"
            )
        if self.gradient_clipping < 0:
            raise ConfigError("--strategy.gradient_clipping", f"must be >= 0 (0 disables), got {self.gradient_clipping}")
        for flag, value in (("--strategy.reduce_bucket_size", self.reduce_bucket_size),
                            ("--strategy.allgather_bucket_size", self.allgather_bucket_size)):
            if value < 1:
                raise ConfigError(flag, f"must be >= 1 (elements per bucket, e.g. 500000000), got {value}")


@dataclass
class PrecisionConfig:
    """The training precision, and fp16's dynamic loss scale."""

    dtype: Precision = "auto"
    """fp32, fp16 (dynamic loss scaling), bf16, or auto: bf16 on GPUs that support it, fp32 on CPU."""
    initial_scale_power: int = 16
    """fp16: the first loss scale is 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the loss scale is raised."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the loss scale is lowered."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    master_weights: Literal["fp32", "bf16"] = "fp32"
    """The optimizer's copy of the weights and their gradients (DeepSpeed ZeRO 1-3 with --precision.dtype bf16): fp32, 8 bytes a parameter; bf16, 4 bytes, but an update smaller than bf16's resolution of a weight is lost. bf16 with fp32 optimizer states needs the optimizer on the host (--strategy.offload_optimizer cpu, Adam)."""
    optimizer_states: Literal["fp32", "bf16"] = "fp32"
    """The optimizer's states (Adam's two moments): fp32, 8 bytes a parameter, or bf16, 4 bytes. bf16 needs --precision.master_weights bf16."""


@dataclass
class CompileConfig:
    """torch.compile of the model."""

    enabled: bool = False
    """torch.compile the model's repeated blocks one by one (the whole model if it has none; ZeRO-3: DeepSpeed's own compile, which recompiles per submodule and is no speed-up yet: train ZeRO-3 eagerly): fewer, fused kernels. The first steps compile, about one block's worth whatever the depth; a second batch length compiles once more, for all lengths. With lengths that vary, pad them to a multiple of 64 (--data.pad_to_multiple_of): padded to 8, LoRA 1.2B stalled 12-15 s once, mid-run."""
    scope: Literal["blocks", "stack"] = "blocks"
    """With --compile.enabled: blocks compiles the repeated blocks one by one (a compile costs one block, whatever the depth); stack compiles the module that holds them (IMDB's TransformerEncoder) as one graph: fewer kernel launches a step, for small models whose step waits on the host, at a compile time that grows with depth."""
    mode: Literal["default", "reduce-overhead"] = "default"
    """With --compile.enabled: torch.compile's mode. reduce-overhead replays each compiled unit's kernels as a CUDA graph, one launch instead of hundreds, for a step that waits on the host; a graph is recorded per batch shape, and the graphs share one memory pool that the run keeps. Refuses gradient accumulation (on any device); not used on a CPU or at ZeRO-3 (DeepSpeed's own compile)."""


@dataclass
class ActivationCheckpointingConfig:
    """Activation checkpointing: recompute instead of store."""

    resume_safe = ALL_SAFE
    """Recomputing instead of storing computes the same values: a resume may turn it on or off."""

    enabled: bool = False
    """Recompute activations in the backward pass instead of storing them (less memory, ~30% more compute)."""


@dataclass
class TrainerConfig:
    resume_safe = frozenset({"micro_batch_size", "epochs", "max_steps", "log_every_steps", "eval_every_steps",
                             "eval_max_batches", "device", "num_workers", "gpu_memory_gib", "output_dir", "run_name",
                             "warmup_steps_excluded", "gc_freeze", "profile_steps", "evaluate", "export"})
    """Settings a resume may change: the length of the run, when it evaluates and logs, where it runs. The
    micro-batch is checked against the checkpoint (with the process count; see ``check_compatible``); the
    precision a device trains in too. The seed is not here: it orders the data."""

    micro_batch_size: int = 8
    """Samples per GPU (or process) per forward pass."""
    epochs: Optional[int] = None
    """Train for this many passes over the data (ignored when max_steps is set)."""
    max_steps: Optional[int] = None
    """Train for this many optimizer steps; wins over epochs."""
    log_every_steps: int = 10
    """Optimizer steps per metrics window (loss, lr, throughput, memory)."""
    eval_every_steps: int = 0
    """Evaluate every N optimizer steps; 0 evaluates at the end of each epoch and of training."""
    eval_max_batches: Optional[int] = None
    """Cap the number of validation batches per evaluation (None: the whole split)."""
    seed: int = 42
    """Seed for Python, NumPy and torch (and the data order): 0 to 2**32 - 1, NumPy's range."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto picks cuda when a GPU is visible."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    gpu_memory_gib: Optional[float] = None
    """Use at most this much memory of each GPU (``torch.cuda.set_per_process_memory_fraction``): a GPU
    shared with other work, or a run planned for a smaller card. Past it, allocations fail as out of memory."""
    output_dir: str = "runs"
    """Parent folder of the run directory."""
    run_name: Optional[str] = None
    """Run directory name; default <recipe>.<YYYY>.<MM>.<DD>.<HH>.<MM>.<SS>.<id>."""
    warmup_steps_excluded: int = 2
    """Optimizer steps left out of the throughput figures at the start (compilation, allocator warm-up)."""
    gc_freeze: bool = True
    """After the warm-up's last step (the first, with no warm-up: then its time is in the first window),
    collect Python's garbage once on every rank and freeze what survives (``gc.freeze``): later full
    collections skip what set-up and compilation built, so they no longer hold the other ranks up for long."""
    profile_steps: int = 0
    """Profile this many optimizer steps after the warm-up; writes <run>/profile.json and profile.md (0: off)."""
    evaluate: bool = True
    """Evaluate on the validation and test splits; false trains only (the planner's short trials, benchmarks)."""
    export: bool = True
    """Write the trained model to <run>/model at the end; false skips it (short trials, benchmarks)."""

    def validate(self) -> None:
        if not 0 <= self.seed < 2**32:
            raise ConfigError("--trainer.seed", f"must be in [0, {2**32 - 1}] (NumPy's seed range), got {self.seed}")
        if self.micro_batch_size < 1:
            raise ConfigError("--trainer.micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ConfigError("--trainer.gpu_memory_gib", f"must be > 0 (GiB of each GPU to use), got {self.gpu_memory_gib}")
        if self.max_steps is None and self.epochs is None:
            raise ConfigError("--trainer.max_steps", "or --trainer.epochs is required: set one (e.g. --trainer.max_steps 1000)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError("--trainer.max_steps", f"must be >= 1, got {self.max_steps}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError("--trainer.epochs", f"must be >= 1, got {self.epochs}")
        if self.log_every_steps < 1:
            raise ConfigError("--trainer.log_every_steps", f"must be >= 1, got {self.log_every_steps}")
        if self.eval_every_steps < 0:
            raise ConfigError("--trainer.eval_every_steps", f"must be >= 0, got {self.eval_every_steps}")
        if self.num_workers < 0:
            raise ConfigError("--trainer.num_workers", f"must be >= 0, got {self.num_workers}")
        if self.eval_max_batches is not None and self.eval_max_batches < 1:
            raise ConfigError("--trainer.eval_max_batches", f"must be >= 1 (or unset: the whole split), got "
                              f"{self.eval_max_batches}; to train without evaluating pass --trainer.evaluate false")
        if self.warmup_steps_excluded < 0:
            raise ConfigError("--trainer.warmup_steps_excluded", f"must be >= 0, got {self.warmup_steps_excluded}")
        if self.profile_steps < 0:
            raise ConfigError("--trainer.profile_steps", f"must be >= 0, got {self.profile_steps}")
        if self.run_name and (why := run_name_problem(self.run_name)):
            raise ConfigError("--trainer.run_name", f"{why}: pass one folder name, such as myrun-1")


@dataclass
class CheckpointConfig:
    resume_safe = ALL_SAFE
    """Every setting of this section may change on resume: none changes what is computed."""

    every_steps: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end)."""
    keep_last: int = 2
    """Keep the newest K complete checkpoints; older ones are deleted."""
    resume: Optional[str] = None
    """auto (newest complete checkpoint of the run named by --trainer.run_name, else start fresh) or a checkpoint/run folder."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    verify: bool = True
    """sha256 of every checkpoint file: recorded at save, checked at resume (sizes are always checked).
    Costs one read of the checkpoint per save and resume, split over the ranks; turn off for huge checkpoints."""

    def validate(self) -> None:
        if self.every_steps < 0:
            raise ConfigError("--checkpoint.every_steps", f"must be >= 0, got {self.every_steps}")
        if self.keep_last < 1:
            raise ConfigError("--checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass
class LoggingConfig:
    resume_safe = ALL_SAFE
    """Every setting of this section may change on resume: none changes what is computed."""

    tensorboard: bool = True
    """Write TensorBoard events to <run>/tb_dir."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    print_ds_config: bool = False
    """Print the resolved DeepSpeed JSON (as saved in <run>/ds_config.json) when training starts."""
    wandb: bool = False
    """Also log to Weights & Biases (pip install 'zerotrain[wandb]')."""
    wandb_project: str = "zerotrain"
    """W&B project."""
    wandb_run_name: Optional[str] = None
    """W&B run name (default: the run directory name)."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode; offline writes to <run>/wandb and needs no network (sync later with `wandb sync`)."""


MIN_TIMEOUT_MINUTES = 0.05
"""The shortest collective timeout: 3 s. Less would time out ordinary steps (a checkpoint, an evaluation)."""


@dataclass
class LaunchConfig:
    resume_safe = ALL_SAFE
    """Every setting of this section may change on resume: none changes what is computed."""

    nproc_per_node: int = 1
    """Processes (GPUs) to start on this node; zerotrain starts them itself, like torchrun."""
    nnodes: int = 1
    """Number of nodes in the job."""
    node_rank: int = 0
    """This node's rank, 0..nnodes-1 (read from SLURM_NODEID under SLURM)."""
    rdzv_endpoint: str = "127.0.0.1:29500"
    """host:port of node 0, where all processes meet (torchrun's --rdzv-endpoint / MASTER_ADDR:MASTER_PORT)."""
    comm_backend: Literal["auto", "nccl", "gloo", "mpi"] = "auto"
    """torch.distributed backend: auto is nccl on GPU and gloo on CPU."""
    timeout_minutes: float = 60.0
    """How long a collective waits for the other ranks, e.g. while rank 0 alone tokenises a corpus or exports weights.
    A rank that dies or hangs ends the job after this long, with one line naming it (fractions allowed, >= 0.05)."""
    rdzv_timeout_minutes: float = 10.0
    """How long the rendezvous is waited for before giving up in one line: the launcher on each node for all nodes
    to join at rdzv_endpoint, and a process started with RANK/MASTER_ADDR set (by torchrun or a scheduler) for
    rank 0 to answer at MASTER_ADDR:MASTER_PORT. A stop signal ends either wait at once."""
    max_restarts: int = 0
    """Restart all workers up to N times when one dies (killed, crashed) or hangs past timeout_minutes; they resume
    from the run's last complete checkpoint. A user error, a diverged loss, out of memory or a pre-emption is not
    restarted (a restart cannot fix it). One node only; zerotrain must start the workers itself."""

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError("--launch.nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ConfigError("--launch.nnodes", f"must be >= 1, got {self.nnodes}")
        if not self.timeout_minutes >= MIN_TIMEOUT_MINUTES:  # `not >=`: NaN is refused too
            raise ConfigError("--launch.timeout_minutes", f"must be >= {MIN_TIMEOUT_MINUTES} (3 seconds), "
                              f"got {self.timeout_minutes:g}")
        if self.max_restarts < 0:
            raise ConfigError("--launch.max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.max_restarts and self.nnodes > 1:
            raise ConfigError("--launch.max_restarts", f"restarts the workers of one node (--launch.nnodes 1), not "
                              f"of {self.nnodes}: on several nodes, leave it out and requeue the job from its scheduler "
                              "with --checkpoint.resume auto")
        if not self.rdzv_timeout_minutes > 0:
            raise ConfigError("--launch.rdzv_timeout_minutes", f"must be > 0, got {self.rdzv_timeout_minutes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("--launch.node_rank", f"must be in [0, {self.nnodes}), got {self.node_rank}")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("--launch.rdzv_endpoint", f"must be host:port, got {self.rdzv_endpoint!r}")
        if not 1 <= int(port) <= 65535:
            raise ConfigError("--launch.rdzv_endpoint", f"port {port} is outside 1-65535: give host:port with a free "
                              "port of the node of rank 0 (e.g. 29500)")


@dataclass
class RunConfig:
    """Sections shared by every recipe. A recipe subclasses this and adds ``model`` and ``data``."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """How the model is distributed: backend, ZeRO stage, offloads, buckets, accumulation, clipping."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Training precision (and fp16's loss scale)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile."""
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    """Activation checkpointing."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard, W&B, progress bar."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Processes and nodes."""

    def validate(self) -> "RunConfig":
        """Check every section; raise ConfigError naming the flag. Returns self."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        check_across_sections(self)
        check_cache_dir_setting(getattr(getattr(self, "data", None), "cache_dir", None))
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


UNRESOLVED: tuple[Any, ...] = ("auto", None)
"""Values that leave a setting to the run, which writes back what it resolved them to."""


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def check_cache_dir_setting(cache_dir: Any, flag: str = "--data.cache_dir") -> None:
    """Any recipe's ``--data.cache_dir``: a folder, or a path where one can be made. A file there, or a file where a
    parent folder should be, is one line before any process starts (the tokenizer would fail deep in ``datasets``)."""
    if not isinstance(cache_dir, str) or not cache_dir:
        return
    import os

    path = os.path.abspath(os.path.expanduser(cache_dir))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
    if not os.path.isdir(path):
        where = "is a file" if path == os.path.abspath(os.path.expanduser(cache_dir)) else f"is under a file ({path})"
        raise UserError(f"{flag}: {cache_dir} {where}; pass a folder (created if missing) for the tokenized data")


def resume_changes(saved: dict[str, Any], cfg: Any, skip: frozenset[str] = frozenset()
                   ) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(safe, unsafe) differences between a run's recorded config (its ``hparams.json``) and ``cfg``, each as
    (``--section.field``, recorded value, new value), for a resume of that run with ``cfg``.

    Generic over the config tree: every section (a recipe's ``model`` and ``data`` too) declares in its
    ``resume_safe`` the settings a resume may change (:data:`ALL_SAFE`: all of them); every other setting
    shapes the model, the data stream or the numerics, and a change of it is unsafe. A setting absent on
    either side (a run recorded by another zerotrain version) is not compared, nor are the flags in ``skip``
    (``section.field``: settings not resolved yet), nor a setting left at its default "auto" or None, which
    the run resolves (from the same files) and records. Values are compared as JSON holds them (tuples as lists).
    """
    safe: list[tuple[str, Any, Any]] = []
    unsafe: list[tuple[str, Any, Any]] = []

    def walk(section: Any, old: dict[str, Any], prefix: str) -> None:
        allowed = getattr(type(section), "resume_safe", frozenset())
        for f in dataclasses.fields(section):
            if f.name not in old:
                continue
            name, value = f"{prefix}{f.name}", getattr(section, f.name)
            if dataclasses.is_dataclass(value) and isinstance(old[f.name], dict):
                walk(value, old[f.name], f"{name}.")
                continue
            if name in skip:
                continue
            now = json.loads(json.dumps(value, default=str))
            if now in UNRESOLVED and now == _default(f):
                # Left to the run (auto, or unset): it resolves it from the same files as it did before, and
                # records what it found (a recipe's detected --data.format, classify's label names).
                continue
            if now != old[f.name]:
                ok = f.name in allowed or "*" in allowed
                (safe if ok else unsafe).append((f"--{name}", old[f.name], now))

    walk(cfg, json.loads(json.dumps(saved, default=str)), "")
    return safe, unsafe


def check_across_sections(cfg: "RunConfig") -> None:
    """Checks that read two sections at once."""
    tr, ck, sched, st, comp = cfg.trainer, cfg.checkpoint, cfg.scheduler, cfg.strategy, cfg.compile
    if comp.enabled and comp.mode == "reduce-overhead" and st.zero_stage != 3 and st.gradient_accumulation_steps > 1:
        # A CUDA graph's replay writes its gradients into the same pool memory each time, and the first
        # micro-batch's gradients became the parameters' .grad there (pytorch/pytorch#169545).
        raise ConfigError("--compile.mode", "reduce-overhead (CUDA graphs) would overwrite the gradients "
                          "accumulated so far; set --strategy.gradient_accumulation_steps 1 or "
                          "--compile.mode default")
    if cfg.precision.dtype == "fp16" and st.backend == "fsdp2":
        raise ConfigError("--precision.dtype", "fp16 is not offered with --strategy.backend fsdp2 (its loss scaling "
                          "would need a scaler that knows sharded gradients): use bf16 or fp32")
    if cfg.precision.dtype == "fp16" and st.backend == "deepspeed" and cfg.precision.initial_scale_power < 0:
        raise ConfigError("--precision.initial_scale_power", "must be >= 0")
    check_state_precision(cfg)
    if st.offload_optimizer_ratio < 1.0 and cfg.precision.master_weights == "bf16" and not st.deepspeed_config:
        raise ConfigError("--strategy.offload_optimizer_ratio", "below 1 beside --precision.master_weights bf16: the "
                          "GPU's share would keep bf16 moments whatever --precision.optimizer_states says. Pass "
                          "--precision.master_weights fp32, or leave the ratio at 1")
    if st.offload_optimizer_ratio < 1.0 and cfg.optimizer.name != "adamw" and not st.deepspeed_config:
        # DeepSpeed steps the GPU's share with torch's AdamW whatever the host's optimizer is
        raise ConfigError("--strategy.offload_optimizer_ratio", f"{st.offload_optimizer_ratio} keeps part of the "
                          "optimizer on the GPU, which DeepSpeed steps with AdamW there, and --optimizer.name is "
                          f"{cfg.optimizer.name}: pass --optimizer.name adamw, or leave the ratio at 1")
    if ck.resume == "auto" and not tr.run_name:
        raise ConfigError("--checkpoint.resume", "auto continues the run named by --trainer.run_name, and none is "
                          "given: pass --trainer.run_name NAME (the folder name under --trainer.output_dir)")
    if tr.max_steps is not None:
        check_warmup(sched.warmup_steps, tr.max_steps)


def check_state_precision(cfg: "RunConfig") -> None:
    """Refuse bf16 master weights or optimizer states where DeepSpeed 0.19 does not run them, in one line.

    DeepSpeed's rules (its ``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``): ZeRO stage
    1-3 only; bf16 states only beside bf16 master weights; bf16 master weights with fp32 states only with the
    optimizer offloaded as DeepSpeedCPUAdam; under optimizer offload, DeepSpeedCPUAdam (it stores the moments in
    bf16 itself). NVMe optimizer offload is refused beside bf16 master weights: DeepSpeed 0.19.8 sizes its swap
    buffers in bf16 there and swaps fp32 masters through them, and stops at the first step. The 16-bit weights
    must be bf16: fp16 has its own master weights scheme, and fp32 training has no 16-bit copy to keep. With a user's DeepSpeed file, its ``bf16`` block
    decides (``zerotrain.config.ds_config`` refuses flags that say otherwise)."""
    p, st = cfg.precision, cfg.strategy
    if p.optimizer_states == "bf16" and p.master_weights != "bf16":
        raise ConfigError("--precision.optimizer_states bf16", "needs --precision.master_weights bf16 (DeepSpeed "
                          "keeps the moments in bf16 only beside bf16 master weights)")
    if p.master_weights != "bf16":
        return
    flag = "--precision.master_weights bf16"
    if st.backend != "deepspeed":
        raise ConfigError(flag, "needs --strategy.backend deepspeed (a DeepSpeed ZeRO 1-3 option)")
    if st.deepspeed_config:  # the file's bf16 block decides; the flags must agree with it (ds_config checks)
        return
    if st.zero_stage == 0:
        raise ConfigError(flag, "needs --strategy.zero_stage 1, 2 or 3")
    if p.dtype in ("fp32", "fp16"):
        raise ConfigError(flag, f"needs --precision.dtype bf16, got {p.dtype}")
    offloaded = st.offload_optimizer != "none"
    if p.optimizer_states == "fp32" and not offloaded:
        raise ConfigError(flag, "and fp32 optimizer states needs the optimizer on the host (DeepSpeedCPUAdam): add "
                          "--strategy.offload_optimizer cpu, or --precision.optimizer_states bf16")
    if st.offload_optimizer == "nvme":
        raise ConfigError(flag, "cannot go to NVMe: DeepSpeed 0.19 stops at the first step of such a run (its swap "
                          "buffers take bf16, the master weights it swaps stay fp32). Keep fp32 master weights on "
                          "NVMe (drop --precision.master_weights), or use --strategy.offload_optimizer cpu")
    if offloaded and cfg.optimizer.name not in ("adam", "adamw"):
        raise ConfigError(flag, f"under --strategy.offload_optimizer {st.offload_optimizer} needs --optimizer.name "
                          f"adamw or adam (DeepSpeedCPUAdam), got {cfg.optimizer.name}")


def run_name_problem(name: str) -> Optional[str]:
    """What makes ``name`` no single folder name under ``--trainer.output_dir`` (None: nothing). A run folder is a
    closed room: a name with a path separator (an absolute path included) or ``..`` would put the run, and every
    file it writes, somewhere else; a control character such as a newline breaks the log lines that name it."""
    if name in (".", ".."):
        return f"{name!r} is no folder name"
    if "/" in name or "\\" in name:
        return f"{name!r} holds a path separator, and a run name is one folder under --trainer.output_dir"
    bad = next((ch for ch in name if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        return f"{name!r} holds the control character {bad!r}"
    return None


def check_warmup(warmup_steps: int, total_steps: int) -> None:
    """Refuse a warm-up that does not end before the run does: the peak learning rate would never be used.

    Called with --trainer.max_steps at validation, and by the loop once an epoch-based run's length is known.
    """
    if warmup_steps and warmup_steps >= total_steps:
        raise ConfigError("--scheduler.warmup_steps", f"({warmup_steps}) must be below the run's {total_steps} "
                          "optimizer steps, or the learning rate never reaches --optimizer.lr: lower it (e.g. "
                          f"{max(1, total_steps // 10)}) or train longer")


MOVED: dict[str, str] = {
    "strategy.precision": "precision.dtype",
    "strategy.initial_scale_power": "precision.initial_scale_power",
    "strategy.loss_scale_window": "precision.loss_scale_window",
    "strategy.hysteresis": "precision.hysteresis",
    "strategy.min_loss_scale": "precision.min_loss_scale",
    "strategy.compile": "compile.enabled",
    "strategy.compile_scope": "compile.scope",
    "strategy.compile_mode": "compile.mode",
    "strategy.activation_checkpointing": "activation_checkpointing.enabled",
}
"""Settings that left ``strategy`` for sections of their own: old key -> new key. A flag or ``--config`` key
of the old layout is refused in one line naming the new one; an old run's ``hparams.json`` is read through
:func:`upgrade_layout`."""


def moved_setting(key: str, value: Any = None, flag: bool = True) -> str:
    """The one line for an old ``section.field`` (see :data:`MOVED`): ``--strategy.precision moved: use
    --precision.dtype bf16`` for a flag, ``strategy.precision moved: use precision.dtype (...)`` for a file key."""
    new = MOVED[key]
    if flag:
        return f"--{key} moved: use --{new}" + (f" {value}" if value is not None else "")
    section, _, name = new.partition(".")
    shown = "..." if value is None else value if not isinstance(value, bool) else str(value).lower()
    return f"{key} moved: use {new} (write {section}: {{{name}: {shown}}})"


def upgrade_layout(hparams: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``hparams.json``) in the current layout: the settings of :data:`MOVED` taken out of its
    ``strategy`` into their own sections. A config already in the current layout comes back unchanged."""
    strategy = hparams.get("strategy")
    if not isinstance(strategy, dict) or not any(f"strategy.{k}" in MOVED for k in strategy):
        return hparams
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in hparams.items()}
    for key, value in strategy.items():
        if f"strategy.{key}" in MOVED:
            section, _, name = MOVED[f"strategy.{key}"].partition(".")
            del out["strategy"][key]
            target = out.setdefault(section, {})
            if isinstance(target, dict):
                target.setdefault(name, value)
    return out


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a (nested) config dataclass from a plain dict such as a saved ``hparams.json``."""
    kwargs = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(key, f"is not a field of {cls.__name__}")
        default = getattr(cls(), key) if _has_all_defaults(cls) else None
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = from_dict(type(default), value)
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def _has_all_defaults(cls: type) -> bool:
    return all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )
