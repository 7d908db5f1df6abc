"""The step recorded from the code that runs it: gw.plan.record (this module is its older path,
the same module object)."""
import sys

from .plan import record

sys.modules[__name__] = record
