"""The grid's optimizers, one protocol (GridOptimizer): AxoNN's OffloadAdam (state in host memory,
bucketed, the gradient all-reduce overlapped), DistributedAdam (ZeRO 1-3, hybrid sharding) and
ZeRO-3's parameter units."""
from .base import GridOptimizer, adamw_, checked_state, dp_mean_scale, held_bytes, matrices_only, uses_distributed
from .base import _DeviceSteps  # noqa: F401 (the older name of GridOptimizer)
from .distributed import BUCKET, DistributedAdam, ShardGroup, bucket_starts
from .offload import OffloadAdam, gradient_chunks, link_bytes_per_element
from .units import ParameterUnits

__all__ = ["GridOptimizer", "OffloadAdam", "link_bytes_per_element", "DistributedAdam", "ParameterUnits", "ShardGroup", "BUCKET", "adamw_",
           "bucket_starts", "checked_state", "dp_mean_scale", "gradient_chunks", "held_bytes", "matrices_only",
           "uses_distributed"]
