"""Performance model and planner: predicted step time, memory and traffic of a grid.

The step costed is the step gw.train runs, recorded from its code (plan.record,
step_schedule): every GEMM and its FLOPs, every other kernel and its bytes, every collective
and pipeline message (Megatron-LM 1-D, SUMMA 2-D, Bian et al. 3-D, Li et al. ring, SUPER
split/join, AxoNN's pipeline), the optimizer's chunked all-reduces and own work, the
activations kept. Collectives are alpha-beta costed (ring, halving-doubling, pairwise, tree)
over the links a grid line uses under the engine's placement (cpp/placement.h): inside a
node the intra-node link; across nodes each node's network links, shared by the lines
leaving it (SUPER eqs. 4-7). step_counters predicts the engine's traffic counters exactly.

The package: cluster (presets), shape (Model, GridShape: the rule train checks too), costs
(alpha-beta, bubble, FLOPs), predict (one grid), search (every grid, ranked; the table), record
(the step recorded from the code that runs it).
"""
from .cluster import PRESETS, Cluster, load_cluster
from .costs import _label_line, _lines_of, _links, _Lines, bubble_fraction, collective_time, transformer_flops
from .predict import (FUSED_BUCKET, Prediction, _check_recompute, layer_ops, optimizer_time, predict, schedule_of,
                      stage_memory, stage_time, step_counters, work_ops)
from .search import (FOLDED, MIN_TOKENS_PER_SP_RANK, SHOWN, TABLE_COLUMNS, best_microbatching, enumerate_grids,
                     explain, fold_equal, microbatch_counts, plan, tensor_modes, _worker_main)
from . import search
from .shape import PLACEMENTS, GridShape, Model, model_from, model_of

__all__ = ["PRESETS", "Cluster", "load_cluster", "_label_line", "_lines_of", "_links", "_Lines", "bubble_fraction",
           "collective_time", "transformer_flops", "FUSED_BUCKET", "Prediction", "optimizer_time", "stage_memory",
           "stage_time", "layer_ops", "predict", "schedule_of",
           "step_counters", "work_ops", "_check_recompute", "FOLDED", "MIN_TOKENS_PER_SP_RANK", "SHOWN",
           "TABLE_COLUMNS", "best_microbatching", "enumerate_grids", "explain", "fold_equal", "microbatch_counts",
           "plan", "tensor_modes", "_worker_main", "search", "PLACEMENTS", "GridShape", "Model", "model_from",
           "model_of"]


def __getattr__(name):  # the search's tunables, read where they live (plan.search.GRIDS_PER_TASK)
    if name in ("GRIDS_PER_TASK", "RUNS_PER_WORKER"):
        return getattr(search, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
