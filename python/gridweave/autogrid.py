"""grid auto: the planner's fastest grid for a job (gw.plan), chosen once for each world it runs
on: by the launcher, which hands it to the ranks it starts, or by rank 0 of a world the launcher
did not plan (an elastic restart), which shares it through the rendezvous store."""
from __future__ import annotations

import dataclasses
import os

from . import launch, plan
from .config import AUTO, TrainConfig
from .errors import GridError
from .grid import decided_once

GRID_ENV = "GRIDWEAVE_GRID"  # grid auto: the launcher's choice, "WORLD:SPEC", which ranks of that world take


def plan_grid(cfg: TrainConfig, world: int, per_node: int) -> tuple:
    """grid auto: (the planner's fastest grid of `world` ranks, `per_node` a node, that fits the
    memory of a rank on cfg.cluster, the planner's rows). One clear error where none fits."""
    cluster = plan.load_cluster(cfg.cluster, per_node)
    rows = plan.plan(world, plan.model_of(cfg), cluster, microbatches=cfg.microbatches, workers=1,
                     recompute=cfg.ac != 1, **cfg.planned_optimizer())
    if not rows:
        raise GridError(f"grid auto: no grid of {world} ranks takes this model ({cfg.layers} layers, {cfg.heads} "
                        f"heads, hidden {cfg.hidden}) at batch {cfg.batch} in {cfg.microbatches} micro-batches")
    if not rows[0]["fits"]:
        least = min(r["memory_bytes"] for r in rows)
        raise GridError(f"grid auto: no grid of {world} ranks fits a rank's memory on {cluster.name} "
                        f"({cluster.memory_bytes / 2 ** 30:.2f} GiB); the least any needs is {least / 2 ** 30:.2f} GiB")
    return plan_shape(rows[0]), rows


def plan_for_ranks(cfg: TrainConfig, world: int, per_node: int) -> tuple:
    """grid auto in a launcher: (cfg on the planner's choice for `world`, the planner's rows), the
    choice handed to the ranks it starts (GRID_ENV)."""
    shape, rows = plan_grid(cfg, world, per_node)
    os.environ[GRID_ENV] = f"{world}:{shape.spec()}"
    return cfg.on_grid(shape), rows


def plan_shape(row: dict) -> "plan.GridShape":
    """The grid of a planner's row."""
    return plan.GridShape.parse(",".join(f"{f.name}={row[f.name]}" for f in dataclasses.fields(plan.GridShape)))


PLAN_WAIT_S = 600.0  # grid auto: how long the other ranks wait for rank 0's plan


def chosen_grid(cfg: TrainConfig, world: int, per_node: int, store=None) -> TrainConfig:
    """cfg on its grid: as given, or grid auto's choice for this world: the launcher's, passed in
    GRID_ENV, where it planned this world; else (a restart on another world) rank 0's, shared
    through `store` (grid.rendezvous_store's; None: planned alike on every rank)."""
    if cfg.grid != AUTO:
        return cfg
    planned, _, spec = os.environ.get(GRID_ENV, "").partition(":")
    if planned != str(world):
        def decide():
            return plan_grid(cfg, world, per_node)[0].spec()
        spec = decide() if store is None else \
            decided_once(store, f"gridweave/{launch.store_generation()}/grid-auto/{world}", decide, PLAN_WAIT_S)
    return cfg.on_grid(plan.GridShape.parse(spec))
