"""torch.autograd.Functions: forward and backward of each seed algorithm."""
from .comm import (all_reduce_replicated, copy_to_parallel, gather_from_parallel, reduce_from_parallel,
                   scatter_to_parallel)
from .cube import AB, ABT, ATB, cube_matmul, cube_vector
from .summa import summa_matmul, summa_vector

__all__ = ["copy_to_parallel", "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel",
           "all_reduce_replicated",
           "cube_matmul", "cube_vector", "AB", "ABT", "ATB", "summa_matmul", "summa_vector"]
