"""Parameter server: sharded servers, push/pull over c10d point-to-point, BSP / ASP / SSP."""

from paraloom.parameter_server.client import PSClient
from paraloom.parameter_server.consistency import may_read, staleness_bound
from paraloom.parameter_server.message import PushCodec, draw_token, run_token
from paraloom.parameter_server.server import ParameterServer
from paraloom.parameter_server.shard import flatten_model, shard_bounds

__all__ = ["PSClient", "ParameterServer", "PushCodec", "draw_token", "flatten_model", "may_read",
           "run_token", "shard_bounds", "staleness_bound"]
