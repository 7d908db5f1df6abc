"""Tensor-parallel modes: gw.Row (1-D), gw.Square (2-D), gw.Cube (3-D), gw.SubGraph (D&SP),
gw.CSub (D&SP-cSub) and gw.Sequence (none). See base.py for what a mode owns."""
from ..nn.style import resolve
from .base import Mode, known, parse, register
from .cube import Cube
from .row import Row
from .sequence import Sequence
from .square import Square
from .subgraph import CSub, SubGraph

__all__ = ["Mode", "Row", "Square", "Cube", "SubGraph", "CSub", "Sequence", "register", "resolve", "parse",
           "known"]
