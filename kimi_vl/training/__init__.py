"""Training utilities: the MuonClip optimizer."""

from .muonclip import MuonClip, route_parameters, zeropower_via_newtonschulz

__all__ = ["MuonClip", "route_parameters", "zeropower_via_newtonschulz"]
