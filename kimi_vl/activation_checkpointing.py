"""Activation checkpointing for the models' repeated blocks: one helper every model runs its blocks through."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps
from typing import Any

import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

_checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def _holds_grad_tensors(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0])


def run_checkpointed(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`; while `module` trains with `gradient_checkpointing` on, through the checkpoint function that
    `activation_checkpointing_enable(...)` gave it (non-reentrant `torch.utils.checkpoint` when set by hand), so that
    `fn`'s intermediates are recomputed in the backward pass instead of kept. Tensors that need gradients inside
    list or tuple arguments reach the checkpoint as arguments of their own: the reentrant variant
    (`use_reentrant=True`) sees only those, and would otherwise cut the gradient through them. Without gradients
    (`torch.no_grad`, e.g. `generate` in train mode) there is nothing to recompute: `fn` runs plainly."""
    if module.gradient_checkpointing and module.training and torch.is_grad_enabled():
        checkpoint = getattr(module, "_gradient_checkpointing_func", _checkpoint)
        if not any(_holds_grad_tensors(a) for a in args if isinstance(a, (list, tuple))):
            return checkpoint(fn, *args)
        leaves, spec = tree_flatten(args)

        @wraps(fn)
        def unflattened(*flat: Any) -> Any:
            return fn(*tree_unflatten(list(flat), spec))

        return checkpoint(unflattened, *leaves)
    return fn(*args)


__all__ = ["run_checkpointed"]
