"""Training: the MuonClip optimizer, distributed helpers, the trainer, stages and presets."""

from .distributed import all_reduce_max, get_rank, get_world_size, init_distributed, is_main_process
from .muonclip import MuonClip, route_parameters, zeropower_via_newtonschulz
from .router_balancing import RouterBalancing, RouterBalancingCallback
from .trainer import TrainConfig, Trainer

__all__ = [
    "MuonClip", "RouterBalancing", "RouterBalancingCallback", "TrainConfig", "Trainer", "all_reduce_max", "get_rank",
    "get_world_size", "init_distributed", "is_main_process", "route_parameters", "zeropower_via_newtonschulz",
]
