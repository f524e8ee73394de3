"""``--compile.enabled``: torch.compile a transformer one block at a time (``--compile.scope stack``: the
stack of blocks as one graph).

Compiling a whole model makes dynamo trace every layer: a 22-layer Llama with LoRA logged no step
in 570 s on an H100. Its layers are one class run N times, and dynamo treats a module's parameters
as inputs to the graph (``inline_inbuilt_nn_modules``, on by default), so a graph compiled for the
first block serves every block after it. Compiling each block in place therefore costs about one
block's compile, whatever the depth; the embedding and head stay eager, which costs little next to
the blocks. A loss a model marks as :class:`FusedLoss` is compiled on its own. A model with no
repeated blocks is compiled whole.

Compiling is in place: parameter names, and so checkpoints and exports, do not change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class FusedLoss(nn.Module):
    """A loss that :func:`compile_model` compiles as a unit of its own: dynamic shapes, never CUDA graphs.

    A cross-entropy over a vocabulary is a chain of memory-bound steps (the cast to float32, the
    log-softmax, the pick of each target, the sum, and their backward) that eager runs as separate
    kernels, each reading and writing all the logits; inductor fuses them into a few that read the
    logits once. Its shapes may change with every batch (the MLM loss's count of masked positions),
    so it is compiled for any size at once, and is not recorded as CUDA graphs (one per size).
    """


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every outermost ``nn.ModuleList`` whose children are all of one class, in order.

    That is a transformer's stack of layers (``model.layers``, ``encoder.layer``, ``TransformerEncoder.layers``)
    however deep a wrapper (peft, DeepSpeed) has put it; a list inside a block already found is not searched.
    """
    return [block for _, blocks in _stacks(model) for block in blocks]


def block_stacks(model: nn.Module) -> list[nn.Module]:
    """The modules that hold a stack of repeated blocks (:func:`repeated_blocks`) in a ``nn.ModuleList`` of theirs."""
    return [owner for owner, _ in _stacks(model)]


def _stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList]]:
    found: list[tuple[nn.Module, nn.ModuleList]] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(c) for c in child}) == 1:
                found.append((module, child))
            else:
                visit(child)

    visit(model)
    return found


def compile_in_place(module: nn.Module, backend: str | Callable[..., Any] = "inductor", mode: str = "default") -> None:
    """``module.compile()``, except for modules whose ``forward`` is torch's own (``nn.TransformerEncoderLayer``, the
    IMDB recipe's blocks): dynamo does not trace ``Module._call_impl`` of those as the first frame, so their
    ``compile()`` silently runs eager (torch 2.11-2.13). Their ``forward`` is compiled instead, which it does
    trace; hooks still run around it."""
    if type(module).forward.__module__.startswith("torch."):  # also a subclass that keeps torch's forward
        module.forward = torch.compile(module.forward, backend=backend, **_mode(backend, mode))  # type: ignore[method-assign]
    else:
        module.compile(backend=backend, **_mode(backend, mode))


def _mode(backend: str | Callable[..., Any], mode: str) -> dict[str, str]:
    # torch.compile refuses a mode with a backend other than inductor (the tests' counting backends)
    return {"mode": mode} if backend == "inductor" and mode != "default" else {}


def compile_model(model: nn.Module, scope: str = "blocks", backend: str | Callable[..., Any] = "inductor",
                  mode: str = "default") -> str:
    """Compile ``model`` in place and say what was compiled: its repeated blocks one by one (``scope="blocks"``), or
    each module that holds a stack of them, the stack as one graph (``scope="stack"``); the whole model when it
    has no repeated blocks.

    One graph for the stack launches fewer kernels and crosses fewer graph boundaries a step, which is what a
    small model whose step waits on the host needs, at a compile time that grows with depth. The whole model
    as one graph is not offered: the IMDB classifier compiled whole trained at chance on a GPU (wrong gradients
    from the second step, torch 2.11, ``benchmarks/whole_compile_check.py``), while its stack compiled whole
    trains as eager. ``mode`` is torch.compile's (``reduce-overhead``: CUDA graphs)."""
    units = block_stacks(model) if scope == "stack" else repeated_blocks(model)
    if not units:
        compile_in_place(model, backend, mode)
        return f"compiled the whole {type(model).__name__}"
    for unit in units:
        compile_in_place(unit, backend, mode)
    losses = [m for m in model.modules() if isinstance(m, FusedLoss)]
    for loss in losses:
        loss.compile(backend=backend, dynamic=True)
    and_losses = f", and {type(losses[0]).__name__} on its own" if losses else ""
    if scope == "stack":
        return f"compiled {type(units[0]).__name__} ({len(repeated_blocks(model))} blocks) as one graph{and_losses}"
    return f"compiled {len(units)} {type(units[0]).__name__} blocks one by one{and_losses}"
