"""Training: the MuonClip optimizer, distributed helpers, the trainer and its steps (language model, RL), stages and
presets."""

from .distributed import all_reduce_max, get_rank, get_world_size, init_distributed, is_main_process
from .muonclip import MuonClip, route_parameters, zeropower_via_newtonschulz
from .rl import RLStep
from .router_balancing import RouterBalancing, RouterBalancingCallback
from .trainer import LanguageModelStep, TrainConfig, Trainer, TrainingStep

__all__ = [
    "LanguageModelStep", "MuonClip", "RLStep", "RouterBalancing", "RouterBalancingCallback", "TrainConfig", "Trainer",
    "TrainingStep", "all_reduce_max", "get_rank", "get_world_size", "init_distributed", "is_main_process",
    "route_parameters", "zeropower_via_newtonschulz",
]
