"""gridweave: transformers on an N-dimensional grid of processes."""
from . import _C  # noqa: F401  (the native engine, gw._C)
from .errors import CommError, CommTimeout, GridError
from .grid import Grid, Work, current, init, shutdown
from .topology import Cube, Row, Square, SubGraph
from .layout import Layout, gather, scatter
from . import autograd, data, models, nn, optim, pipeline  # noqa: E402  (they need the grid module above)

__all__ = ["init", "shutdown", "current", "Grid", "Work", "Row", "Square", "Cube", "SubGraph", "GridError",
           "CommError", "CommTimeout", "Layout", "scatter", "gather", "nn", "autograd", "optim", "pipeline", "models", "data"]
__version__ = "0.1.0"
