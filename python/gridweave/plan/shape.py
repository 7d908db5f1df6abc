"""What is planned: the model at a global batch (Model) and a candidate grid (GridShape), whose
check is the one rule `gridweave train` applies too."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .. import pipeline
from ..checkpoint import open_index
from ..errors import GridError
from ..models import ModelConfig
from ..axes import AxesView, ParallelDims
from ..modes import Mode, Sequence
from ..modes import parse as parse_mode
from ..nn.sequence import SeqAttention, check_latent_attention, check_latent_layout


@dataclass(frozen=True)
class Model:
    """The planner's workload: a model (gw.models.ModelConfig, the one model configuration
    train, hf, calibrate and checkpoints share) at a global batch, in a precision."""
    config: ModelConfig
    batch: int  # global batch (sequences per step)
    bytes_per_value: int = 2  # bf16 (2) or fp32 (4) weights, activations and gradients
    embedding: bool = True  # False: the layer stack alone (no embedding, head, loss or optimizer)
    # the attention core as one fused kernel (flash / memory-efficient attention: q, k, v, the
    # output and the log-sum-exp kept), else materialised scores kept for backward (Megatron's
    # 2022 runs, which selective recomputation was made for)
    fused_attention: bool = True
    attention: str = "ring"  # how attention runs over sp (a gw.nn.sequence.SeqAttention value)
    ulysses_degree: int = 1  # attention "usp": the sp ranks of each Ulysses block
    # a mixture of experts: the most loaded expert's slots over the mean (1: balanced routing).
    # The busiest expert's rank sets the step (its grouped GEMM and the rows it receives)
    expert_imbalance: float = 1.0
    fused_loss: bool = False  # the head's projection and loss fused (gw.train's fused_loss): no logits kept
    float8: object = None  # the linears' products in float8 (a gw.float8.Float8Recipe; None: in the model's dtype)
    # the weight-gradient GEMMs add into the held gradients (Megatron-LM's gradient_accumulation_fusion),
    # else each micro-batch after the first adds its gradients in (autograd's AccumulateGrad, gw.train's)
    fused_accumulation: bool = False

    hidden = property(lambda self: self.config.hidden)
    layers = property(lambda self: self.config.layers)
    heads = property(lambda self: self.config.heads)
    seq = property(lambda self: self.config.seq)

    @property
    def vocab(self) -> int:
        """The vocabulary the step computes: 0 for the layer stack alone."""
        return self.config.vocab if self.embedding else 0


def model_of(cfg) -> Model:
    """The planner's Model of a gw.train.TrainConfig: the model `gridweave train` builds from
    it, in its precision, at its global batch."""
    # the trained sequence (an imported model's config holds its longest)
    return Model(dataclasses.replace(cfg.model_config(cfg.vocab), seq=cfg.seq), cfg.batch, cfg.compute.dtype.itemsize,
                 attention=cfg.attention, ulysses_degree=cfg.ulysses_degree, fused_loss=cfg.fused_loss,
                 float8=cfg.compute.float8)


def model_from(source, batch: int, seq: int | None = None, **sizes) -> Model:
    """The planner's Model of a config: a Hugging Face config.json (or the folder holding it) or
    a gridweave model config (a run folder's checkpoint index, an export's model_config.json),
    read by ModelConfig.fields_of. seq defaults to the config's context length; `sizes`
    (hidden, layers, heads, vocab) override it; a config without a vocabulary plans GPT-2's
    padded 51200."""
    p = Path(source)
    candidates = [p] if p.is_file() else [p / "config.json", p / "model_config.json", p / "checkpoint" / "latest"]
    path = next((c for c in candidates if c.exists()), None)
    if path is None:
        raise GridError(f"model {source}: not a config.json or a folder holding one")
    if path.name == "latest":  # a run folder: its newest checkpoint's index
        d = open_index(p / "checkpoint")[1]["config"]["model"]
    else:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise GridError(f"model {path}: not a readable JSON config ({e})") from None
    found = {"family": "gpt", "vocab": 51200, **ModelConfig.fields_of(d)}
    found.update({k: v for k, v in sizes.items() if v})
    if seq:
        found["seq"] = seq
    missing = [k for k in ("hidden", "layers", "heads", "seq") if k not in found]
    if missing:
        raise GridError(f"model {source}: no {', '.join(missing)} in the config; give {', '.join(missing)}")
    return Model(ModelConfig(**{k: v for k, v in found.items() if k in ModelConfig.__dataclass_fields__}), batch)


# ---- a grid ------------------------------------------------------------------------------


PLACEMENTS = ("topology", "naive")  # the engine's placement policies (cpp/placement.h)


@dataclass(frozen=True)
class GridShape:
    """A candidate grid: degrees, the tensor mode object, the placement policy, the optimizer's
    ZeRO stage and the pipeline's schedule. `check` is `gridweave train`'s rule for a grid
    (TrainConfig.grid_shape calls it), so every grid the planner ranks is one train accepts."""
    dp: int = 1
    pp: int = 1
    tp: Mode = Sequence()
    sp: int = 1
    placement: str = "topology"
    zero: int = 0  # the ZeRO stage of the optimizer (gw.optim.DistributedAdam above 0)
    schedule: str = pipeline.AUTO  # the pipeline's schedule (a gw.pipeline.SCHEDULE_NAMES name)
    chunks: int = 1  # model chunks per pipeline stage (interleaved; ZB-V and DualPipeV: 2, in a V)
    ep: int = 1  # a mixture of experts: expert parallelism, carved out of dp x sp (nn.moe.expert_line)

    def __post_init__(self):
        if not isinstance(self.tp, Mode):
            raise GridError(f"tp must be a mode object (gw.Row(n), gw.Cube(p), ...), got {self.tp!r}")
        self.dims()  # the degrees' own checks
        if self.placement not in PLACEMENTS:
            raise GridError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.zero not in (0, 1, 2, 3):
            raise GridError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero and self.dp * self.sp == 1:
            raise GridError(f"zero={self.zero} shards the optimizer state over the data axes; this grid has dp 1 "
                            "and sp 1 (zero=0, or more ranks for dp)")
        if self.schedule not in pipeline.SCHEDULE_NAMES:
            raise GridError(f"schedule must be one of {sorted(pipeline.SCHEDULE_NAMES)}, got {self.schedule!r}")
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise GridError(f"chunks must be a positive integer, got {self.chunks!r}")
        pipeline.check_chunks(self.schedule, self.chunks)
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise GridError(f"ep must be a positive integer, got {self.ep!r}")

    def check(self, model: Model, microbatches: int, ac=1) -> None:
        """A GridError unless `gridweave train` runs `model` on this grid in `microbatches`
        micro-batches with activation checkpointing `ac`: the model's layers, heads and sequence
        split over the degrees, the batch into dp shards of whole micro-batches in the mode's
        layout, the attention over sp, the schedule's and ZeRO's needs. One rule: train checks
        a job with it before any rank starts, the planner every grid it ranks."""
        cfg, dims = model.config, self.dims()
        attn = SeqAttention(model.attention)
        zigzag = attn.zigzag(cfg.causal)
        dims.check_model(cfg.layers, cfg.heads, cfg.hidden, cfg.seq, cfg.kv_heads, zigzag=zigzag, chunks=self.chunks)
        dims.check_batch(model.batch, microbatches)
        self.tp.check_attention(model.attention)
        attn.check(self.sp, model.ulysses_degree, cfg.heads // self.tp.head_groups_count())
        # a micro-batch in the layer's input layout: every sequence split at once (the zigzag's
        # chunks, tp's pieces), the replica's rows split as the mode splits them
        view = AxesView(dict(dims.axes()))
        layout = self.tp.layout(view, zigzag, attn.ring(self.sp, model.ulysses_degree))
        layout.without("dp").local_shape((model.batch // self.dp // microbatches, cfg.seq, cfg.hidden), view)
        if cfg.mla is not None:
            check_latent_layout(layout, f"tp {self.tp.spec()} with sp {self.sp}")
        if cfg.mla is not None and self.sp > 1:
            check_latent_attention(attn, cfg.mla)
        if self.schedule == "interleaved" and (self.pp < 2 or microbatches % self.pp):
            raise GridError(f"the interleaved schedule needs pp >= 2 and microbatches a multiple of pp, got pp "
                            f"{self.pp}, microbatches {microbatches}")
        if self.schedule in pipeline.TABLES:
            if self.pp < 2:
                raise GridError(f"the {self.schedule} schedule needs pp >= 2, got pp {self.pp}")
            if self.zero == 3:
                raise GridError(f"zero=3 with schedule={self.schedule}: ZeRO-3 gathers a layer's parameters for each "
                                "forward and backward and frees them after, and W runs a layer's weight gradients "
                                "later, apart from its backward; use zero 1 or 2, or schedule 1f1b or interleaved")
            pipeline.table_for(self.schedule, self.pp, microbatches, self.chunks)  # the table's own needs
        if cfg.tie and self.pp > 1:
            raise GridError("tie needs the embedding and the head on one pipeline stage (pp 1)")
        why = pipeline.fixed_order_reason(self.pp, self.dp, self.zero, cfg.moe is not None)
        if why and self.schedule == "message_driven":
            raise GridError(f"schedule=message_driven on pp {self.pp} x dp {self.dp}: {why}, and the message-driven "
                            "schedule runs micro-batches as their messages arrive, so a stage's replicas could take "
                            "them in different orders; use schedule auto (1F1B here), 1f1b or interleaved")
        pipeline.resolve_ac(ac, cfg.layers // (self.pp * self.chunks), cfg.layers)
        self.check_experts(cfg)

    def resolved_schedule(self, cfg) -> str:
        """The schedule this grid runs model config `cfg` with (auto decided: pipeline.resolve_schedule)."""
        return pipeline.resolve_schedule(self.schedule, self.pp, self.dp, self.zero, cfg.moe is not None)

    def check_experts(self, cfg) -> None:
        """A mixture of experts' needs: whole tokens at the MLP or experts split as the MLP is
        (tp none or row:N), ep dividing dp x sp (its line is carved out of them) and the experts,
        tp dividing each expert's width."""
        if cfg.moe is None:
            if self.ep > 1:
                raise GridError(f"ep={self.ep} splits a mixture of experts; this model has none")
            return
        if self.tp.moe_token_axes() is None:
            raise GridError(f"a mixture of experts: tp {self.tp.spec()} splits each token's hidden vector at the MLP; "
                            "experts run whole tokens or split as the MLP (tp none or row:N)")
        if (self.dp * self.sp) % self.ep:
            raise GridError(f"ep={self.ep} does not divide dp x sp = {self.dp} x {self.sp} (experts are split over "
                            "data-parallel ranks)")
        if cfg.moe.experts % self.ep:
            raise GridError(f"{cfg.moe.experts} experts do not split over ep={self.ep}")
        if self.tp.moe_tensor_axis()[0] is not None and cfg.moe.ffn % self.tp.ranks():
            raise GridError(f"experts of width {cfg.moe.ffn} do not split over tp {self.tp.ranks()} (expert tensor "
                            "parallelism splits each expert as the MLP)")

    def spec(self) -> str:
        """The grid as `--grid` writes it (GridShape.parse reads it back)."""
        return (f"dp={self.dp},pp={self.pp},tp={self.tp.spec()},sp={self.sp},zero={self.zero},"
                f"placement={self.placement},schedule={self.schedule},chunks={self.chunks}"
                + (f",ep={self.ep}" if self.ep > 1 else ""))

    @classmethod
    def parse(cls, spec: str) -> "GridShape":
        """A grid written as `gridweave plan --grid` takes it: comma-separated key=value of dp, pp,
        sp, zero, chunks, ep (integers), tp (a mode's spec: row:8, cube:4, ...), placement and
        schedule, e.g. "dp=32,pp=8,tp=row:8"; a key left out takes GridShape's default."""
        keys = ("dp", "pp", "sp", "zero", "chunks", "ep", "tp", "placement", "schedule")
        fields = {}
        for item in filter(None, (p.strip() for p in str(spec).split(","))):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or key not in keys:
                raise GridError(f"grid {spec!r}: {item!r} is not one of {', '.join(k + '=' for k in keys)}")
            if key in fields:
                raise GridError(f"grid {spec!r}: {key} given twice")
            if key == "tp":
                fields[key] = parse_mode(value)
            elif key in ("placement", "schedule"):
                fields[key] = value  # checked by the constructor
            else:
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise GridError(f"grid {spec!r}: {key} must be an integer, got {value!r}") from None
        try:
            return cls(**fields)
        except GridError as e:
            raise GridError(f"grid {spec!r}: {e}") from None

    def dims(self) -> ParallelDims:
        return ParallelDims(dp=self.dp, pp=self.pp, sp=self.sp, tp=self.tp)

    def tp_ranks(self) -> int:
        return self.tp.ranks()

    def axes(self):
        return self.dims().axes()
