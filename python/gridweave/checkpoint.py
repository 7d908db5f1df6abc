"""Sharded checkpoints: every rank writes its own shards, an index says where every slice
of every tensor lives, and any grid reads back just the slices it needs.

A step is a folder `step-NNNNNNNN/` holding `rank-R.safetensors` (this rank's shards: the
parameters it counts, placement.counted_here, under "KIND/NAME" for KIND in param and the
optimizer's master / exp_avg / exp_avg_sq), `rank-R.json` (those shards' metadata and the
file's sha256) and `index.json`, written last by rank 0 after checking every rank's file:
for each tensor its dense shape and dtype and its chunks (file, key, the block of the stored
full tensor it holds, and how that stored tensor relates to the dense one: transposed, rows
in group_order). `latest` names the newest complete step (replaced atomically), so a save
killed at any moment leaves the previous step loadable and never a mix of two. Nothing in a
checkpoint is executed: safetensors and JSON only.
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from .errors import GridError
from .layout import local_slices
from .sharding import group_order, placement_of

INDEX = "index.json"
LATEST = "latest"
KEEP = 2  # complete steps kept (the newest and the one before)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, write) -> None:
    """write(tmp) a temporary file beside `path`, then rename it: readers see the whole file
    or none of it. A failed write leaves no temporary file and raises WriteError naming the
    path and the reason (the disk is full, permission denied, a file size limit)."""
    path = Path(path)
    tmp = path.with_name(path.name + f"{TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # libraries report a full disk as either
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise WriteError(path, e) from e


TMP_MARK = ".tmp"


class WriteError(OSError):
    """A file could not be written; the message names the path and why."""

    def __init__(self, path: Path, cause: BaseException):
        import errno

        code = getattr(cause, "errno", None)
        try:
            free = shutil.disk_usage(Path(path).parent).free
        except OSError:
            free = None
        if code == errno.ENOSPC or (free is not None and free < (1 << 20)):
            why = f"the disk is full ({free or 0} bytes free)"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            why = "permission denied (or a read-only file system)"
        elif code == errno.EFBIG:
            why = "the file is larger than this process may write (ulimit -f)"
        else:
            why = str(cause)
        super().__init__(code or errno.EIO, f"cannot write {path}: {why}")
        self.path = Path(path)


def remove_stale_temporaries(folder: Path) -> list:
    """Delete the temporary files an interrupted save left under `folder` (no save may be
    running); returns what was removed."""
    gone = []
    for f in Path(folder).rglob(f"*{TMP_MARK}*"):
        if f.is_file() and f.name.rsplit(TMP_MARK, 1)[-1].isdigit():
            f.unlink(missing_ok=True)
            gone.append(f)
    return gone


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda t: t.write_text(text))


def _stored_shape(dense_shape, pl) -> tuple:
    return tuple(reversed(dense_shape)) if pl.transposed else tuple(dense_shape)


def chunk_of(name: str, dense_shape, p, grid) -> dict:
    """The metadata of this rank's shard of parameter `p` (dense name `name`)."""
    pl = placement_of(p)
    stored = _stored_shape(dense_shape, pl)
    sl = local_slices(stored, pl.layout, grid)
    block = [[s.start, s.stop] for s in sl]
    if [e - b for b, e in block] != list(p.shape):
        raise GridError(f"internal: {name}'s shard {tuple(p.shape)} is not its layout's block {block}")
    return {"block": block, "transposed": pl.transposed,
            "order": [list(pl.order[0]), *pl.order[1:]] if pl.order else None}


def block_of(dense: torch.Tensor, chunk: dict) -> torch.Tensor:
    """The stored block `chunk` (chunk_of's) of a dense tensor: what the rank holding that chunk
    holds of it (transposed and row order as it stores them)."""
    index = [torch.as_tensor(i, dtype=torch.int64, device=dense.device)
             for i in _dense_index(chunk, list(dense.shape))]
    block = dense[_ix(index)]
    return block.t() if chunk["transposed"] else block


class FlatSlice:
    """Elements [lo, hi) of a parameter's local block in row-major order (a piece of a ZeRO
    shard, which cuts the flattened parameters anywhere): written by every rank that holds one,
    `axes` being the data axes the block is split over (placement.counted_here's sharded)."""

    def __init__(self, lo: int, hi: int, values: torch.Tensor, axes: tuple):
        if values.numel() != hi - lo:
            raise GridError(f"internal: a flat slice [{lo}, {hi}) of {values.numel()} values")
        self.lo, self.hi, self.values, self.axes = lo, hi, values, tuple(axes)


def flat_blocks(block, lo: int, hi: int) -> list:
    """A flat range [lo, hi) of a stored block (row-major, any number of dims) as rectangular
    blocks of it: [(block, a, b)], values [a, b) of the range's. Along the first dim: the
    partial first slab, the whole slabs between, the partial last slab (each partial one cut the
    same way, one dim further in): at most 2 d - 1 blocks for d dims."""
    (s0, e0), rest = block[0], block[1:]
    if not rest:
        return [([[s0 + lo, s0 + hi]], 0, hi - lo)]
    inner = math.prod(e - s for s, e in rest)
    out, a = [], lo
    while a < hi:
        r, c = divmod(a, inner)
        if c or hi - a < inner:  # a part of one slab: cut further in
            b = min(hi, (r + 1) * inner)
            out += [([[s0 + r, s0 + r + 1]] + sub, a - lo + x, a - lo + y)
                    for sub, x, y in flat_blocks(rest, c, b - r * inner)]
        else:  # whole slabs
            n = (hi - a) // inner
            b = a + n * inner
            out.append(([[s0 + r, s0 + r + n]] + [list(d) for d in rest], a - lo, b - lo))
        a = b
    return out


def _dense_index(meta: dict, dense_len: list) -> list:
    """Per dense dim, the dense indices of a chunk's (or a needed block's) elements, in the
    chunk's own order along that dim."""
    per_stored = [np.arange(b, e) for b, e in meta["block"]]
    dense = list(reversed(per_stored)) if meta["transposed"] else per_stored
    order = meta.get("order")  # [widths, groups] of group_order, and the dim it orders where not 0
    if order:
        perm = group_order(order[0], order[1], "cpu").numpy()
        d = order[2] if len(order) > 2 else 0
        dense[d] = perm[dense[d]]
    return dense


class PendingSave:
    """A save whose shards are being written in the background (save(..., wait=False)):
    the tensors were copied at save time, so training may go on and change them. finish()
    (collective: every rank, at the same point of the program) waits for this rank's file,
    then rank 0 checks every rank's file and writes the index: the step becomes the latest
    only then, with the same guarantees as a blocking save."""

    def __init__(self, folder: Path, step_dir: Path, grid, extra: dict, thread):
        self.folder, self.step_dir, self.grid, self.extra, self._thread = folder, step_dir, grid, extra, thread
        self.error = None
        self.done = False

    def finish(self) -> Path:
        if self.done:
            return self.step_dir
        if self._thread is not None:
            self._thread.join()
        # one decision on every rank: a rank whose write failed must not leave the others
        # waiting for its file (the step is never committed; the previous one stays latest)
        failed = self.grid.any(self.error is not None)
        if self.error is not None:
            raise self.error
        if failed:
            raise WriteError(self.step_dir, OSError(0, "another rank could not write its shard (its error says why)"))
        _commit(self.folder, self.step_dir, self.grid, self.extra)
        self.done = True
        return self.step_dir


def save(folder, step: int, items: list, grid, tensors_of, extra: dict, wait: bool = True):
    """Write step `step` of a sharded checkpoint under `folder` (collective: every rank).
    items: [(dense name, parameter, dense shape)] of this rank; tensors_of(p) -> {kind:
    tensor shaped like p} (the parameter and its optimizer states); extra: JSON-able run
    state (config, reader position, losses) that rank 0 puts in the index; a value may instead
    be a FlatSlice of the tensor (a ZeRO shard's piece: each rank writes its own, no gathers).
    wait=False: the
    shards are copied now and written by a background thread; returns a PendingSave whose
    finish() every rank calls later (e.g. at the next step). Returns the step folder otherwise."""
    import threading

    folder = Path(folder)
    # Rank 0 alone names the folder and makes it, then tells every rank which it made (or that it
    # failed): no rank looks at the folders while another may be making one.
    made = None
    suffix = 0
    if grid.rank == 0:
        remove_stale_temporaries(folder)  # an interrupted save's; every earlier save has finished
        while _step_dir(folder, step, suffix).exists():  # never overwrite a step (it may be the latest)
            suffix += 1
        try:
            _step_dir(folder, step, suffix).mkdir(parents=True)
        except OSError as e:
            made = e
    suffix = grid.broadcast_ints([-1 if made is not None else suffix], axis=None)[0]
    if suffix < 0:
        raise WriteError(_step_dir(folder, step, 0), made if grid.rank == 0 else
                         OSError(0, "rank 0 could not make the step's folder"))
    step_dir = _step_dir(folder, step, suffix)
    shards, meta = {}, {}
    for name, p, dense_shape in items:
        if p.numel() == 0:
            continue
        chunk = chunk_of(name, dense_shape, p, grid)
        whole = placement_of(p).counted_here(grid)
        for kind, t in tensors_of(p).items():
            pieces = [(f"{kind}/{name}", chunk["block"], t)] if not isinstance(t, FlatSlice) else \
                [(f"{kind}/{name}@{t.lo + a}", block, t.values[a:b].view([e - s for s, e in block]))
                 for block, a, b in flat_blocks(chunk["block"], t.lo, t.hi)] \
                if placement_of(p).counted_here(grid, sharded=t.axes) else []
            if not isinstance(t, FlatSlice) and not whole:
                continue
            for key, block, v in pieces:
                # a host copy (the snapshot: training may change t while the file is written)
                shards[key] = v.detach().to("cpu", copy=True).contiguous()
                meta[key] = {**chunk, "block": block, "name": name, "kind": kind, "dense_shape": list(dense_shape),
                             "dtype": str(v.dtype).replace("torch.", "")}
    pending = PendingSave(folder, step_dir, grid, {"step": step, **extra}, None)

    def write():
        try:
            _write_rank(step_dir, grid.rank, shards, meta)
        except Exception as e:  # reported by finish(), on the caller's thread
            pending.error = e

    if wait:
        write()
        return pending.finish()
    pending._thread = threading.Thread(target=write, name=f"gridweave-save-{step}", daemon=True)
    pending._thread.start()
    return pending


def _step_dir(folder: Path, step: int, suffix: int) -> Path:
    """Step `step`'s folder, or its suffix-th second folder (a step saved again never overwrites)."""
    return folder / (f"step-{step:08d}" + (f".{suffix}" if suffix else ""))


def _write_rank(step_dir: Path, rank: int, shards: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    fname = f"rank-{rank}.safetensors"
    atomic_write(step_dir / fname, lambda t: save_file(shards, str(t)))
    _write_text(step_dir / f"rank-{rank}.json",
                       json.dumps({"file": fname, "sha256": _sha256(step_dir / fname), "chunks": meta}))


def _commit(folder: Path, step_dir: Path, grid, extra: dict) -> None:
    """Every rank's file is written: rank 0 checks them, writes the index, then points
    `latest` at the step and prunes old steps."""
    grid.barrier()
    if grid.rank == 0:
        index = {"world_size": grid.world_size, "grid": dict(grid.axes), "files": {}, "tensors": {}, **extra}
        for r in range(grid.world_size):
            rec = json.loads((step_dir / f"rank-{r}.json").read_text())
            if _sha256(step_dir / rec["file"]) != rec["sha256"]:
                raise GridError(f"checkpoint shard {step_dir / rec['file']} changed while saving")
            index["files"][rec["file"]] = rec["sha256"]
            for key, m in rec["chunks"].items():
                t = index["tensors"].setdefault(f"{m['kind']}/{m['name']}", {"dense_shape": m["dense_shape"],
                                                                                "dtype": m["dtype"], "chunks": []})
                t["chunks"].append({"file": rec["file"], "key": key, "block": m["block"],
                                    "transposed": m["transposed"], "order": m["order"]})
        _write_text(step_dir / INDEX, json.dumps(index))
        _write_text(folder / LATEST, step_dir.name)  # the step is complete: point at it
        # keep the newest KEEP complete steps; older ones and unfinished ones (no index) go
        others = [d for d in folder.glob("step-*") if d.is_dir() and d != step_dir]
        complete = sorted((d for d in others if (d / INDEX).exists()), key=lambda d: d.stat().st_mtime_ns)
        for old in [d for d in others if not (d / INDEX).exists()] + complete[:max(0, len(complete) - (KEEP - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    grid.barrier()


def open_index(folder) -> tuple:
    """(step folder, index) of the newest complete step, every file named by the index present
    and matching its checksum: one clear error naming the file otherwise, before anything is read."""
    folder = Path(folder)
    latest = folder / LATEST
    if not latest.exists():
        raise GridError(f"no checkpoint in {folder} (no '{LATEST}' file)")
    step_dir = folder / latest.read_text().strip()
    index_path = step_dir / INDEX
    if not index_path.exists():
        raise GridError(f"checkpoint {step_dir} has no {INDEX}: the save did not complete")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise GridError(f"checkpoint index {index_path} is not valid JSON: {e}") from None
    for fname, digest in index.get("files", {}).items():
        f = step_dir / fname
        if not f.exists():
            raise GridError(f"checkpoint file {f} named by {index_path} is missing")
        if _sha256(f) != digest:
            raise GridError(f"checkpoint file {f} does not match its checksum in {index_path} "
                            "(truncated or altered)")
    return step_dir, index


def _fill(local: torch.Tensor, need: dict, entry: dict, step_dir: Path, handles: dict) -> int:
    """Copy into `local` (the stored block `need` of this rank) every element the chunks of
    `entry` hold; returns how many were filled. Reads only the chunks' needed boxes."""
    from safetensors import safe_open

    dense_len = entry["dense_shape"]
    want = _dense_index(need, dense_len)
    target = local.t() if need["transposed"] else local  # dense orientation, a view
    filled = 0
    for c in entry["chunks"]:
        have = _dense_index(c, dense_len)
        sel, src = [], []
        for d in range(len(dense_len)):
            lookup = np.full(dense_len[d], -1, dtype=np.int64)
            lookup[have[d]] = np.arange(len(have[d]))
            pos = lookup[want[d]]
            ok = np.nonzero(pos >= 0)[0]
            sel.append(ok)
            src.append(pos[ok])
        if any(len(s) == 0 for s in sel):
            continue
        if c["file"] not in handles:
            handles[c["file"]] = safe_open(str(step_dir / c["file"]), framework="pt", device="cpu")
        sl = handles[c["file"]].get_slice(c["key"])
        # the bounding box of the needed elements, in the chunk's stored coordinates
        lo = [int(s.min()) for s in src]
        hi = [int(s.max()) + 1 for s in src]
        box_stored = list(zip(reversed(lo), reversed(hi))) if c["transposed"] else list(zip(lo, hi))
        with torch.device("cpu"):  # safetensors makes the piece on torch's default device otherwise
            piece = sl[tuple(slice(a, b) for a, b in box_stored)]
        piece = piece.t() if c["transposed"] else piece
        idx = [torch.as_tensor(s - a, dtype=torch.int64, device=piece.device) for s, a in zip(src, lo)]
        dst = [torch.as_tensor(s, dtype=torch.int64, device=target.device) for s in sel]
        with torch.no_grad():  # the outer product of the per-dim picks (numpy's ix_), any number of dims
            target[_ix(dst)] = piece[_ix(idx)].to(target.dtype)
        filled += int(np.prod([len(s) for s in sel]))
    return filled


def _ix(picks: list) -> tuple:
    """Index tensors, one per dim, shaped to broadcast against each other (numpy's ix_)."""
    n = len(picks)
    return tuple(p.reshape([-1 if j == i else 1 for j in range(n)]) for i, p in enumerate(picks))


def load(folder, items: list, grid, kinds) -> tuple:
    """(index, {kind: {id(p): tensor}}) for this rank's parameters: each read from the slices
    of the chunks that hold it (any saving grid). items as for save(); kinds: the KINDs to read."""
    step_dir, index = open_index(folder)
    out = {k: {} for k in kinds}
    handles = {}
    for name, p, dense_shape in items:
        if p.numel() == 0:
            for k in kinds:
                out[k][id(p)] = torch.empty_like(p, device="cpu", dtype=torch.float32 if k != "param" else p.dtype)
            continue
        need = chunk_of(name, dense_shape, p, grid)
        for kind in kinds:
            entry = index["tensors"].get(f"{kind}/{name}")
            if entry is None:
                raise GridError(f"checkpoint {step_dir} holds no {kind} of {name}")
            if list(entry["dense_shape"]) != list(dense_shape):
                raise GridError(f"checkpoint {step_dir}: {name} is {entry['dense_shape']}, this model's "
                                f"{list(dense_shape)}")
            dtype = getattr(torch, entry["dtype"])
            local = torch.empty(tuple(p.shape), dtype=dtype, device="cpu")
            got = _fill(local, need, entry, step_dir, handles)
            if got != local.numel():
                raise GridError(f"checkpoint {step_dir}: the chunks of {kind}/{name} cover {got} of the "
                                f"{local.numel()} elements this rank needs")
            out[kind][id(p)] = local
    return index, out


def export_dense(folder, kind: str = "param") -> dict:
    """Every tensor of one KIND as a dense tensor, in one process, tensor by tensor."""
    step_dir, index = open_index(folder)
    handles = {}
    out = {}
    prefix = kind + "/"
    for key, entry in index["tensors"].items():
        if not key.startswith(prefix):
            continue
        shape = entry["dense_shape"]
        full = torch.empty(shape, dtype=getattr(torch, entry["dtype"]), device="cpu")
        need = {"block": [[0, n] for n in shape], "transposed": False, "order": None}
        got = _fill(full, need, entry, step_dir, handles)
        if got != full.numel():
            raise GridError(f"checkpoint {step_dir}: the chunks of {key} cover {got} of {full.numel()} elements")
        out[key[len(prefix):]] = full
    return out
