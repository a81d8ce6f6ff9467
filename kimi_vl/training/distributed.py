"""torch.distributed helpers for training: process-group set-up, rank queries, MAX all-reduce, DTensor utilities.

Launch a training script on one machine with either launcher (both set `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`):

    torchrun --nproc_per_node 8 train.py ...
    accelerate launch --num_processes 8 train.py ...          # DDP
    accelerate launch --use_fsdp --fsdp_version 2 ... train.py  # FSDP2 (`fully_shard`, parameters become DTensors)

`MuonClip` needs nothing else: under DDP every rank holds the full, already averaged gradient and runs the same
update; under FSDP2 each Muon matrix is gathered for Newton-Schulz and only the local shard is kept (see
`kimi_vl.training.muonclip`). QK-Clip all-reduces its per-head max logits (MAX) so every rank clips identically.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


def is_distributed() -> bool:
    """True when a default process group is initialised (and there is more than one process or not)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on global rank 0, and in a single-process run."""
    return get_rank() == 0


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment (`torchrun` / `accelerate launch`).

    Does nothing when a group already exists or when `WORLD_SIZE` is unset (a plain single-process run).
    `backend` defaults to "nccl" when CUDA is available, else "gloo"; with CUDA the process's device is set to
    `LOCAL_RANK`. Returns `(rank, world_size)`.
    """
    if not is_distributed() and "WORLD_SIZE" in os.environ:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return get_rank(), get_world_size()


def collective_device() -> torch.device:
    """Where the process group's tensors live: the current CUDA device under NCCL, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait until every rank gets here (a no-op without a process group)."""
    if get_world_size() > 1:
        dist.barrier()


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise MAX over all ranks, in place (a no-op without a process group). Returns `tensor`."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def gather_ints(value: int, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's `value`, by rank (`[value]` without a process group). `device`: where the process group's
    tensors live (CUDA for NCCL)."""
    if get_world_size() == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.long, device=device)
    values = [torch.zeros_like(mine) for _ in range(get_world_size())]
    dist.all_gather(values, mine)
    return [int(v.item()) for v in values]


def shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """The DTensor with `like`'s mesh and placements whose global value is `full` (identical on every rank).

    Replicate -> Shard is a local slice (torch.chunk rules, the same as FSDP2's dim-0 sharding), so this
    communicates nothing; `full` must already be the same on all ranks of the mesh."""
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def full_state(state: Any, keep: bool = True) -> Any:
    """`state` (nested dicts, lists and tuples, as a `state_dict()` is) with every DTensor replaced by its full value,
    a plain tensor on the CPU (None where not `keep`: a rank that only takes part in the gathering); everything else
    is kept as it is. Under FSDP2 it gathers, one tensor at a time: every rank calls it on the same structure."""
    if isinstance(state, DTensor):
        full = state.full_tensor()
        return full.cpu() if keep else None
    if isinstance(state, dict):
        return {k: full_state(v, keep) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(v, keep) for v in state)
    return state


def scale_rows_(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """`weight[i, ...] *= scale[i]` in place, computed in fp32 and rounded once to `weight`'s dtype.

    `weight` `[rows, ...]` may be a plain tensor or a DTensor (sharded on dim 0, as FSDP2 does, or replicated);
    `scale` `[rows]` is a plain tensor with the same value on every rank. Rows scaled by exactly 1 stay bitwise
    unchanged."""
    scale = scale.to(device=weight.device, dtype=torch.float32).reshape(-1, *([1] * (weight.ndim - 1)))
    if isinstance(weight, DTensor):
        if any(isinstance(p, Shard) and p.dim != 0 for p in weight.placements):
            # Only dim-0 shards line up with per-row factors; other layouts are gathered and re-sliced.
            full = weight.full_tensor()
            weight.copy_(shard_like((full.float() * scale).to(full.dtype), weight))
            return
        local, scale = weight.to_local(), shard_like(scale, weight).to_local()
    else:
        local = weight
    local.copy_((local.float() * scale).to(local.dtype))
