"""The main job's configuration (torchtitan's JobConfig): typed sections mirroring the TOML file
(model, moe, parallelism, training, optimizer, data, checkpoint, logging; launch for the launcher),
each declaring its fields once (type, default, help, the values it takes) and validating itself.
The command line's flags (cli), the TOML keys (configfile) and the configuration reference (docs)
are generated from these declarations.

`TrainConfig` is every section at once (a dataclass inheriting them), so today's flat keywords,
`cfg.hidden` and `dataclasses.replace` keep working and `isinstance(cfg, OptimizerSection)` holds:
a component that needs one section can be handed the whole configuration.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from . import checkpoint, data, float8, launch, loggers, models, optim, pipeline, plan
from .axes import ParallelDims
from .data import TOKEN_DTYPES
from .errors import GridError
from .models import ModelConfig
from .modes import Mode, parse
from .nn.dense import MLA
from .nn.moe import MoE, Scoring, expert_line
from .nn.sequence import SeqAttention
from .precision import PRECISIONS, Precision

AUTO = "auto"  # resume=auto: the newest complete checkpoint of out, if any
GIVEN = "given"  # grid=given: the degrees the job names
PAD_VOCAB = 64  # the model's vocabulary is the tokenizer's rounded up (Megatron's divisible-by)
# the mixture-of-experts models: Mixtral's block; Qwen2-MoE's (q/k/v biases, a gated shared expert,
# top-k weights as the softmax gives them); Qwen3-MoE's (per-head q/k norms, renormalised top-k)
MOE_MODELS = ("mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3")
DEEPSEEK = "deepseek-v3"  # DeepSeek-V3's: latent attention, sigmoid routing with the balancing bias, shared experts


def option(default, help: str = "", *, choices=None, at_least=None, above=None, flags=(), cli=None):
    """A field of a section, declared once: its default and help; `choices` (the values it takes,
    checked here and offered by the command line); `at_least` / `above` (a number's bounds,
    checked here); `flags`: extra command-line spellings ((flag, argparse keywords), e.g. a
    --no-offload); `cli`: argparse keywords that replace the generated ones."""
    meta = dict(help=help, choices=choices, at_least=at_least, above=above, flags=flags, cli=cli)
    return field(default=default, metadata=meta)


def _bound_error(name, v, at_least, above, integer) -> str | None:
    """The one-line reason a value breaks its declared bounds, or None."""
    if integer:
        at_least = at_least or 0
        if not isinstance(v, int) or isinstance(v, bool) or v < at_least:
            return f"{name} must be a {'positive' if at_least else 'non-negative'} integer, got {v!r}"
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if above is not None and not (ok and v > above):
        return f"{name} must be a finite positive number, got {v!r}" if above == 0 else \
            f"{name} must be a finite number > {above}, got {v!r}"
    if at_least is not None and not (ok and v >= at_least):
        return f"{name} must be a finite number >= {at_least}, got {v!r}"
    return None


class Section:
    """One table of the TOML file: NAME, its own fields, and check() (its declared choices and
    bounds, then the section's own rules). Every section validates at construction."""
    NAME: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""  # the command line's group heading

    @classmethod
    def declared(cls) -> tuple:
        """The fields this section itself declares (not its bases'), in declaration order."""
        own = inspect.get_annotations(cls)
        return tuple(f for f in dataclasses.fields(cls) if f.name in own and f.init)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in cls.declared())

    def check_declared(self, section: type) -> None:
        """`section`'s declared choices and bounds on this object's values."""
        for f in section.declared():
            v, meta = getattr(self, f.name), f.metadata
            allowed = meta["choices"]
            if allowed is not None and v not in allowed:
                if all(isinstance(c, int) for c in allowed):  # a stage number: "0, 1, 2 or 3"
                    raise GridError(f"{f.name} must be {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, got {v!r}")
                raise GridError(f"{f.name} must be one of {', '.join(map(str, allowed))}, got {v!r}")
            bounded = meta["at_least"] is not None or meta["above"] is not None
            why = bounded and _bound_error(f.name, v, meta["at_least"], meta["above"], integer=f.type == "int")
            if why:
                raise GridError(why)

    def rules(self) -> None:
        """The section's own rules beyond its fields' declarations (the values already checked)."""

    def check_section(self, section: type) -> None:
        """`section`'s checks on this object: its declared choices and bounds, then its rules."""
        self.check_declared(section)
        section.rules(self)

    def check(self) -> None:
        self.check_section(type(self))

    def __post_init__(self):
        self.check()


@dataclass
class ModelSection(Section):
    NAME: ClassVar[str] = "model"
    TITLE: ClassVar[str] = "model"
    model: str = option("llama", "the architecture: Llama's block, a mixture of experts (Mixtral's, Qwen2-MoE's, "
                                 "Qwen3-MoE's, DeepSeek-V3's), the GPT, or BERT's masked LM",
                        choices=("llama", *MOE_MODELS, "gpt", "bert"))
    init_from: str | None = option(None, "a local Hugging Face model folder (Llama, GPT-2, Mixtral, Qwen-MoE: "
                                         "config.json, safetensors, tokenizer.json): its model, weights and tokenizer, "
                                         "on any grid; steps 0 converts it to a checkpoint")
    hidden: int = option(128, "the model's width", at_least=1)
    heads: int = option(8, "attention heads", at_least=1)
    kv_heads: int = option(0, "key/value heads (0: the family's default: Llama heads / 2 when even, GPT heads)",
                           at_least=0)
    layers: int = option(4, "transformer layers", at_least=1)
    ffn_hidden: int = option(0, "the feed-forward width (0: the family's default: Llama's SwiGLU 8h/3 rounded to 8, "
                                "GPT 4h)", at_least=0)
    tie: bool = option(False, "tie the embedding and the head (pp 1)")
    rope_theta: float = option(10000.0, "rotary embeddings' base", above=0)
    seq: int = option(128, "the context length (tokens a sample)", at_least=1)
    attention: str = option("ring", "with sp: blockwise ring attention (zigzag), Li et al.'s RSA, DeepSpeed-Ulysses "
                                    "(all-to-all to head shards), USP (Ulysses inside blocks of ulysses_degree sp "
                                    "ranks, the ring across), or Linformer (model bert)",
                            choices=tuple(a.value for a in SeqAttention))
    ulysses_degree: int = option(1, "attention usp: the sp ranks of each Ulysses block", at_least=1)
    linformer_k: int = option(0, "attention linformer (model bert): keys and values projected from seq to K rows "
                                 "(Li et al. §4.3: the projections split over the sequence shards)", at_least=0)
    kv_rank: int = option(0, "model deepseek-v3: the keys' and values' latent (0: hidden / 2)", at_least=0)
    q_rank: int = option(-1, "model deepseek-v3: the queries' latent (-1: three times kv_rank, DeepSeek-V3's ratio; "
                             "0: the queries projected directly, DeepSeek-V2-Lite's)", at_least=-1)
    qk_nope_dim: int = option(0, "model deepseek-v3: each head's query and key dimensions without positions "
                                 "(0: hidden / heads)", at_least=0)
    qk_rope_dim: int = option(0, "model deepseek-v3: each head's rotary dimensions, the key's shared by the heads "
                                 "(0: half of qk_nope_dim, even)", at_least=0)
    v_dim: int = option(0, "model deepseek-v3: each head's value dimensions (0: qk_nope_dim)", at_least=0)
    precision: str = option("fp32", "compute dtype; fp16 with dynamic loss scaling; fp8 and fp8-rowwise: the linear "
                                    "layers' products in float8 (torchao's tensorwise and rowwise recipes), bf16 elsewhere; "
                                    "fp32 master weights always",
                            choices=tuple(sorted(PRECISIONS)))

    def rules(self):
        self.compute = Precision.parse(self.precision)
        if (self.attention == SeqAttention.LINFORMER.value) != bool(self.linformer_k):
            raise GridError("attention=linformer and linformer_k go together (Linformer's K rows; model bert), got "
                            f"attention={self.attention}, linformer_k={self.linformer_k}")

    @property
    def masked_lm(self) -> bool:
        """The encoder's objective (model bert): predict the masked tokens (data.masked_lm)."""
        return self.model in models.dense.ENCODERS


@dataclass
class MoESection(Section):
    NAME: ClassVar[str] = "moe"
    TITLE: ClassVar[str] = "mixture of experts (model mixtral, qwen2-moe or qwen3-moe)"
    experts: int = option(8, "routed experts per layer", at_least=1)
    top_k: int = option(2, "experts per token", at_least=1)
    moe_ffn: int = option(0, "each expert's hidden width (0: ffn_hidden's default)", at_least=0)
    capacity_factor: float = option(0.0, "each expert's slots, as a multiple of an even share (0: dropless)",
                                    at_least=0)
    aux_coef: float = option(0.01, "the load-balancing loss's coefficient (Switch's 0.01, Mixtral)", at_least=0)
    z_coef: float = option(0.0, "the router z-loss's coefficient (ST-MoE's 0.001)", at_least=0)
    shared_ffn: int = option(0, "an always-on shared expert of this width (Qwen-MoE, DeepSeek; 0: none)", at_least=0)
    scoring: str = option(AUTO, "the router's scores: softmax over the experts (Mixtral, Qwen) or each expert's "
                                "sigmoid (DeepSeek-V3); auto: the model's",
                          choices=(AUTO, *(s.value for s in Scoring)))
    routed_scale: float = option(1.0, "the routed experts' weights times this (DeepSeek-V3's routed scaling factor)",
                                 above=0)
    expert_groups: int = option(1, "group-limited routing: the experts in this many groups (DeepSeek-V3's n_group; "
                                   "a node's experts, node-limited)", at_least=1)
    topk_groups: int = option(1, "group-limited routing: a token's experts from the groups whose two best scores sum "
                                 "highest, this many (DeepSeek-V3's topk_group)", at_least=1)
    bias_rate: float = option(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): each expert's bias, added to the "
                                   "scores for the choice only, moved this much a step toward an even load (0: no "
                                   "bias; DeepSeek-V3's 0.001)", at_least=0)
    seq_aux_coef: float = option(0.0, "DeepSeek-V3's sequence-wise balance loss's coefficient (its 0.0001)",
                                 at_least=0)
    dense_first: int = option(0, "the first K layers' MLPs dense, ffn_hidden wide (DeepSeek-V3's "
                                 "first_k_dense_replace)", at_least=0)
    moe_overlap: bool = option(False, "with ep > 1 and a shared expert: its halves computed while the dispatch's "
                                      "and the combine's rows move, their backwards while the reverse exchanges do "
                                      "(Megatron-Core's shared-expert overlap)")


@dataclass
class ParallelismSection(Section):
    NAME: ClassVar[str] = "parallelism"
    TITLE: ClassVar[str] = "parallelism (the grid)"
    dp: int = option(0, "data parallelism (0: the rest of the world once the other degrees are taken)", at_least=0)
    pp: int = option(0, "pipeline stages (0: 2 where it divides, else 1)", at_least=0)
    tp: Mode | str | None = option(None, "the tensor mode: none | row:N | square:Q | cube:P | subgraph:G | csub:G "
                                         "(none when left out)")
    sp: int = option(1, "sequence parallelism (the sequence split over sp ranks)", at_least=1)
    ep: int = option(1, "expert parallelism: experts split over ep data-parallel ranks (dp x sp, sp fastest), "
                        "tokens dispatched and combined with all-to-all", at_least=1)
    tp_sp: bool = option(False, "with tp row:N: Megatron's sequence parallelism (norms and residuals on sequence "
                                "shards)")
    placement: str = option("topology", "how the grid's axes map onto nodes and ranks (SUPER's placement)",
                            choices=plan.PLACEMENTS)
    overlap: bool = option(False, "3-D: prefetch the next weights' all-gathers")
    schedule: str = option(AUTO, "the pipeline's schedule; auto: message_driven unless a micro-batch runs a "
                                 "collective over the data axes (ZeRO-3, a mixture of experts over dp), then 1f1b; "
                                 "zb1, zbv, dualpipev: zero-bubble (the backward split into input and weight "
                                 "gradients; zbv and dualpipev run 2 chunks a stage in a V)",
                           choices=tuple(sorted(pipeline.SCHEDULE_NAMES)))
    chunks: int = option(1, "model chunks per pipeline stage (schedule interleaved: Megatron's virtual stages; "
                            "zbv and dualpipev: 2, taken when 1 is given)", at_least=1)
    pipeline_limit: int = option(0, "the message-driven pipeline's micro-batches in flight (0: no limit)",
                                 at_least=0)
    zero: int = option(0, "ZeRO stage: 1 shards the fp32 master weights and Adam states over the data axes, 2 the "
                          "gradients too, 3 the parameters too (gathered a layer at a time; with pp > 1 it needs schedule "
                          "auto, 1f1b or interleaved)", choices=(0, 1, 2, 3))
    zero_shard_group: str = option(optim.ShardGroup.ALL.value,
                                   "ZeRO's shard group: all data ranks, or those of one node with a replica per node "
                                   "(hybrid sharding)", choices=tuple(g.value for g in optim.ShardGroup))
    backend: str = option("auto", "the transport (mpirun implies mpi)", choices=("auto", "gloo", "nccl", "mpi"))
    device: str = option("auto", "auto: cuda when every rank can have a GPU; cuda with fewer GPUs than ranks shares "
                                 "them through Gloo", choices=("auto", "cpu", "cuda"))
    timeout: float = option(120.0, "seconds any one communication may take before the grid aborts", above=0)
    grid: str = option(GIVEN, "given: the degrees above; auto: the planner's fastest grid that fits the world, the "
                              "model, the batch and the memory per rank (dp, pp, tp, sp, ep, the ZeRO stage, the "
                              "schedule and the placement chosen, printed with the runner-up and why)",
                       choices=(GIVEN, AUTO))
    cluster: str = option("local", "the machine grid auto plans for: a preset (v100-ib, a100-ib, h100-ib; local: "
                                   "this kind of machine) or a cluster JSON file (gridweave bench --calibrate "
                                   "writes one)")

    def rules(self):
        self.mode = self.tp if isinstance(self.tp, Mode) else parse(self.tp or "none")
        if not isinstance(self.tp, Mode):
            self.tp = self.mode.spec()  # written once: None, "none" (a file's) and a flag's spelling compare equal
        if self.grid == AUTO:
            chosen = {"dp": 0, "pp": 0, "tp": "none", "sp": 1, "ep": 1, "zero": 0, "schedule": pipeline.AUTO,
                      "chunks": 1, "tp_sp": False, "placement": "topology"}
            given = [k for k, default in chosen.items() if getattr(self, k) != default]
            if given:
                raise GridError(f"grid auto chooses {', '.join(chosen)}: leave out {', '.join(given)} (or give the "
                                "whole grid with grid given)")
        if self.tp_sp:
            if not hasattr(self.mode, "sequence"):
                raise GridError(f"tp_sp is Megatron's sequence parallelism inside 1-D tensor parallelism (tp row:N); "
                                f"tp is {self.mode.spec()}")
            self.mode = dataclasses.replace(self.mode, sequence=True)
        if self.zero_shard_group != optim.ShardGroup.ALL.value and not self.zero:
            raise GridError(f"zero_shard_group={self.zero_shard_group} is hybrid sharding: it needs zero 1, 2 or 3")
        if self.schedule in pipeline.V_SCHEDULES and self.chunks == 1:
            self.chunks = 2  # a V's two chunks, the schedule's own
        pipeline.check_chunks(self.schedule, self.chunks)


@dataclass
class TrainingSection(Section):
    NAME: ClassVar[str] = "training"
    TITLE: ClassVar[str] = "training"
    steps: int = option(300, "optimizer steps (0: a conversion of init_from to a checkpoint)", at_least=0)
    batch: int = option(32, "samples a step (the global batch)", at_least=1)
    microbatches: int = option(2, "micro-batches a step (the pipeline's)", at_least=1)
    seed: int = option(0, "the model's initialisation and the data order")
    val_every: int = option(50, "validate every K steps (0: never)", at_least=0)
    val_samples: int = option(32, "validation samples", at_least=1)
    ac: str | int = option(1, "activation checkpointing: none | auto (AxoNN's optimal) | N (every N-th layer's "
                              "input kept)")
    fused_loss: bool = option(False, "the head's vocabulary projection and the cross-entropy fused, chunk by chunk "
                                     "of tokens, their gradients made in the forward (Liger-Kernel's fused linear "
                                     "cross-entropy): no token's logits are kept for the backward")
    max_bad_steps: int = option(3, "consecutive steps with a non-finite loss or gradient norm before the run stops",
                                at_least=1)
    sample_tokens: int = option(48, "tokens of the end-of-run sample", at_least=0)
    prompt: str = option("", "the end-of-run sample's prompt (default: a validation snippet)")

    def rules(self):
        if isinstance(self.ac, str) and self.ac.isdigit():
            self.ac = int(self.ac)
        if self.ac == "none":
            self.ac = 1
        if not (self.ac == "auto" or (isinstance(self.ac, int) and not isinstance(self.ac, bool) and self.ac >= 1)):
            raise GridError(f"ac must be 'none', 'auto' or a positive integer, got {self.ac!r}")


@dataclass
class OptimizerSection(Section):
    NAME: ClassVar[str] = "optimizer"
    TITLE: ClassVar[str] = "optimizer"
    lr: float = option(3e-3, "the peak learning rate (after warmup; cosine decay to min_lr)", above=0)
    min_lr: float = option(3e-4, "the learning rate at the last step, in [0, lr]")
    warmup: int = option(10, "linear warmup steps", at_least=0)
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay", at_least=0)
    max_grad_norm: float | None = option(1.0, "global gradient-norm clipping (0: none)")
    bsize: int = option(1 << 14, "OffloadAdam's bucket: elements moved and updated at a time (AxoNN's bsize)",
                        at_least=1)
    coarsening: int = option(64, "OffloadAdam's all-reduce chunks of coarsening x bsize elements (AxoNN's k)",
                             at_least=1)
    offload: bool | str = option("auto", "the optimizer state in host memory (on: AxoNN's buckets), on the device "
                                         "(off), or auto: host memory on CPU ranks, the device on GPUs unless it "
                                         "does not fit there",
                                 cli=dict(choices=["auto", "on", "off"]),
                                 flags=(("--no-offload", dict(dest="offload", action="store_const", const="off",
                                                              help="the optimizer state on the device (--offload "
                                                                   "off)")),))
    overlap_grad_reduce: bool = option(True, "OffloadAdam: start each gradient chunk's all-reduce in the backward "
                                             "that completes it (torch DDP's buckets), or after it")

    def rules(self):
        self.offload = {"on": True, "off": False}.get(self.offload, self.offload)
        if self.offload not in (True, False, "auto"):
            raise GridError(f"offload must be true, false or auto (on, off), got {self.offload!r}")
        if not (isinstance(self.min_lr, (int, float)) and math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise GridError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.max_grad_norm == 0:
            self.max_grad_norm = None  # 0: no clipping
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive (0: no clipping), got {self.max_grad_norm!r}")


@dataclass
class DataSection(Section):
    NAME: ClassVar[str] = "data"
    TITLE: ClassVar[str] = "data"
    data: str | None = option(None, "a text file or folder (default: the fortunes corpus); JSON Lines, Parquet or "
                                    "Arrow files or folders (read through the datasets library, streamed); "
                                    "pre-tokenized nanoGPT .bin files (a .bin, or a folder with train.bin and "
                                    "val.bin; token_dtype)")
    text_field: str = option("text", "the records' field holding the text")
    token_dtype: str | None = option(None, "the dtype of pre-tokenized .bin files (nanoGPT: uint16)",
                                     cli=dict(choices=TOKEN_DTYPES))  # data.source checks it
    data_cache: str | None = option(None, "a node-local folder for the token file: each node's first rank tokenizes "
                                          "the corpus there ('{host}' becomes the node's hostname); default: rank 0 "
                                          "into out, which every node must share")
    tokenizer: str = option("bpe", "bpe (trained on the corpus, vocab tokens), bytes, or PATH: an existing "
                                   "tokenizer.json (or a folder holding one, e.g. a local GPT-2's): the corpus is "
                                   "tokenized with it")
    vocab: int = option(1024, "the BPE vocabulary's size", at_least=1)
    data_timeout: float = option(3600.0, "seconds the data's preparation (tokenizer, token file) may take; the other "
                                         "ranks wait that long, not the communication timeout", above=0)
    pack_documents: bool = option(False, "packed documents: attention within each document of a window, positions "
                                         "restarting at each")
    balance_documents: bool = option(True, "packed documents over a ring (sp with attention ring or usp): each rank's "
                                           "chunks of a window dealt by attention work, the blocks no document "
                                           "crosses skipped (off: the zigzag by position, every block computed)")

    def rules(self):
        if not isinstance(self.tokenizer, str):
            raise GridError(f"tokenizer must be bpe, bytes or the path of a tokenizer.json, got {self.tokenizer!r}")
        if self.tokenizer == "bytes":
            self.vocab = 256


@dataclass
class CheckpointSection(Section):
    NAME: ClassVar[str] = "checkpoint"
    TITLE: ClassVar[str] = "checkpoint"
    out: str = option("runs/latest", "the run folder: checkpoints, metrics, logs, the resolved config")
    resume: str | None = option(None, "a run folder whose checkpoint to continue from; auto: out's newest complete "
                                      "checkpoint, or a fresh start when it has none")
    checkpoint_every: int = option(0, "a checkpoint every K steps (0: at the end only)", at_least=0)
    async_save: bool = option(True, "write periodic checkpoints while the next step trains",
                              flags=(("--sync-save", dict(dest="async_save", action="store_false",
                                                          help="write periodic checkpoints before the next step "
                                                               "(--no-async-save)")),))


@dataclass
class LoggingSection(Section):
    NAME: ClassVar[str] = "logging"
    TITLE: ClassVar[str] = "logging"
    quiet: bool = option(False, "no progress bar or lines (errors still say one line)")
    log: str = option("auto", "where the numbers go besides metrics.json: tensorboard, wandb, jsonl (a comma list), "
                              "auto (every installed one; W&B offline without its server), none; under OUT/logs")
    log_all_ranks: bool = option(False, "every rank logs (OUT/logs/rank<R>), not rank 0 alone")
    phase_times: bool = option(False, "time each step's phases (forward, backward, reduction, optimizer, waiting, "
                                      "bookkeeping): metrics.json and the closing line; on GPUs each phase boundary "
                                      "synchronises the device")
    host_reads: bool = option(False, "count what makes the host wait for the device in each training step (value "
                                     "reads, tensors made from Python data), by where: metrics.json's host_reads")
    straggler_threshold: float = option(0.0, "name a rank whose forward and backward take more than this fraction "
                                             "longer than its pipeline stage's median rank (e.g. 0.3), straggler_windows "
                                             "windows running (0: off; on: every phase timed, as phase_times)",
                                        at_least=0)
    straggler_every: int = option(10, "steps in a straggler window (one all-gather of each rank's times each)",
                                  at_least=1)
    straggler_windows: int = option(2, "windows running a rank must be slow in before it is named", at_least=1)

    def rules(self):
        self.sinks = loggers.parse(self.log)  # an unknown or missing logger: before any rank starts


@dataclass
class LaunchSection(Section):
    """The launcher's: where the ranks run and how they start (launch.Nodes checks the nodes). Not a
    rank's job: TrainConfig does not hold it."""
    NAME: ClassVar[str] = "launch"
    TITLE: ClassVar[str] = "launch (torchrun's words; the same command on every node, --node-rank apart)"
    nproc: int = option(8, "ranks to spawn on this node (0, or left out under torchrun / mpirun / srun --mpi: this "
                           "process is one of the launcher's ranks)", at_least=0)
    nnodes: int | str = option(1, "machines in the job, each starting nproc ranks: N, or MIN:MAX (torchrun's elastic "
                                  "rendezvous: each restart runs on the nodes there are, MIN to MAX, the grid derived "
                                  "again for that world)")
    node_rank: int = option(0, "this machine's index (0: the master)")
    master_addr: str | None = option(None, "the master's address or hostname, as every node reaches it (each node "
                                           "finds its own address on that route; GRIDWEAVE_HOSTNAME overrides); "
                                           "default with one node: 127.0.0.1")
    master_port: int | None = option(None, f"the rendezvous port (default: ${launch.PORT_ENV} or "
                                           f"{launch.DEFAULT_PORT})")
    max_restarts: int = option(0, "torchrun's: restart every node's ranks up to N times when one fails, continuing "
                                  "from the newest checkpoint (needs resume auto)")
    launcher: str = option("auto", "how nproc ranks are spawned: torchrun (Gloo/NCCL) or mpirun (the MPI transport); "
                                   "auto: mpirun with a hostfile or backend mpi, torchrun with torchrun's multi-node "
                                   "words, else the transport's", choices=("auto", "torchrun", "mpirun"))
    hostfile: str | None = option(None, "launcher mpirun: the nodes (mpirun's hostfile); mpirun, run once on the "
                                        "first, starts nproc ranks on each of the first nnodes")

    def rules(self):
        launch.node_range(self.nnodes)  # N or MIN:MAX


def choices(name: str) -> tuple:
    """The values a field takes, as its section declares them."""
    f = next(s.__dataclass_fields__[name] for s in SECTIONS if name in s.__dataclass_fields__)
    return f.metadata["choices"]


# The TOML file's tables in order; TrainConfig is all but launch.
JOB_SECTIONS = (ModelSection, MoESection, ParallelismSection, TrainingSection, OptimizerSection, DataSection,
                CheckpointSection, LoggingSection)
SECTIONS = (*JOB_SECTIONS, LaunchSection)


@dataclass
class TrainConfig(LoggingSection, CheckpointSection, DataSection, OptimizerSection, TrainingSection,
                  ParallelismSection, MoESection, ModelSection):
    """Everything the main job takes (the command line fills one: gridweave train --help): every
    section's fields, flat, each section checking its own, then the rules that join sections."""
    NAME: ClassVar[str] = ""
    mode: Mode = field(init=False, repr=False)
    compute: Precision = field(init=False, repr=False)
    sinks: tuple = field(init=False, repr=False)
    imported: ModelConfig | None = field(init=False, repr=False)  # init_from's model

    def check(self):
        for section in JOB_SECTIONS:
            self.check_section(section)
        if self.pack_documents and self.masked_lm:
            raise GridError("pack_documents is the decoders': the masked LM (model bert) trains on whole windows")
        self.imported = self._imported_model() if self.init_from is not None else None
        if self.ep > 1 and self.model not in MOE_MODELS:
            raise GridError(f"ep={self.ep} splits a mixture of experts: it needs model {' or '.join(MOE_MODELS)}, "
                            f"got {self.model}")
        model = self.model_config(self.vocab)  # the model's own checks (heads vs hidden, kv heads, Linformer)
        if self.moe_overlap and (self.ep < 2 or model.moe is None or not model.moe.shared_ffn):
            raise GridError(f"moe_overlap computes the shared expert during the experts' dispatch: it needs ep > 1 and "
                            f"a shared expert (shared_ffn), got ep {self.ep}, shared_ffn "
                            f"{model.moe.shared_ffn if model.moe is not None else 0}")

    def section(self, section: type) -> Section:
        """This configuration's values of one section, as that section's own (checked) object."""
        return section(**{name: getattr(self, name) for name in section.names()})

    def _imported_model(self) -> ModelConfig:
        """init_from's model (its config.json), which sets this run's model fields: one given here
        as well must agree. Its vocabulary is kept (no padding), so it must split over the
        vocabulary axis; the run's sequence fits its positions."""
        m = models.hf.read_config(self.init_from, models.hf.DECODERS)[0]  # init_from: the decoders (Llama, GPT-2)
        theirs = {"model": m.family, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads or m.heads,
                  "layers": m.layers, "ffn_hidden": m.ffn_hidden or 0, "tie": m.tie, "rope_theta": m.rope_theta}
        if m.moe is not None:  # a Mixtral or Qwen-MoE folder: its experts are this run's
            theirs.update(model=models.hf.hf_kind(m).replace("_", "-"), experts=m.moe.experts, top_k=m.moe.top_k,
                          moe_ffn=m.moe.ffn, aux_coef=m.moe.aux_coef, shared_ffn=m.moe.shared_ffn or 0)
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in theirs}
        for name, v in theirs.items():
            if getattr(self, name) not in (defaults[name], v):
                raise GridError(f"init_from={self.init_from} sets the model: its {name} is {v}, this run asks "
                                f"{getattr(self, name)} (leave {name} out)")
            setattr(self, name, v)
        if self.seq > m.seq:
            raise GridError(f"seq={self.seq} exceeds init_from's {m.seq} positions ({self.init_from})")
        if self.mode.vocab_axis() and m.vocab % self.mode.size:
            raise GridError(f"init_from={self.init_from}: its vocabulary of {m.vocab} does not split over tp "
                            f"{self.mode.spec()}'s {self.mode.size} vocabulary shards (gridweave pads no imported "
                            "vocabulary: padded logits would change its distribution)")
        return m

    def check_vocab(self, tokenizer_vocab: int) -> None:
        """A tokenizer of `tokenizer_vocab` ids fits the imported model's vocabulary."""
        if self.imported is not None and tokenizer_vocab > self.imported.vocab:
            raise GridError(f"the tokenizer ({self.tokenizer_file}) has {tokenizer_vocab} tokens, the model of "
                            f"init_from={self.init_from} {self.imported.vocab}: not the tokenizer it was trained with")

    @property
    def tokenizer_file(self):
        """The existing tokenizer this run uses (tokenizer = a tokenizer.json or a folder holding
        one: a Llama's or GPT-2's from a local folder), or None: trained here (bpe) or bytes."""
        if self.tokenizer == "bpe" and self.init_from is not None:
            return Path(self.init_from) / data.TOKENIZER_FILE  # the imported model's own
        if self.tokenizer in ("bpe", "bytes"):
            return None
        path = Path(self.tokenizer)
        return path / data.TOKENIZER_FILE if path.is_dir() else path

    @property
    def source(self) -> "data.Source":
        """What data holds (text, records, pre-tokenized ids): decided once, from the path."""
        return data.source(self.data, self.text_field, self.token_dtype)

    def model_config(self, vocab: int) -> ModelConfig:
        """The model of this run for a tokenizer of `vocab` tokens (and, for the masked LM, its mask
        token, id `vocab`), padded to a multiple of PAD_VOCAB and of the vocabulary axis (so the
        vocab-parallel head always splits); init_from's model as it is."""
        if self.imported is not None:
            return self.imported
        llama = self.model in ("llama", *MOE_MODELS)
        deepseek = self.model == DEEPSEEK
        kv = self.kv_heads or (self.heads // 2 if llama and self.heads % 2 == 0 and not deepseek else self.heads)
        if deepseek and kv != self.heads:
            raise GridError(f"model deepseek-v3's latent attention has no key/value head count: leave out kv_heads "
                            f"(got {kv} of {self.heads} heads)")
        pad = math.lcm(PAD_VOCAB, self.mode.size if self.mode.vocab_axis() else 1)
        vocab += self.masked_lm
        cfg = ModelConfig("llama" if llama else self.model, -(-vocab // pad) * pad, self.hidden, self.heads,
                          self.layers, self.seq, self.ffn_hidden or None, kv, self.rope_theta, None, self.tie,
                          linformer_k=self.linformer_k or None)
        if self.model not in MOE_MODELS:
            return cfg
        qwen2 = self.model == "qwen2-moe"
        ffn = self.moe_ffn or cfg.ffn
        # Qwen2-MoE always has a gated shared expert: 4 experts wide unless given (Qwen1.5-MoE-A2.7B's);
        # DeepSeek-V3 an ungated one of the experts' width
        shared = self.shared_ffn or (4 * ffn if qwen2 else ffn if deepseek else None)
        scoring = Scoring.SIGMOID if self.scoring == AUTO and deepseek else \
            Scoring.SOFTMAX if self.scoring == AUTO else Scoring(self.scoring)
        moe = MoE(experts=self.experts, top_k=self.top_k, ffn=ffn, normalize=not qwen2,
                  capacity_factor=self.capacity_factor or None, aux_coef=self.aux_coef, z_coef=self.z_coef,
                  shared_ffn=shared, shared_gate=qwen2, scoring=scoring, scale=self.routed_scale,
                  groups=self.expert_groups, topk_groups=self.topk_groups,
                  expert_bias=bool(self.bias_rate) or deepseek, bias_rate=self.bias_rate,
                  seq_aux_coef=self.seq_aux_coef)
        mla = None
        if deepseek:  # DeepSeek-V3's proportions where not given
            nope = self.qk_nope_dim or self.hidden // self.heads
            kv_rank = self.kv_rank or max(self.hidden // 2, 1)
            mla = MLA(kv_rank=kv_rank, q_rank=None if self.q_rank == 0 else self.q_rank if self.q_rank > 0
                      else 3 * kv_rank, nope=nope, rope=self.qk_rope_dim or max(2, nope // 2 // 2 * 2),
                      v=self.v_dim or nope)
            cfg = dataclasses.replace(cfg, kv_heads=None, mla=mla)
        if self.dense_first >= self.layers:
            raise GridError(f"dense_first={self.dense_first}: a mixture-of-experts model keeps at least one sparse "
                            f"layer of its {self.layers}")
        return dataclasses.replace(cfg, moe=moe, qkv_bias=qwen2, qk_norm=self.model == "qwen3-moe",
                                   dense_layers=tuple(range(self.dense_first)))

    def expert_axis(self, grid):
        """The line part of the data axes (dp x sp, sp fastest) that model mixtral's experts split
        over: blocks of ep consecutive ranks (Megatron's and torchtitan's expert-parallel group,
        carved out of the data-parallel ranks; the other part of the line holds the copies)."""
        return expert_line(grid, self.ep)

    def on_grid(self, shape: "plan.GridShape"):
        """This config on `shape` as if the job gave it (grid auto's choice): its degrees, ZeRO
        stage, schedule, chunks and placement."""
        given = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
        return dataclasses.replace(self, grid=GIVEN, **given | {"tp": shape.tp.spec()})

    def grid_shape(self, world: int) -> dict:
        """The grid's axes on `world` ranks: the ones not given derived from the ones given (pp
        from dp when dp is given, else 2 where it divides; dp the rest), and every check of the
        model and batch against them (plan.GridShape.check, the rule the planner ranks grids
        by). The command line calls it before spawning any rank, run() again on every rank:
        one rule, one message."""
        dims = ParallelDims.for_world(world, self.mode, self.sp, self.dp, self.pp, self.layers)
        self.plan_shape(dims.dp, dims.pp).check(plan.model_of(self), self.microbatches, self.ac)
        if self.pack_documents and not self.mode.packs_documents:
            raise GridError(f"pack_documents: tp {self.mode.spec()}'s attention does not mask by documents "
                            "(SUPER's branches); use another tensor mode")
        if self.compute.float8 is not None:
            self._check_float8(dims)
        return {"dp": dims.dp, "pp": dims.pp, "sp": dims.sp}

    def _check_float8(self, dims) -> None:
        """What float8 products cannot take, refused before any rank starts: a mode or a mixture of
        experts whose products are not in float8 yet, and a micro-batch's tokens on a rank (the
        weight gradient's contraction) not a multiple of 16 (each linear's own sizes are checked
        where it is converted, on its rank's shard)."""
        if not self.mode.float8:
            raise GridError(f"precision {self.precision}: tp {self.mode.spec()}'s linears have no float8 products yet "
                            "(none, row:N, square:Q, cube:P and subgraph:G have them); use bf16")
        if self.model in MOE_MODELS and self.schedule in pipeline.TABLES:
            raise GridError(f"precision {self.precision}: schedule {self.schedule} defers a mixture of experts' weight "
                            "gradients, which their float8 products do not separate from the input's yet; use bf16 or "
                            "another schedule")
        parts = self.mode.float8_token_parts
        tokens = self.batch // dims.dp // self.microbatches * (self.seq // dims.sp) // parts
        split = f" / {self.mode.spec()}'s {parts} row parts" if parts > 1 else ""
        float8.check_sizes(f"precision {self.precision}: a micro-batch's tokens in a rank's products (batch "
                           f"{self.batch} / dp {dims.dp} / {self.microbatches} micro-batches x seq {self.seq} / sp "
                           f"{dims.sp}{split})", tokens)

    def fitted_microbatches(self, world: int):
        """This config on an elastic world of `world` ranks: the given micro-batches where the
        world's data-parallel shard splits into them, else the count nearest them that does (the
        fewer on a tie), so the global batch, hence each step's mathematics, is kept on the new
        dp; self when no count fits (grid_shape then says why)."""
        try:
            self.grid_shape(world)
            return self
        except GridError:
            pass
        dims = ParallelDims.for_world(world, self.mode, self.sp, self.dp, self.pp, self.layers)
        if self.batch % dims.dp:
            return self
        shard = self.batch // dims.dp
        for m in sorted((k for k in range(1, shard + 1) if shard % k == 0), key=lambda k: (abs(k - self.microbatches), k)):
            fitted = dataclasses.replace(self, microbatches=m)
            try:
                fitted.grid_shape(world)
                return fitted
            except GridError:
                continue
        return self

    def planned_optimizer(self) -> dict:
        """plan.predict's arguments for the optimizer build() makes of this config."""
        return dict(offload_bsize=self.bsize if self.offload is not False else None, coarsening=self.coarsening,
                    overlap_grad_reduce=self.overlap_grad_reduce)

    def plan_shape(self, dp: int, pp: int) -> "plan.GridShape":
        """This job's grid as the planner takes it, with dp and pp (grid_shape's)."""
        return plan.GridShape(dp=dp, pp=pp, tp=self.mode, sp=self.sp, placement=self.placement, zero=self.zero,
                              schedule=self.schedule, chunks=self.chunks, ep=self.ep)

    def resolved_schedule(self, dp: int, pp: int) -> str:
        """The pipeline schedule this job runs on dp x pp (auto decided: plan.GridShape.resolved_schedule)."""
        if self.schedule != pipeline.AUTO:  # run() resolves it once: the steps take this
            return self.schedule
        return self.plan_shape(dp, pp).resolved_schedule(plan.model_of(self).config)

    def check_files(self) -> None:
        """The files of this run, checked by the launcher before any rank starts: the corpus
        exists and is UTF-8 text (the first 64 KiB of each file), resume holds a checkpoint,
        and out is a folder this user can write with room for two checkpoints of the model
        and the token file. Raises GridError or OSError naming the path."""
        import codecs
        import os
        import shutil

        src = self.source
        src.check()  # records: the text field is there; tokens: whole tokens of their dtype
        if src.format is data.Format.TOKENS and self.tokenizer == "bpe":
            raise GridError(f"data={src.path} is pre-tokenized: give the tokenizer its ids come from (tokenizer = a "
                            "tokenizer.json or its folder, or bytes)")
        for f in src.files if src.format is data.Format.TEXT else ():
            with open(f, "rb") as fh:
                head = fh.read(1 << 16)
            if b"\x00" in head:
                raise GridError(f"data={f} is not text (it holds NUL bytes); data takes UTF-8 text files")
            try:
                codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
            except UnicodeDecodeError as e:
                raise GridError(f"data={f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if self.resume and self.resume != AUTO:
            checkpoint.open_index(Path(self.resume) / "checkpoint")  # a clear GridError when there is none
        if self.tokenizer_file is not None:
            if not self.tokenizer_file.is_file() and self.tokenizer == "bpe":
                raise GridError(f"init_from={self.init_from} holds no tokenizer.json: give the model's tokenizer "
                                "(tokenizer = a tokenizer.json or its folder)")
            if not self.tokenizer_file.is_file():
                raise GridError(f"tokenizer={self.tokenizer}: no tokenizer.json there (bpe, bytes, or the path of "
                                "an existing tokenizer.json or of a folder holding one)")
            try:
                tok = data.load_tokenizer(self.tokenizer_file)
            except Exception as e:  # noqa: BLE001 (any unreadable file: one clear error before any rank starts)
                raise GridError(f"tokenizer={self.tokenizer} is not a tokenizers file: {e}") from None
            self.check_vocab(tok.vocab_size)
        out = Path(self.out).absolute()
        if out.exists() and not out.is_dir():
            raise GridError(f"out={out} exists and is not a folder")
        near = next(p for p in [out, *out.parents] if p.exists())
        if not near.is_dir():
            raise GridError(f"out={out}: {near} is a file, not a folder")
        if not os.access(near, os.W_OK | os.X_OK):
            raise PermissionError(f"out={out}: {near} is not writable by this user")
        model = models.build(self.model_config(self.vocab), device="meta")
        params = sum(p.numel() for p in model.parameters())
        # a checkpoint: the parameters and OffloadAdam's fp32 master, exp_avg, exp_avg_sq
        need = 2 * params * (self.compute.dtype.itemsize + 12) + 8 * (0 if src.format is data.Format.TOKENS else src.size())
        free = shutil.disk_usage(near).free
        if free < need:
            raise OSError(28, f"out={out}: {free / 2 ** 20:.0f} MiB free on its disk, this run needs about "
                              f"{need / 2 ** 20:.0f} MiB (two checkpoints of {params} parameters and the token file)")

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr over `warmup` steps, then cosine decay to min_lr at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        t = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))

    def run_config(self, model: ModelConfig) -> dict:
        return {"model": model.to_dict(), "tokenizer": self.tokenizer, "seq": self.seq, "batch": self.batch,
                "seed": self.seed, "steps": self.steps, "lr": self.lr}
