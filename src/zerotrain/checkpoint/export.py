"""``zerotrain export``: a run's checkpoint as weights other tools load, on a CPU, in bounded memory.

Input: ``RUN_DIR/hparams.json`` and one complete ``RUN_DIR/checkpoints/step*/`` folder, written by
any engine: the plain engine's ``torch_state.pt``, DeepSpeed ZeRO-0's ``mp_rank_00_model_states.pt``,
ZeRO-1/2/3's per-rank ``*_optim_states.pt`` (consolidated by DeepSpeed's own ``zero_to_fp32`` from
the fp32 master weights, in its lazy mode: ZeRO-3 tensors are gathered one at a time), or FSDP2's DCP
checkpoint in ``dcp/`` (each tensor read whole from its shards, one at a time, without a process group).

Output: a folder that is complete or absent (written beside its final name, renamed at the end):

* ``safetensors`` (every recipe): ``hparams.json`` (the run's) and ``model/`` in the recipe's export
  layout, so ``zerotrain predict OUT ...`` and :func:`zerotrain.runtime.rundir.load_run` read it like a run.
  For imdb, mlm and custom tasks ``model/`` holds ``model.safetensors``, sharded with Hugging Face's
  ``model.safetensors.index.json`` past ``max_shard_size``; tensors are written one shard at a time,
  so host memory holds at most one shard beyond what DeepSpeed's reader maps. For lora it holds
  peft's ``adapter/`` and the ``merged/`` full model (:meth:`LoRATask.export`).
* ``hf`` (mlm): a Hugging Face ``RobertaForMaskedLM`` folder (``config.json``, ``model.safetensors``,
  the tokenizer) that ``AutoModelForMaskedLM.from_pretrained`` loads with zerotrain's logits.

Every folder gets ``export.json``: the checkpoint, its step, dtype and format.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional

import torch

from zerotrain.checkpoint import dcp
from zerotrain.checkpoint.layout import (
    complete_checkpoints,
    is_complete,
    older_marker,
    problem,
    step_folder,
)
from zerotrain.checkpoint.weights import (
    DEFAULT_MAX_SHARD_SIZE,
    LazyTensor,
    _cast,
    _const,
    _thunk,
    materialise,
    write_safetensors,
)
from zerotrain.engines.ds_private.safe_load import ds_safe_globals
from zerotrain.engines.ds_private.zero_to_fp32 import (
    fp32_state_dict_lazy,
    import_consolidator,
)
from zerotrain.errors import UserError
from zerotrain.models.roberta_mlm import hf_roberta_config, hf_roberta_state_dict
from zerotrain.runtime import rundir
from zerotrain.train.state import load_safely, refuse_unsafe_files, weights_only_torch_load

Format = Literal["safetensors", "hf"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TORCH_STATE = "torch_state.pt"  # zerotrain.engines.plain.TorchEngine.STATE_FILE, without importing the engines


@dataclass
class ExportResult:
    out_dir: Path
    step: int
    checkpoint: Path
    files: list[str]
    """Files written, relative to ``out_dir``."""


# ---- reading a run ---------------------------------------------------------------------------

def pick_checkpoint(run_dir: Path, step: Optional[int]) -> Path:
    """The newest complete checkpoint, or the one of ``step``, checked before anything in it is read.

    The check is resume's (:func:`zerotrain.checkpoint.layout.problem`): the marker lists every file, and each
    has its recorded size and sha256. A damaged checkpoint is refused in one line naming the file, not replaced
    by an older one: what the export holds is what was asked for.
    """
    folder = _pick(run_dir, step)
    damage = problem(folder, checksums=True)
    if damage is not None and (written_before := older_marker(folder)) is not None:
        raise UserError(written_before.replace("resume or export it", "export it"))
    if damage is not None:
        older = [p for p in complete_checkpoints(run_dir / "checkpoints") if p.name < folder.name]
        hint = f"Export an older step with --step {_step_of(older[-1])}" if older else "It has no older checkpoint"
        raise UserError(f"checkpoint {folder} is damaged: {damage}. {hint}")
    return folder


def _pick(run_dir: Path, step: Optional[int]) -> Path:

    ckpts = run_dir / "checkpoints"
    found = complete_checkpoints(ckpts)
    if step is not None:
        folder = step_folder(ckpts, step)
        if is_complete(folder):
            return folder
        have = ", ".join(str(_step_of(p)) for p in found) or "none"
        state = "is incomplete (its save was interrupted)" if folder.is_dir() else "does not exist"
        raise UserError(f"--step {step}: {folder} {state}. Complete checkpoints of this run are at steps: {have}")
    if not found:
        raise UserError(f"{ckpts} holds no complete checkpoint (a step* folder with COMPLETE.json). "
                        "Train with --checkpoint.save_final true (the default) or --checkpoint.every_steps N")
    return found[-1]


def _step_of(folder: Path) -> int:
    digits = "".join(ch for ch in folder.name if ch.isdigit())
    return int(digits) if digits else -1


# ---- the consolidated weights, lazily ----------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's converter prints progress lines and tqdm bars; the command prints its own summary."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def checkpoint_tensors(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype, LazyTensor]]:
    """name -> (shape, dtype, thunk) of the full model's tensors in ``folder``; a thunk materialises one tensor.

    Names are the unwrapped module's (no ``module.`` prefix). Tensors shared between names (tied
    weights) are listed under each name.
    """
    # Every file a loader below may read is scanned first (nothing unpickled): a crafted one is refused naming it.
    with _cpu_accelerator():
        allow = ds_safe_globals()  # imports DeepSpeed's record classes
    refuse_unsafe_files(sorted(folder.glob("*.pt")), allow, _EXPORTING)
    if (folder / dcp.FOLDER).is_dir():  # FSDP2: its reader admits DCP's records and tensors only
        return dcp.model_tensors(folder, _EXPORTING)
    state_file = folder / TORCH_STATE
    optim = sorted(folder.glob("*_optim_states.pt"))
    if state_file.is_file():
        sd = _torch_load(state_file)
        module = sd.get("module") if isinstance(sd, dict) else None
        if not isinstance(module, dict):
            raise UserError(f"{state_file} holds no 'module' state dict: it was not written by zerotrain")
        return {_strip(k): (v.shape, v.dtype, _const(v)) for k, v in module.items()}
    if optim:  # ZeRO-1/2/3: the fp32 master weights are partitioned over the ranks' optimizer files

        with _cpu_accelerator():
            import_consolidator()
        try:
            # DeepSpeed's converter calls torch.load(weights_only=False) on every *_states.pt it finds: within this
            # block each of those loads is weights-only (DeepSpeed's few record classes allowed), so a crafted file
            # is refused in one line and runs nothing. Lazy mode reads every file here, none later.
            with _quiet(), weights_only_torch_load(folder, ds_safe_globals(), _EXPORTING):
                lazy = fp32_state_dict_lazy(str(folder.parent), folder.name)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError) as exc:
            raise UserError(f"{folder}: DeepSpeed cannot consolidate this checkpoint "
                            f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}). "
                            "Export an older step with --step N") from None
        return {_strip(k): (v.shape, v.dtype, _thunk(v)) for k, v in lazy.items()}
    model_states = folder / "mp_rank_00_model_states.pt"
    if model_states.is_file():  # ZeRO-0: every rank holds the whole model; rank 0's file has it
        sd = _torch_load(model_states)
        module = sd.get("module") if isinstance(sd, dict) else None
        if not isinstance(module, dict):
            raise UserError(f"{model_states} holds no 'module' state dict: it was not written by DeepSpeed")
        return {_strip(k): (v.shape, v.dtype, _const(v)) for k, v in module.items()}
    raise UserError(f"{folder} holds no model weights ({TORCH_STATE}, mp_rank_00_model_states.pt, "
                    f"*_optim_states.pt or {dcp.FOLDER}/). Pass another step with --step N")


@contextlib.contextmanager
def _cpu_accelerator() -> Iterator[None]:
    """Import DeepSpeed as a CPU program: without a GPU it otherwise prints a warning while guessing the
    accelerator. The converter is plain torch on CPU either way; the environment is restored after."""
    saved = os.environ.get("DS_ACCELERATOR")
    if saved is None and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)


_EXPORTING = ("", "Export an older step with --step N")
"""How a file export cannot load safely is named (see :func:`zerotrain.train.state.unreadable`)."""


def _torch_load(path: Path) -> Any:
    # Tensors, plain containers and DeepSpeed's record classes only; mmap: not read into memory.
    return load_safely(path, "cpu", ds_safe_globals(), _EXPORTING, mmap=True)


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


# ---- writing ---------------------------------------------------------------------------------


def default_out(run_dir: Path, step: int, fmt: Format, dtype: str) -> Path:
    suffix = "" if fmt == "safetensors" else f"-{fmt}"
    return run_dir / "export" / f"step{step:08d}{suffix}{'' if dtype == 'fp32' else '-' + dtype}"


def export_run(run_dir: str | Path, out: Optional[str | Path] = None, step: Optional[int] = None,
               dtype: str = "fp32", fmt: Format = "safetensors",
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
               progress: Optional[Callable[[str], None]] = None) -> ExportResult:
    """Export the checkpoint of ``step`` (default: the newest complete one) of ``run_dir``; see the module doc.
    ``progress`` gets the shard lines of a safetensors export (the shard size, a line per shard)."""
    run_dir = Path(run_dir).expanduser()
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose fp32 or bf16")
    if fmt not in ("safetensors", "hf"):
        raise UserError(f"--format {fmt!r}: choose safetensors or hf")
    recipe, cfg, raw = rundir.read_run(run_dir)
    rundir.check_closed(run_dir.resolve())  # nothing is read or written through a link out of the run folder
    task_cls = rundir.task_class(raw, run_dir / "hparams.json")
    if fmt == "hf" and recipe != "mlm" and not callable(getattr(task_cls, "export_hf", None)):
        raise UserError(f"--format hf: only the mlm, causal-lm and classify recipes map onto a Hugging Face "
                        f"architecture; {run_dir} is a {recipe} run. Use --format safetensors (lora: its merged/ folder "
                        "is already a Hugging Face model)")
    folder = pick_checkpoint(run_dir, step)
    step_n = _step_of(folder)
    out_dir = Path(out).expanduser() if out is not None else default_out(run_dir, step_n, fmt, dtype)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"--out: {out_dir} already exists and is not an empty folder. Pass a new folder, "
                        "or delete the old export first")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as exc:
        raise UserError(f"--out: cannot create {out_dir} ({exc.strerror or exc}). Pass a folder you can write to") \
            from None
    if fmt == "hf" or recipe != "lora":
        # Built without pretrained weights (every tensor comes from the checkpoint): the run's own model config
        # serves, so the export works when the model folder it was trained from is gone. The lora recipe's
        # safetensors export rebuilds the frozen base from where the run took it (the checkpoint holds the adapter).
        rundir.use_own_model_config(cfg, run_dir)
    task = task_cls(cfg)
    torch_dtype = DTYPES[dtype]
    with rundir.writing("the export", out_dir.parent):  # a full disk: one line, the staging folder removed
        try:
            lazy = checkpoint_tensors(folder)
            if fmt == "hf":
                export_hf = getattr(task, "export_hf", None)
                export_hf = export_hf if callable(export_hf) else (lambda *a: _export_hf_roberta(task, *a))
                files = export_hf(lazy, staging, torch_dtype)
            elif recipe == "lora":
                files = _export_lora(task, lazy, staging / "model", torch_dtype)
            else:
                files = ["model/" + f for f in write_safetensors(lazy, staging / "model", torch_dtype, max_shard_size,
                                                                 progress=progress)]
            if fmt == "safetensors":
                # hparams.json beside model/ (and the run's tokenizer): the folder is a run folder to load_run and
                # zerotrain predict, wherever it goes.
                rundir.write_model_config(task, staging / "model")
                files.append(f"model/{rundir.MODEL_CONFIG}")
                shutil.copyfile(run_dir / "hparams.json", staging / "hparams.json")
                files.append("hparams.json")
                if (run_dir / rundir.TOKENIZER_DIR).is_dir():
                    shutil.copytree(run_dir / rundir.TOKENIZER_DIR, staging / rundir.TOKENIZER_DIR)
                    files += sorted(str(p.relative_to(staging)) for p in (staging / rundir.TOKENIZER_DIR).iterdir())
            info = {"source_run": str(run_dir.resolve()), "checkpoint": str(folder.resolve()), "step": step_n,
                    "recipe": recipe, "dtype": dtype, "format": fmt}
            (staging / "export.json").write_text(json.dumps(info, indent=2) + "\n")
            files.append("export.json")
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above)
            staging.rename(out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return ExportResult(out_dir=out_dir, step=step_n, checkpoint=folder, files=sorted(files))


def _export_lora(task: Any, lazy: dict, model_dir: Path, dtype: torch.dtype) -> list[str]:
    """peft adapter + merged model through :meth:`LoRATask.export`, the code a finished fit runs.

    The checkpoint's trainable tensors are the adapter; the frozen base is rebuilt from where the run
    took it (its ``--model.name_or_path``, or for ``--model.init random`` the run's seeded draw, as
    :meth:`LoRATask.load_exported` does), so the base weights need not be read from the checkpoint.
    """
    cfg = task.cfg
    cfg.model.merge_on_export = True
    cfg.activation_checkpointing.enabled = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)  # the loop seeds --trainer.seed just before build_model
        model = task.build_model(pretrained=True)
    own = model.state_dict()
    adapter = {k: v for k, v in lazy.items() if "lora_" in k}
    missing = [k for k in own if "lora_" in k and k not in adapter]
    if not adapter or missing:
        raise UserError(f"the checkpoint holds {len(adapter)} LoRA tensors, and lacks {len(missing)} the run's "
                        f"model has (e.g. {(missing or ['?'])[0]}): was hparams.json changed since training?")
    with torch.no_grad():
        for k, (_, _, thunk) in adapter.items():
            if k in own:
                own[k].copy_(thunk())
    if dtype != torch.float32:
        model = model.to(dtype)
    task.export(model, model.state_dict(), model_dir)
    return sorted(str(p.relative_to(model_dir.parent)) for p in model_dir.rglob("*") if p.is_file())


def _export_hf_roberta(task: Any, lazy: dict, out_dir: Path, dtype: torch.dtype) -> list[str]:
    """The mlm run as a Hugging Face RobertaForMaskedLM folder: config.json, model.safetensors, tokenizer.

    The conversion holds the (MLM-sized) model in memory once; the names and the position offset are
    :func:`zerotrain.models.roberta_mlm.hf_roberta_state_dict`'s.
    """
    from safetensors.torch import save_file


    m = task.cfg.model
    with torch.random.fork_rng(devices=[]):
        model = task.build_model(pretrained=False)  # dims and pad id as training had them; weights replaced below
    sd = materialise(lazy)
    try:
        model.load_state_dict(sd)
    except RuntimeError as exc:
        raise UserError(f"the checkpoint does not fit the model hparams.json describes "
                        f"({' '.join(str(exc).split())[:300]})") from None
    pad = model.encoder.token_embedding.padding_idx
    tok = task.tokenizer
    config = hf_roberta_config(model, m.num_heads, m.ff_dim, m.dropout, pad, tok.bos_token_id, tok.eos_token_id)
    hf = hf_roberta_state_dict(model.state_dict(), m.num_layers, pad)
    # The tied decoder weight is written once, under the embedding's name, as transformers saves it.
    save_file({k: _cast(v, dtype).clone() for k, v in hf.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save_pretrained(str(out_dir))
    return sorted(p.name for p in out_dir.iterdir() if p.is_file())
