"""Autocast switched off around computations that must run in their inputs' precision."""

from __future__ import annotations

import contextlib

import torch


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context in which autocast is off for ``x``'s device, so that what is cast to fp32 is computed in fp32 (an
    enclosing ``torch.autocast(..., dtype=torch.bfloat16)`` runs matmuls and linears in bf16 whatever their inputs'
    dtype). A no-op for devices without autocast (``meta``)."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) \
        else contextlib.nullcontext()


__all__ = ["autocast_off"]
