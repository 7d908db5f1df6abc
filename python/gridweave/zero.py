"""ZeRO-3's parameter units: gw.optim.ParameterUnits (this module is the older path)."""
from .optim.units import ParameterUnits, _in_backward  # noqa: F401
