"""Where the main job's numbers go besides metrics.json: TensorBoard (torch.utils.tensorboard),
Weights & Biases (its own offline mode when it cannot reach its server) and a JSON-lines file.
One RunLog per logging rank: the configuration once, then a dict of scalars per step."""
from __future__ import annotations

import enum
import importlib.util
import json
import os
import socket
from pathlib import Path

from .errors import GridError

FOLDER, JSON_LOG = "logs", "log.jsonl"  # in the run folder: rank 0's sinks, its JSON lines among them


class Sink(enum.Enum):
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    JSONL = "jsonl"


# the module each sink needs (None: nothing beyond gridweave)
_NEEDS = {Sink.TENSORBOARD: "tensorboard", Sink.WANDB: "wandb", Sink.JSONL: None}
AUTO, NONE = "auto", "none"


def installed() -> tuple:
    return tuple(s for s in Sink if _NEEDS[s] is None or importlib.util.find_spec(_NEEDS[s]) is not None)


def wandb_configured() -> bool:
    """The user set W&B up (an API key, or a mode asked for): auto then logs there too."""
    return bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"))


def parse(spec: str) -> tuple:
    """The sinks of a --log value: "auto" (TensorBoard and JSON lines when installed, W&B when it
    is installed and configured), "none", or a comma list; a sink that is unknown or not
    installed is a GridError."""
    if spec == AUTO:
        return tuple(s for s in installed() if s is not Sink.WANDB or wandb_configured())
    if spec == NONE:
        return ()
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            sink = Sink(name)
        except ValueError:
            raise GridError(f"log={name!r} is not a logger; use any of {', '.join(s.value for s in Sink)}, "
                            f"'{AUTO}' or '{NONE}'") from None
        if sink not in installed():
            raise GridError(f"log={name}: {_NEEDS[sink]} is not installed (pip install {_NEEDS[sink]})")
        out.append(sink)
    return tuple(dict.fromkeys(out))


def _wandb_mode() -> str:
    """WANDB_MODE when set; else online only with an API key and W&B's server reachable (3 s),
    offline otherwise (wandb sync uploads the run later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
        return "online"
    except OSError:
        return "offline"


class RunLog:
    """The sinks of one rank: folder out/logs (rank 0) or out/logs/rank<R> (the others, when
    every rank logs)."""

    def __init__(self, sinks, out: Path, rank: int, config: dict, name: str):
        self.sinks = tuple(sinks)
        self.folder = Path(out) / FOLDER / ("" if rank == 0 else f"rank{rank}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb = self._jsonl = None
        if Sink.TENSORBOARD in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.folder / "tensorboard"))
            self._tb.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
        if Sink.WANDB in self.sinks:
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "gridweave"), dir=str(self.folder),
                                     name=name if rank == 0 else f"{name}-rank{rank}", config=config,
                                     mode=_wandb_mode(), reinit="create_new",
                                     settings=wandb.Settings(silent=True, console="off"))  # gridweave says where
        if Sink.JSONL in self.sinks:
            self._jsonl = open(self.folder / JSON_LOG, "a")
            self._jsonl.write(json.dumps({"config": config}) + "\n")

    def step(self, step: int, values: dict) -> None:
        values = self._scalars(step, values)
        self._line({"step": step, **values})

    def restart(self, step: int, record: dict) -> None:
        """A change of world at `step` (train.note_restart's record): TensorBoard's text and
        scalars, W&B's values, a line of the JSON log."""
        if self._tb is not None:
            self._tb.add_text("restarts", f"step {step}: {record['previous_world']} ranks ({record['previous_grid']}) "
                              f"-> {record['world']} ranks ({record['grid']}), tp {record['tp']}", step)
        self._scalars(step, {"restart/world": record["world"], "restart/seconds_lost": record["seconds_lost"]})
        if self._wandb is not None:
            self._wandb.summary["restarts"] = self._wandb.summary.get("restarts", 0) + 1
        self._line({"step": step, "restart": record})

    def logged_restarts(self) -> list | None:
        """The restart records this rank's JSON log holds, oldest first (None: no JSON log)."""
        if self._jsonl is None:
            return None
        self._jsonl.flush()
        entries = [json.loads(line) for line in (self.folder / JSON_LOG).read_text().splitlines() if line.strip()]
        return [e["restart"] for e in entries if "restart" in e]

    def loads(self, step: int, tag: str, counts: list) -> None:
        """A mixture-of-experts layer's slots per expert at `step`: a histogram over the expert ids
        (TensorBoard's, W&B's) and the counts themselves in the JSON log."""
        n = len(counts)
        edges = [e - 0.5 for e in range(n + 1)]
        if self._tb is not None:
            total = sum(counts)
            self._tb.add_histogram_raw(tag, min=0, max=n - 1, num=total, sum=sum(e * c for e, c in enumerate(counts)),
                                       sum_squares=sum(e * e * c for e, c in enumerate(counts)),
                                       bucket_limits=edges[1:], bucket_counts=list(counts), global_step=step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Histogram(np_histogram=(list(counts), edges))}, step=step)
        self._line({"step": step, tag: list(counts)})

    def _scalars(self, step: int, values: dict) -> dict:
        """`values` (None left out) as floats to TensorBoard's scalars and W&B at `step`."""
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        return values

    def _line(self, entry: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(entry) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._jsonl is not None:
            self._jsonl.close()
