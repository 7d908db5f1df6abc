"""ZeRO-3's parameter units: gw.optim.units (this module is its older path, the same module object)."""
import sys

from .optim import units

sys.modules[__name__] = units
