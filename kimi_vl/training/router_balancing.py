"""Aux-loss-free MoE balancing as a hook of the optimizer step.

Every `TopKRouter` counts the real tokens it routes to each expert in training forwards (`expert_load`; padding is
routed but not counted, so the loads do not depend on how a batch is split over ranks and micro-batches). After each
optimizer step, `RouterBalancing` sums the counts over data-parallel ranks, moves each router's
`e_score_correction_bias` by `rate * sign(mean load - load)` and zeroes the counts; a step that is discarded (a
non-finite loss) or forwards that are not training (validation) call `reset` instead. Installed with
`RouterBalancing(model, optimizer, rate)`, which registers the update as the optimizer's step post-hook; under
transformers' `Trainer` (and TRL's trainers, built on it) `RouterBalancingCallback(rate)` installs it on the
trainer's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..text.moe import TopKRouter


class RouterBalancing:
    """The router-bias update of `model`'s MoE layers after every `optimizer.step()` (see the module docstring).

    `last_loads` holds, per router, max load / mean load of the last update (1.0 is perfectly balanced)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rate: float) -> None:
        self.routers = {n: m for n, m in model.named_modules() if isinstance(m, TopKRouter)}
        self.rate = rate
        self.last_loads: dict[str, float] = {}
        self.reset()  # non-persistent counters: uninitialised memory after from_pretrained
        self.handle = optimizer.register_step_post_hook(self._after_step)

    def reset(self) -> None:
        """Forget the loads counted since the last update."""
        for router in self.routers.values():
            router.expert_load.zero_()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.last_loads = {}
        for name, router in self.routers.items():
            if distributed and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(router.expert_load)
            load = router.update_router_bias(self.rate)
            if load.sum() > 0:
                self.last_loads[name] = float(load.max() / load.mean())


class RouterBalancingCallback(TrainerCallback):
    """The router-bias update under transformers' `Trainer` or TRL's trainers, which never call it themselves:
    `Trainer(model, args, ..., callbacks=[RouterBalancingCallback(rate=1e-3)])`. When training begins it installs
    `RouterBalancing` on the trainer's optimizer (the torch optimizer inside accelerate's wrapper, which steps once
    per accumulated batch); `balancing.last_loads` then holds the last update's max / mean loads."""

    def __init__(self, rate: float = 1e-3) -> None:
        self.rate = rate
        self.balancing: RouterBalancing | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        if self.balancing is not None:  # a second `train()` builds its optimizer anew
            self.balancing.handle.remove()
        self.balancing = RouterBalancing(model, getattr(optimizer, "optimizer", optimizer), self.rate)


__all__ = ["RouterBalancing", "RouterBalancingCallback"]
