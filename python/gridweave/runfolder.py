"""What a run leaves in its folder besides checkpoints and logs: the environment it ran in, the
Hugging Face files it started from, and the plots of metrics.json (the loss curves; the run at a
glance)."""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch

from . import checkpoint
from .errors import GridError
from .models.hf import SOURCE_FILES

HF_SOURCE = "hf"  # OUT/hf: the Hugging Face files a run started from (SOURCE_FILES), which export writes back


def keep_source(src, out: Path) -> None:
    """The Hugging Face folder `src`'s config and generation config into OUT/hf (--init-from's
    folder, or a resumed run's OUT/hf), for export; nothing when src is None or not a folder."""
    if src is None or not Path(src).is_dir() or Path(src).resolve() == (out / HF_SOURCE).resolve():
        return
    (out / HF_SOURCE).mkdir(parents=True, exist_ok=True)
    for name in SOURCE_FILES:
        f = Path(src) / name
        if f.is_file():
            checkpoint.atomic_write(out / HF_SOURCE / name, lambda t, f=f: t.write_bytes(f.read_bytes()))


def environment(grid) -> dict:
    """What ran: the packages' versions, the checkout gridweave was installed from (pip's
    direct_url.json names it) with its HEAD when the run started and whether it had uncommitted
    changes, the machine, the command and the grid."""
    import importlib.metadata as md
    import platform
    import subprocess

    versions = {}
    for name in ("gridweave", "torch", "numpy", "tokenizers", "safetensors", "transformers", "tensorboard", "wandb"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    source = None
    try:
        url = json.loads(md.distribution("gridweave").read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://"):
            path = url[len("file://"):]
            git = ["git", "-C", path]
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            if head.returncode == 0:
                dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, timeout=10)
                source = {"path": path, "commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (md.PackageNotFoundError, OSError, subprocess.SubprocessError, json.JSONDecodeError):
        source = None
    return {"versions": versions, "gridweave_source": source, "python": platform.python_version(),
            "platform": platform.platform(), "host": socket.gethostname(), "cuda": torch.version.cuda,
            "argv": sys.argv, "grid": dict(grid.axes), "world_size": grid.world_size,
            "ranks_per_node": grid.ranks_per_node, "backend": grid.backend, "device": str(grid.device)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _losses(ax, metrics) -> None:
    """Training and validation loss over steps, beside the validation split's unigram entropy."""
    losses, val = metrics["loss"], metrics["val_loss"]
    ax.plot(range(1, len(losses) + 1), losses, label="training")
    if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation")
    ax.axhline(metrics["unigram_entropy_val"], color="gray", ls=":", lw=1, label="unigram entropy (validation)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.legend()


def plot_loss(metrics, png) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    _losses(ax, metrics)
    ax.set_title("gridweave train")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _imbalance(ax, steps) -> None:
    """Each sparse layer's busiest expert over an even share, step by step ([step][layer][expert])."""
    experts = len(steps[0][0])
    for l in range(len(steps[0])):
        ax.plot(range(1, len(steps) + 1), [max(s[l]) * experts / max(sum(s[l]), 1) for s in steps],
                label=f"layer {l}")
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="busiest expert / even share", title="load imbalance (max / mean)")


def plot_run(metrics, png) -> None:
    """The run at a glance: the losses, speed (tokens/s) and MFU each on its own axes, the
    gradient norm, each rank's peak memory, and the bytes each axis moved inside and across nodes;
    with a mixture of experts, each layer's max / mean expert load."""
    plt = _pyplot()
    moe = bool(metrics.get("tokens_per_expert"))
    fig, ax = plt.subplots(2, 4 if moe else 3, figsize=(20 if moe else 15, 7))
    if moe:
        _imbalance(ax[0, 3], metrics["tokens_per_expert"])
        ax[0, 3].legend(fontsize=7)
        ax[1, 3].axis("off")
    _losses(ax[0, 0], metrics)
    ax[0, 0].set_title("loss")
    steps = range(1, len(metrics["tokens_per_s"]) + 1)
    ax[0, 1].plot(steps, metrics["tokens_per_s"], color="tab:blue")
    ax[0, 1].set(xlabel="step", ylabel="tokens/s", title="speed")
    ax[0, 2].plot(steps, [100 * m for m in metrics["mfu"]], color="tab:orange")
    ax[0, 2].set(xlabel="step", ylabel="MFU %", title=f"model FLOPs utilisation (peak: {metrics['peak_flops_source']})")
    ax[0, 2].title.set_fontsize(8)
    norms = [(s, g) for s, g in zip(steps, metrics.get("grad_norm", [])) if g is not None]
    if norms:
        ax[1, 0].plot(*zip(*norms), color="tab:green")
    ax[1, 0].set(xlabel="step", ylabel="norm", title="gradient norm (before clipping)")
    rss = metrics["max_rss_bytes_per_rank"]
    ax[1, 1].bar(range(len(rss)), [r / 2 ** 20 for r in rss])
    ax[1, 1].set_xticks(range(len(rss)))
    ax[1, 1].set(xlabel="rank", ylabel="MiB", title="peak resident memory per rank")
    sent = metrics["traffic"]["sent_bytes"]
    labels = sorted(sent)
    intra = [sent[k]["intra"] / 2 ** 20 for k in labels]
    ax[1, 2].bar(labels, intra, label="inside a node")
    ax[1, 2].bar(labels, [sent[k]["inter"] / 2 ** 20 for k in labels], bottom=intra, label="across nodes")
    ax[1, 2].set(ylabel="MiB sent (all ranks)", title="bytes per axis")
    ax[1, 2].legend()
    fig.suptitle(f"gridweave train: {metrics['grid']} on {metrics['backend']}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def plot_experts(metrics, png) -> None:
    """A mixture of experts' routing: the slots each layer sent each expert over the run (the
    per-expert token histogram), and the busiest expert's load over an even share, step by step."""
    plt = _pyplot()
    steps = metrics["tokens_per_expert"]  # [step][layer][expert]
    layers, experts = len(steps[0]), len(steps[0][0])
    total = [[sum(s[l][e] for s in steps) for e in range(experts)] for l in range(layers)]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / layers
    for l, row in enumerate(total):
        ax[0].bar([e + l * width for e in range(experts)], row, width=width, label=f"layer {l}")
    ax[0].axhline(sum(total[0]) / experts, color="gray", ls=":", lw=1, label="even share")
    ax[0].set(xlabel="expert", ylabel="slots routed (whole run)", title="tokens per expert")
    ax[0].set_xticks([e + 0.4 - width / 2 for e in range(experts)], range(experts))
    ax[0].legend(fontsize=7, ncol=2)
    _imbalance(ax[1], steps)
    fig.suptitle(f"gridweave train: {experts} experts, {metrics['grid']}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def load_imbalance(steps: list) -> float:
    """The busiest expert's slots over an even share (the planner's expert imbalance), averaged
    over the layers and steps of tokens_per_expert ([step][layer][expert]); a layer that routed
    nothing in a step is left out."""
    ratios = [max(layer) * len(layer) / sum(layer) for step in steps for layer in step if sum(layer)]
    if not ratios:
        raise GridError("no routed slots to measure an expert imbalance from")
    return sum(ratios) / len(ratios)


def busiest_expert_rank(ranks: list) -> dict:
    """From every rank's {"rank", "member" (its index on the expert line), "slots" (routed to its
    member's experts over the run, every layer), "compute_share" (its forward and backward over
    its step, from the phases)}: the busiest member's slots over an even share and the largest
    compute share among its ranks, against the mean rank's (the straggler routing makes)."""
    members = {r["member"]: r["slots"] for r in ranks}
    even = sum(members.values()) / len(members)
    busiest = max(members, key=lambda m: (members[m], -m))
    top = max((r for r in ranks if r["member"] == busiest), key=lambda r: r["compute_share"])
    return {"rank": top["rank"], "member": busiest, "slots_over_even": members[busiest] / even if even else 1.0,
            "compute_share": top["compute_share"],
            "mean_compute_share": sum(r["compute_share"] for r in ranks) / len(ranks)}


def measured_imbalance(run) -> tuple:
    """(expert imbalance, steps, layers) a run folder's metrics.json measured (load_imbalance of
    its tokens per expert): what `gridweave plan --from-run` plans the straggler cost of."""
    path = Path(run) / "metrics.json"
    try:
        steps = json.loads(path.read_text()).get("tokens_per_expert")
    except (OSError, ValueError) as e:
        raise GridError(f"--from-run {run}: cannot read {path} ({e}): a finished run's folder") from None
    if not steps:
        raise GridError(f"--from-run {run}: {path} holds no tokens per expert (not a mixture-of-experts run)")
    return load_imbalance(steps), len(steps), len(steps[0])
