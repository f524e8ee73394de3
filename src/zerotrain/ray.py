"""zerotrain under Ray Train: each Ray worker is one rank of the job and runs the same :func:`~zerotrain.train.loop.fit`.

::

    from zerotrain.ray import trainer

    result = trainer("toy", ["--trainer.max_steps", "100", "--checkpoint.every_steps", "20"],
                     num_workers=4, use_gpu=True, storage_path="/shared/ray_results", max_failures=3).fit()
    result.metrics        # what the last checkpoint's step logged (step, train_loss, lr, val_* ...)
    result.checkpoint     # the last checkpoint, a copy of <run folder>/checkpoints/stepN

:func:`trainer` builds the ``ray.train.torch.TorchTrainer``; :func:`train_loop` is the function it runs on each
worker, for a user who builds the trainer themselves (``train_loop_config={"recipe": ..., "argv": [...]}``).

The contract with Ray:

* Ray Train starts the processes and their process group (``TorchConfig``: Gloo on CPU, NCCL on GPUs) and sets
  torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); the fit joins that group as it joins one that
  torchrun made, and leaves it to Ray at the end.
* Every step that logs metrics or saves a checkpoint calls ``ray.train.report`` on every rank: the metrics
  logged there (``step``, ``train_loss``, ``lr``, ``val_*`` ...) and, on rank 0, the checkpoint folder
  just saved as a ``ray.train.Checkpoint`` (the run's summary stays in ``summary.json``). Ray copies the checkpoint
  into its storage (``RunConfig.storage_path``) and keeps the newest ``--checkpoint.keep_last`` of them.
  Rank 0 alone reports it because a zerotrain checkpoint is one folder that every rank writes its shards into
  and rank 0 seals once all are there: it already lives on storage that every rank sees (one machine, or a
  shared run folder across nodes), so Ray gets all of it from one worker and merges nothing.
* When a worker dies, Ray ends the others and starts the group again (``FailureConfig(max_failures=N)``); each
  worker then resumes from ``ray.train.get_checkpoint()``, the last checkpoint reported, and the run ends with
  the weights of an uninterrupted one. Before the first report it resumes from the run folder
  (``--checkpoint.resume auto``).
* The run folder is ``--trainer.output_dir``/``--trainer.run_name``; without a run name it is Ray's run name
  (``RunConfig.name``), so a restarted worker group writes into the same folder.

The module imports Ray only when it is used: zerotrain runs without it (``pip install 'zerotrain[ray]'``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Optional

from zerotrain.config.flags import parse_config
from zerotrain.errors import ConfigError, UserError
from zerotrain.runtime.distributed import comm_backend
from zerotrain.tasks import registry as recipes
from zerotrain.train.loop import fit

RAY_MISSING = "zerotrain.ray needs Ray Train, which is not installed: pip install 'zerotrain[ray]'"


def _ray_train() -> Any:
    """``ray.train``, or one line naming the extra that installs it."""
    try:
        import ray.train
        import ray.train.torch  # TorchTrainer, and what the workers' process group needs
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray.train


def train_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: ``zerotrain fit RECIPE ARGV`` as one rank of Ray's process group.

    ``config``: ``{"recipe": "toy", "argv": ["--trainer.max_steps", "100", ...]}``, the recipe and the flags of
    ``zerotrain fit``. Reports through ``ray.train.report`` and resumes from ``ray.train.get_checkpoint()`` (see
    the module's docstring).
    """
    train = _ray_train()
    recipe, argv = config["recipe"], [str(a) for a in config.get("argv", ())]
    task_cls = recipes.get(recipe)
    cfg = _checked_config(recipe, argv)
    if cfg.trainer.run_name is None:
        cfg.trainer.run_name = train.get_context().get_experiment_name()
    rank = train.get_context().get_world_rank()

    def report(step: int, metrics: dict[str, Any], checkpoint: Optional[Path]) -> None:
        # A checkpoint is reported by rank 0, with the metrics Ray attaches to it; every rank calls report, which
        # Ray makes a barrier.
        ckpt = train.Checkpoint.from_directory(str(checkpoint)) if checkpoint is not None and rank == 0 else None
        train.report({"step": step, **metrics}, checkpoint=ckpt)

    restored = train.get_checkpoint()
    # A checkpoint in remote storage is downloaded for as long as the fit runs; a local one is used where it is.
    with restored.as_directory() if restored is not None else contextlib.nullcontext() as folder:
        if folder is not None:
            cfg.checkpoint.resume = folder
        elif cfg.checkpoint.resume is None:
            cfg.checkpoint.resume = "auto"  # a group restarted before the first report continues its own folder
        fit(task_cls(cfg), report=report)


def _checked_config(recipe: str, argv: list[str]) -> Any:
    """The run's config from ``argv``, refusing the flags that would start processes Ray has already started."""
    cfg = parse_config(recipe, argv).validate()
    if cfg.launch.nproc_per_node != 1 or cfg.launch.nnodes != 1:
        raise ConfigError("--launch.nproc_per_node" if cfg.launch.nproc_per_node != 1 else "--launch.nnodes",
                          "starts processes, which Ray Train does under zerotrain.ray: set the number of workers "
                          "with num_workers (ScalingConfig) and leave these flags out")
    if cfg.launch.max_restarts:
        raise ConfigError("--launch.max_restarts", "restarts the workers of zerotrain's own launcher; under Ray, "
                          "Ray restarts them: pass max_failures (FailureConfig) instead")
    if cfg.strategy.auto:
        raise ConfigError("--strategy.auto", "plans before the processes start, which Ray has already done: run "
                          "`zerotrain plan RECIPE ...` once and pass --config <plan folder>/plan.yaml")
    return cfg


def trainer(recipe: str, argv: list[str] = (), num_workers: int = 2, use_gpu: bool = False,
            storage_path: Optional[str] = None, name: Optional[str] = None, max_failures: int = 0,
            resources_per_worker: Optional[dict[str, float]] = None) -> Any:
    """A ``ray.train.torch.TorchTrainer`` that runs ``zerotrain fit RECIPE ARGV`` on ``num_workers`` workers.

    The flags are checked here, on the driver, so a mistake is one line before any worker starts. Ray's
    settings come from them: the process group's backend (``--launch.comm_backend``; auto: NCCL with
    ``use_gpu``, else Gloo) and timeout (``--launch.timeout_minutes``), the checkpoints Ray keeps
    (``--checkpoint.keep_last``). A relative ``--trainer.output_dir`` is made absolute here, where the user
    wrote it. ``storage_path``, ``name``: Ray's ``RunConfig`` (where Ray keeps its copies of the checkpoints,
    and the run's name, which is the run folder's without ``--trainer.run_name``). ``max_failures``: how many
    times Ray restarts the worker group after a worker fails (``FailureConfig``; -1: without end).
    ``resources_per_worker``: Ray's, and its ``"CPU"`` count is also the worker's ``OMP_NUM_THREADS`` (Ray's
    default, 1 CPU, leaves DeepSpeed's CPU Adam on one core: give an offloading worker its share of the cores).
    Call ``.fit()`` on the result to train.
    """
    train = _ray_train()
    from ray.train.torch import TorchConfig, TorchTrainer

    argv = [str(a) for a in argv]
    cfg = _checked_config(recipe, argv)
    if not use_gpu and cfg.trainer.device == "cuda":
        raise ConfigError("--trainer.device", "cuda needs GPUs for the Ray workers: pass use_gpu=True, or use cpu")
    backend = comm_backend(cfg.launch.comm_backend, "cuda" if use_gpu else "cpu")
    argv = [*argv, "--trainer.output_dir", str(Path(cfg.trainer.output_dir).expanduser().resolve())]
    return TorchTrainer(
        train_loop,
        train_loop_config={"recipe": recipe, "argv": argv},
        torch_config=TorchConfig(backend=backend, timeout_s=math.ceil(cfg.launch.timeout_minutes * 60)),
        scaling_config=train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                           resources_per_worker=resources_per_worker),
        run_config=train.RunConfig(name=name, storage_path=storage_path,
                                   failure_config=train.FailureConfig(max_failures=max_failures),
                                   checkpoint_config=train.CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last)),
    )
