"""`python -m tests.training.fsdp2_cpu ARGS...`: the `kimi-vl` command under accelerate's FSDP2 path on CPUs, as
`accelerate launch --use_fsdp --fsdp_version 2` runs it on GPUs. accelerate takes the FSDP path only on GPU-like
devices (on CPUs it trains with DDP, whatever the launcher says); here the process-wide `AcceleratorState` is switched
to FSDP with the plugin the launcher's environment describes, so `Accelerator.prepare` applies `fully_shard` (gloo) and
the parameters become DTensors, as on GPUs."""

import os
import sys

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

_init = AcceleratorState.__init__
_plugin: list[FullyShardedDataParallelPlugin] = []


def _fsdp_init(self, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and self.distributed_type == DistributedType.MULTI_CPU:
        if not _plugin:  # one plugin for the process, as accelerate keeps on GPUs
            _plugin.append(kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin())
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, _plugin[0]


AcceleratorState.__init__ = _fsdp_init

if __name__ == "__main__":
    from kimi_vl.cli import main

    sys.exit(main(sys.argv[1:]))
