"""gridweave: transformers on an N-dimensional grid of processes."""
import torch  # noqa: F401  (first: the engine is loaded into a process whose C++ runtime torch chose)

from . import _C  # noqa: F401  (the native engine, gw._C)
from .errors import CommError, CommTimeout, Diverged, GridError
from .grid import CheckLevel, Grid, LinePart, P2POp, Span, Work, current, init, shutdown
from .modes import CSub, Cube, Mode, Row, Sequence, Square, SubGraph
from .layout import Layout, gather, scatter
from .sharding import ParamPlacement, clip_grad_norm_, placement_of, reduce_gradients
from . import autograd, checkpoint, config, data, float8, hf, launch, models, modes, nn, optim, pipeline, plan, precision, train  # noqa: E402,F401
from . import flight  # noqa: E402,F401  (gw.flight.analyse: the flight recorder's dumps read)
from . import verify  # noqa: E402,F401  (gw.verify.run: a configuration against one process)

__all__ = ["init", "shutdown", "current", "CheckLevel", "Grid", "LinePart", "Span", "P2POp", "Work", "Mode", "Row", "Square", "Cube", "SubGraph", "CSub",
           "Sequence", "ParamPlacement", "placement_of", "reduce_gradients", "clip_grad_norm_", "GridError",
           "CommError", "CommTimeout", "Diverged", "Layout", "scatter", "gather", "nn", "autograd", "optim", "pipeline", "models", "data", "modes", "precision", "train", "plan", "hf"]
__version__ = "0.1.0"
