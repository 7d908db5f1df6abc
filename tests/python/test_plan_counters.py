"""Issue 18, one source of truth: the step the planner costs is the step gw.train runs. On
every mode and composed grids, the engine's traffic counters after a real training step
(gw.train.train_step: pipeline, loss, optimizer, clipping) equal the planner's prediction
for that rank, op for op: collective counts, messages and bytes per axis."""
import pytest
import torch

# (tp, dp, pp, sp): every tensor mode, and compositions with data, pipeline and sequence axes
GRIDS = [("none", 2, 2, 1), ("row:4", 1, 2, 1), ("row:2", 2, 2, 1), ("square:2", 2, 1, 1), ("cube:2", 1, 1, 1),
         ("subgraph:2", 2, 2, 1), ("csub:2", 2, 1, 1), ("none", 2, 1, 4), ("row:2", 1, 2, 2),
         ("row:2", 1, 4, 1)]  # pp 4: middle stages of two ranks, which agree on their messages' order


def _step(ctx, tp, dp, pp, sp, family, precision, zero=0, offload=True, overlap=False, more=None):
    """more: further TrainConfig fields; with model mixtral, "imbalance": the real stage routes as
    the planner plans (nn.moe.plan_routing), so its traffic is the planned routing's."""
    import gridweave as gw
    from gridweave import plan
    from gridweave.nn.moe import plan_routing
    from gridweave.recorder import Experts, step_schedule

    more = dict(more or {})
    imbalance = more.pop("imbalance", 1.0)
    cfg = gw.train.TrainConfig(model=family, hidden=64, heads=8, layers=4, seq=32, batch=8, microbatches=2,
                               tokenizer="bytes", tp=tp, dp=dp, pp=pp, sp=sp, precision=precision, bsize=512,
                               coarsening=2, zero=zero, offload=offload, overlap_grad_reduce=overlap,
                               schedule="1f1b" if zero == 3 else "message_driven", **more)
    grid = ctx.init(dp=dp, pp=pp, tp=cfg.mode, sp=sp)
    model_cfg = cfg.model_config(256)
    torch.manual_seed(0)
    _, stage, opt, scaler = gw.train.build(cfg, grid, model_cfg)
    experts = None if model_cfg.moe is None else Experts(cfg.ep, imbalance)
    if experts is not None:
        plan_routing(stage, imbalance)
    g = torch.Generator().manual_seed(1 + grid.coords["dp"])
    x = torch.randint(0, 256, (cfg.batch // dp, cfg.seq), generator=g, device="cpu")  # the reader's host batch
    gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
    grid.reset_stats()
    gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
    ran = {k: {"ops": v["ops"], "sent_messages": v["sent_intra"]["messages"] + v["sent_inter"]["messages"],
               "sent_bytes": v["sent_intra"]["bytes"] + v["sent_inter"]["bytes"]} for k, v in grid.stats().items()}
    schedule = step_schedule(model_cfg, cfg.mode, dp, pp, sp, tuple(grid.coords.items()), cfg.microbatches,
                             cfg.batch // dp // cfg.microbatches, cfg.compute.dtype, cfg.bsize, cfg.coarsening,
                             cfg.max_grad_norm is not None, scaler is not None,
                             announced=pp > 1 and cfg.schedule == "message_driven"  # the other schedules announce nothing
                             and not grid.capabilities("pp")["recv_any"], zero=zero, offload=offload,
                             agreed=cfg.schedule == "message_driven", overlap=overlap,
                             attention=(cfg.attention, cfg.ulysses_degree), experts=experts)
    return ran, plan.step_counters(schedule, grid.axes, grid.placement, grid.rank)


@pytest.mark.parametrize("tp,dp,pp,sp", GRIDS)
def test_planned_step_traffic_is_the_engines(pool, tp, dp, pp, sp):
    import gridweave as gw

    n = dp * pp * sp * gw.modes.parse(tp).ranks()
    for rank, (ran, planned) in enumerate(pool.run(_step, n, tp, dp, pp, sp, "llama", "fp32", timeout=240)):
        assert ran == planned, (rank, {k: (ran.get(k), planned.get(k)) for k in set(ran) | set(planned) if ran.get(k) != planned.get(k)})


@pytest.mark.parametrize("overlap", [False, True])  # True: the chunks' all-reduces started in the backward
def test_planned_step_traffic_gpt_bf16(pool, overlap):
    for rank, (ran, planned) in enumerate(pool.run(_step, 8, "row:2", 2, 2, 1, "gpt", "bf16", 0, True, overlap,
                                                   timeout=240)):
        assert ran == planned, (rank, {k: (ran.get(k), planned.get(k)) for k in set(ran) | set(planned) if ran.get(k) != planned.get(k)})


# ZeRO stages (gw.optim.DistributedAdam): reduce-scatters over the data axes, all-reduces over the
# other partial axes, the norm over the shards, the parameters' all-gathers (ZeRO-3: per unit, in
# every micro-batch's forward and backward); zero 0 on the device
@pytest.mark.parametrize("tp,dp,pp,sp,zero,offload", [("row:2", 2, 2, 1, 2, True), ("none", 2, 1, 4, 1, True),
                                                      ("subgraph:2", 2, 2, 1, 2, False),
                                                      ("square:2", 2, 1, 1, 0, False),
                                                      # ZeRO-3: each unit gathered before its forward and its backward
                                                      ("row:2", 2, 2, 1, 3, False), ("none", 2, 1, 4, 3, True)])
def test_planned_step_traffic_with_zero(pool, tp, dp, pp, sp, zero, offload):
    import gridweave as gw

    n = dp * pp * sp * gw.modes.parse(tp).ranks()
    res = pool.run(_step, n, tp, dp, pp, sp, "llama", "fp32", zero, offload, timeout=240)
    for rank, (ran, planned) in enumerate(res):
        assert ran == planned, (rank, {k: (ran.get(k), planned.get(k)) for k in set(ran) | set(planned) if ran.get(k) != planned.get(k)})


# issue 35: the expert-parallel step (the counts' all-to-all, the rows' dispatch and combine in one
# group of sends and receives, the statistics' all-reduces over the token axes, the experts'
# gradients reduced over the other part of their line) with the planner's routing run for real;
# and USP, whose Ulysses blocks and outer ring are line parts too
@pytest.mark.parametrize("tp,dp,pp,sp,more", [("none", 4, 1, 1, dict(model="mixtral", experts=4, ep=2)),
                                              ("none", 2, 2, 1, dict(model="mixtral", experts=4, ep=2, imbalance=2.0)),
                                              ("none", 2, 1, 2, dict(model="mixtral", experts=4, ep=4, imbalance=1.5)),
                                              ("row:2", 2, 2, 1, dict(model="mixtral", experts=4, ep=2)),
                                              ("none", 2, 1, 4, dict(attention="usp", ulysses_degree=2)),
                                              # DeepSeek-V3: latent attention over tp and over sp's ring, the
                                              # sequence-wise balance loss's statistics, a dense first layer
                                              ("row:2", 2, 2, 1, dict(model="deepseek-v3", experts=4, ep=2,
                                                                      expert_groups=2, topk_groups=1,
                                                                      seq_aux_coef=0.001, dense_first=1)),
                                              ("none", 2, 1, 2, dict(model="deepseek-v3", experts=4, ep=4,
                                                                     imbalance=1.5, dense_first=1)),
                                              # latent attention under Megatron's sequence parallelism
                                              ("row:2", 2, 1, 1, dict(model="deepseek-v3", experts=4, ep=2,
                                                                      tp_sp=True, dense_first=1))])
def test_planned_step_traffic_with_experts_and_line_parts(pool, tp, dp, pp, sp, more):
    import gridweave as gw

    n = dp * pp * sp * gw.modes.parse(tp).ranks()
    family = more.pop("model", "llama")
    res = pool.run(_step, n, tp, dp, pp, sp, family, "fp32", 0, True, False, more, timeout=240)
    for rank, (ran, planned) in enumerate(res):
        assert ran == planned, (rank, {k: (ran.get(k), planned.get(k)) for k in set(ran) | set(planned) if ran.get(k) != planned.get(k)})
