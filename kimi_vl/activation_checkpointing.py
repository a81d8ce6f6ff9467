"""Activation checkpointing for the models' repeated blocks: one helper every model runs its blocks through."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch.utils.checkpoint
from torch import nn

_checkpoint = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def run_checkpointed(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`; while `module` trains with `gradient_checkpointing` on, through the checkpoint function that
    `activation_checkpointing_enable(...)` gave it (non-reentrant `torch.utils.checkpoint` when set by hand), so that
    `fn`'s intermediates are recomputed in the backward pass instead of kept."""
    if module.gradient_checkpointing and module.training:
        return getattr(module, "_gradient_checkpointing_func", _checkpoint)(fn, *args)
    return fn(*args)


__all__ = ["run_checkpointed"]
