"""Issue 34: the whole training step against torch's own parallelism, side by side in one run.

    python benchmarks/bench_vs_torch.py                 # 1, 2, 4, 8 CPU ranks: results/vs_torch.json and .png
    python benchmarks/bench_vs_torch.py --ranks 8 --transport mpi

One transformers LlamaForCausalLM (hidden 256, 8 heads, 4 key/value heads, 4 layers, sequence
256, vocabulary 1024, SwiGLU 688), saved once; every variant starts from that folder: gridweave
through --init-from's loader (gw.hf.from_pretrained, the main job's gw.train.build and
train_step: the main job's optimizer, OffloadAdam, unless a variant says otherwise), torch from
transformers' own from_pretrained. The same global batches (16 sequences, 2 micro-batches), AdamW
(lr 1e-3 constant, weight decay 0.1 on matrices, betas and eps torch's defaults) and global-norm
clipping at 1.0, fp32.

On n ranks, the grids both can run, each against what a torch user would pick for it:
    dp n                 DDP, FSDP2 (fully_shard per decoder layer and the root)
    row:2 x dp n/2       DTensor tensor parallelism (torchtitan's Llama plan) x FSDP2 on dp
    dp n/2 x pp 2        torch.distributed.pipelining (Schedule1F1B) x FSDP2 on dp
    row:2 x dp n/4 x pp2 the three together (n >= 4)
and on one rank gridweave's one process against plain torch. Gradient accumulation over the two
micro-batches synchronises once (DDP's no_sync, FSDP2's set_requires_gradient_sync), as a torch
user would write it; DDP with pipelining is left out (torch's DDP bucket rebuild asserts in its
second step). Every variant's step (forward, backward, reduction, clipping, update) is timed in
rounds, one variant after the other, so all share the machine alike; tokens/s is the global
batch's tokens over the median step. Memory per rank: the bytes of parameters, gradients and
optimizer state held after a step (largest rank). Every variant's losses are compared with the
first torch variant of its grid (the same model and data: they must agree).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import (bench_parser, interleaved_rounds, results_dir, run_ranks, save, start_worker,  # noqa: E402
                    stem, torch_held_bytes)

SIZES = dict(hidden=256, heads=8, kv_heads=4, layers=4, seq=256, vocab=1024, ffn_hidden=688)
BATCH, MICRO = 16, 2
OPT = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
ROUNDS, WARMUP = 8, 2


def save_model(folder: Path) -> None:
    """The benchmark's transformers Llama, seeded, as from_pretrained reads it."""
    import torch
    import transformers

    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=SIZES["vocab"], hidden_size=SIZES["hidden"],
                                 intermediate_size=SIZES["ffn_hidden"], num_hidden_layers=SIZES["layers"],
                                 num_attention_heads=SIZES["heads"], num_key_value_heads=SIZES["kv_heads"],
                                 max_position_embeddings=SIZES["seq"], tie_word_embeddings=False, rms_norm_eps=1e-5,
                                 initializer_range=0.02)
    with torch.device("cpu"):
        transformers.LlamaForCausalLM(c).save_pretrained(str(folder))


def grids(n: int) -> dict:
    """The grids of n ranks both sides run: name -> (dp, pp, tp)."""
    if n == 1:
        return {"one process": (1, 1, 1)}
    out = {f"dp {n}": (n, 1, 1), f"row:2 x dp {n // 2}": (n // 2, 1, 2), f"dp {n // 2} x pp 2": (n // 2, 2, 1)}
    if n >= 4:
        out[f"row:2 x dp {n // 4} x pp 2"] = (n // 4, 2, 2)
    return out


def part(hf, lo: int, hi: int, first: bool, last: bool):
    """Decoder layers [lo, hi) of transformers' Llama as one module (the embedding on the first
    part, the norm and head on the last): torch's pipeline stages, and the whole model when pp is 1."""
    import torch

    class Part(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = hf.model.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(hf.model.layers[lo:hi])
            self.rotary = hf.model.rotary_emb
            self.norm = hf.model.norm if last else None
            self.head = hf.lm_head if last else None

        def forward(self, h):
            h = self.embed(h) if self.embed is not None else h
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary(h, pos)
            for layer in self.layers:  # no mask: SDPA's causal path, as the whole model takes it
                h = layer(h, position_ids=pos, position_embeddings=pe)
            return self.head(self.norm(h)) if self.head is not None else h

    return Part()


def _ce(logits, y):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _adamw(params):
    import torch

    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=OPT["lr"], weight_decay=OPT["weight_decay"])


def torch_variant(folder: Path, dp: int, pp: int, tp: int, ddp: bool):
    """(step(batch) -> global mean loss, held()) of torch's own parallelism on this grid."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp")) if dist.get_world_size() > 1 \
        else None
    s = mesh["pp"].get_local_rank() if mesh is not None else 0
    d = mesh["dp"].get_local_rank() if mesh is not None else 0
    with torch.device("cpu"):
        hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                           attn_implementation="sdpa")
    per = SIZES["layers"] // pp
    module = part(hf, s * per, (s + 1) * per, s == 0, s == pp - 1)
    if tp > 1:  # torchtitan's Llama plan, without sequence parallelism: the layers' own projections split
        plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate())}
        plan = {k: v for k, v in plan.items() if getattr(module, k) is not None}
        for i in range(len(module.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(module, mesh["tp"], plan)
    model = module
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    elif dp > 1:
        for layer in module.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    params = list(module.parameters())
    opt = _adamw(params)
    if pp > 1:
        stage = PipelineStage(model, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=_ce)
    rows = BATCH // dp
    last = s == pp - 1

    def sync(on: bool):
        if ddp:
            model.require_backward_grad_sync = on
        elif dp > 1:
            model.set_requires_gradient_sync(on)

    def step(b):
        x, y = b[d * rows:(d + 1) * rows, :-1], b[d * rows:(d + 1) * rows, 1:]
        opt.zero_grad()
        if pp > 1:
            losses = []
            if s == 0:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            loss = sum(float(v) for v in losses) / MICRO if last else 0.0
        else:
            loss, mb = 0.0, rows // MICRO
            for i in range(MICRO):
                sync(i == MICRO - 1)  # one reduction a step, after the last micro-batch
                mloss = _ce(model(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]) / MICRO
                mloss.backward()
                loss += mloss.item()
        # the global norm: gradients on each mesh apart (DTensors of FSDP2 and tensor parallelism; plain
        # ones, tensor parallelism's replicated norms), as a foreach kernel takes one kind; then over the
        # stages (torchtitan's clip_grad_norm_ with a pp mesh)
        by_mesh = {}  # one foreach kernel per mesh (FSDP2 x TP: the norms' on dp, the projections' on dp x tp)
        for p in params:
            if p.grad is not None:
                by_mesh.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None, []).append(p)
        groups = list(by_mesh.values())
        sq = torch.zeros(1, dtype=torch.float32)
        for group in groups:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            sq += (norm.full_tensor() if isinstance(norm, DTensor) else norm).reshape(1) ** 2
        if pp > 1:
            dist.all_reduce(sq, group=mesh["pp"].get_group())
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, OPT["max_grad_norm"], sq.sqrt()[0])
        opt.step()
        if mesh is None:
            return loss
        t = torch.tensor([loss if last else 0.0], dtype=torch.float64)
        dist.all_reduce(t)  # each last-stage rank holds its replica's mean: tp copies of dp means
        return t.item() / (dp * tp)

    return step, lambda: torch_held_bytes(module, opt)


def gridweave_variant(folder: Path, store, tag: str, dp: int, pp: int, tp: int, **extra):
    """(step(batch) -> global mean loss, held()) of gridweave's main-job step on this grid."""
    import torch

    import gridweave as gw

    cfg = gw.train.TrainConfig(init_from=str(folder), seq=SIZES["seq"], batch=BATCH, microbatches=MICRO, dp=dp,
                               pp=pp, tp=f"row:{tp}" if tp > 1 else "none", lr=OPT["lr"], min_lr=OPT["lr"],
                               warmup=0, weight_decay=OPT["weight_decay"], max_grad_norm=OPT["max_grad_norm"],
                               **extra)
    grid = gw.init(dp=dp, pp=pp, tp=cfg.mode, store=store, prefix=f"vs-torch-{tag}")
    torch.manual_seed(cfg.seed)
    _, stage, opt, scaler = gw.train.build(cfg, grid, cfg.model_config(SIZES["vocab"]))
    rows, d = BATCH // dp, grid.coords["dp"]
    phases, calls = gw.measure.StepPhases(grid.device), [0]

    def step(b):
        mine = b[d * rows:(d + 1) * rows]
        calls[0] += 1  # the warm-up rounds are not timed
        return gw.train.train_step(cfg, grid, stage, opt, scaler, mine[:, :-1], mine[:, 1:],
                                   phases=phases if calls[0] > WARMUP else None)[0]

    step.phases = phases
    return step, lambda: gw.optim.held_bytes(list(stage.parameters()), opt)


def settings(spec: str) -> dict:
    """--extra's "overlap=1,coarsening=64" as TrainConfig fields (integers, or booleans for flags)."""
    import gridweave as gw

    fields = gw.train.TrainConfig.__dataclass_fields__
    out = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        out[key] = bool(int(value)) if fields[key].type in ("bool", bool) else int(value)
    return out


def worker(args):
    import torch
    import torch.distributed as dist
    import transformers

    import gridweave as gw

    n, rank, store = start_worker()
    transformers.utils.logging.disable_progress_bar()  # every rank loads the model, once per variant
    folder = Path(args.folder)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SIZES["vocab"], (BATCH, SIZES["seq"] + 1), generator=g) for _ in range(ROUNDS)]
    variants = {}  # (grid, who) -> (step, held)
    for i, (name, (dp, pp, tp)) in enumerate(grids(n).items()):
        if pp == 1 and tp == 1:
            if n > 1:
                variants[(name, "torch DDP")] = torch_variant(folder, dp, pp, tp, ddp=True)
            variants[(name, "torch FSDP2" if n > 1 else "torch")] = torch_variant(folder, dp, pp, tp, ddp=False)
        else:
            who = " x ".join(w for w, on in (("DTensor TP", tp > 1), ("pipelining 1F1B", pp > 1), ("FSDP2", dp > 1))
                             if on)
            variants[(name, f"torch {who}")] = torch_variant(folder, dp, pp, tp, ddp=False)
        variants[(name, "gridweave")] = gridweave_variant(folder, store, str(i), dp, pp, tp)
        for k, spec in enumerate(args.extra or ()):  # the main job's step with other settings, beside it
            variants[(name, f"gridweave {spec}")] = gridweave_variant(folder, store, f"{i}-{k}", dp, pp, tp,
                                                                      **settings(spec))
    times, losses = interleaved_rounds(variants, batches)
    held, phases = {}, {}
    for key, (step, measure) in variants.items():
        if hasattr(step, "phases"):  # gridweave's: every rank's phases; the slowest rank's are the step's
            mine = step.phases.per_step()
            every = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(n)]
            dist.all_gather(every, torch.tensor(list(mine.values()), dtype=torch.float64))
            phases[key] = dict(zip(mine, max(every, key=lambda t: t[-1].item()).tolist()))
        mem = torch.tensor([float(v) for v in measure().values()], dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the largest rank's holdings
        held[key] = dict(zip(("parameters", "gradients", "optimizer", "optimizer_buffers"), map(int, mem.tolist())))
    if rank == 0:
        rows, first = [], {}
        for (name, who), t in times.items():
            ref = first.setdefault(name, losses[(name, who)])
            step_s = statistics.median(t[WARMUP:])
            rows.append({"ranks": n, "grid": name, "variant": who, "step_s": step_s,
                         "tokens_per_s": BATCH * SIZES["seq"] / step_s, "memory_bytes": held[(name, who)],
                         "losses": losses[(name, who)], "phases_s": phases.get((name, who)),
                         "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses[(name, who)], ref))})
        Path(args.out).write_text(json.dumps({"ranks": n, "rows": rows}))
    gw.shutdown()
    dist.destroy_process_group()


def summary(rows: list) -> dict:
    """gridweave over the fastest torch variant of each grid: per grid, geometric mean and worst
    over the parallel grids (one process apart)."""
    by = {}
    for r in rows:
        by.setdefault((r["ranks"], r["grid"]), {})[r["variant"]] = r["tokens_per_s"]
    ratios = {f"{g} ({n} ranks)": v["gridweave"] / max(t for w, t in v.items() if w.startswith("torch"))
              for (n, g), v in by.items()}
    parallel = [v for k, v in ratios.items() if not k.startswith("one process")]
    return {"gridweave_over_best_torch": ratios,
            "geometric_mean_parallel": math.exp(statistics.fmean(math.log(v) for v in parallel)) if parallel else None,
            "worst_parallel": min(parallel) if parallel else None}


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    grids_ = list(dict.fromkeys((r["ranks"], r["grid"]) for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 1.5))
    labels, tps, mems, colors = [], [], [], []
    for key in grids_:
        for r in (r for r in rows if (r["ranks"], r["grid"]) == key):
            labels.append(f"{r['grid']} ({r['ranks']}): {r['variant']}")
            tps.append(r["tokens_per_s"])
            mems.append(sum(r["memory_bytes"].values()) / 2 ** 20)
            colors.append("tab:blue" if r["variant"] == "gridweave" else "tab:gray")
    a.barh(labels, tps, color=colors)
    a.invert_yaxis()
    s = data["summary"]
    a.set(xlabel="tokens/s (global batch over the median step)",
          title=f"gridweave / best torch: geomean {s['geometric_mean_parallel']:.2f}x, worst {s['worst_parallel']:.2f}x")
    b.barh(labels, mems, color=colors)
    b.invert_yaxis()
    b.set(xlabel="MiB per rank held after a step (largest rank)", title="parameters + gradients + optimizer state")
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main():
    ap = bench_parser(__file__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--folder", default=None, help="(the workers') the saved transformers model")
    ap.add_argument("--extra", nargs="*", help="more gridweave variants: TrainConfig fields, e.g. overlap=1,coarsening=64")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = results_dir(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        for n in args.ranks:
            rows += run_ranks(__file__, n, 29941 + n, out, f"vs{n}", "--folder", tmp,
                              *(["--extra", *args.extra] if args.extra else []), transport=args.transport)["rows"]
    data = {"sizes": SIZES, "batch": BATCH, "microbatches": MICRO, "optimizer": OPT, "rounds": ROUNDS,
            "warmup": WARMUP, "transport": args.transport, "rows": rows, "summary": summary(rows)}
    save(out, stem("vs_torch", args.transport), data, plot)
    import gridweave as gw

    for r in rows:
        mem = sum(r["memory_bytes"].values()) / 2 ** 20
        print(f"{r['ranks']} {r['grid']:24s} {r['variant']:40s} {r['tokens_per_s']:8.0f} tok/s {mem:7.2f} MiB  "
              f"loss diff {r['max_rel_loss_diff']:.1e}")
        if r["phases_s"]:
            print("    " + gw.measure.StepPhases.describe(r["phases_s"]))
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
