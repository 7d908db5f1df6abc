"""Packed documents: several documents in one training sequence, attention within
each (ring-flash-attn's varlen API, torchtitan's document masking). A batch of packed sequences
carries its document ids: an int64 (b, L) tensor, one id per token of the whole sequence, equal
ids for one document's tokens (which are consecutive). Every attention path (dense, both rings,
RSA, Ulysses, USP) takes the ids of the whole sequence and masks by them.

Over a ring (ring attention, USP's) the positions of a causal sequence are dealt in zigzag
order, which balances positions, not work: with documents of uneven lengths the rank holding a
long document's late tokens attends to most keys. balanced_order deals the sequence's chunks by
their attention work instead (as TransformerEngine's THD layout and ring-flash-attention's varlen
variants balance documents), and Packed carries that order with the ids to every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import GridError
from .layout import ChunkOrder, Layout, local_slices

MIN_CHUNK = 16  # tokens: a smaller block costs more in its kernel's call than it balances


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(b, L) positions within each token's document: they restart at every document's start."""
    idx = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values


def document_mask(documents: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> torch.Tensor:
    """(b, 1, len(qpos), len(kpos)) True where the query at sequence position qpos[i] may see the key
    at kpos[j]: the same document (and j not after i when causal)."""
    visible = documents[:, qpos, None] == documents[:, None, kpos]
    if causal:
        visible &= qpos[:, None] >= kpos[None, :]
    return visible.unsqueeze(1)


def check_documents(documents: torch.Tensor, batch: int, length: int) -> None:
    """A GridError unless `documents` are the (batch, length) integer ids of a packed batch."""
    if not isinstance(documents, torch.Tensor) or documents.dtype not in (torch.int32, torch.int64) \
            or tuple(documents.shape) != (batch, length):
        what = f"{tuple(documents.shape)} {documents.dtype}" if isinstance(documents, torch.Tensor) else type(documents).__name__
        raise GridError(f"documents must be integer ids of shape (batch, sequence) = ({batch}, {length}), got {what}")


def document_rows(documents: torch.Tensor, layout, grid) -> torch.Tensor:
    """The ids of the batch rows this rank holds under `layout` (its dim 0 split over the tensor
    axes), from the ids of its data-parallel replica's whole batch (the dp axis already cut)."""
    rows = Layout(*layout.without("dp").dims[:1])  # dim 0 only: the rows
    return documents[local_slices(tuple(documents.shape), rows, grid)[:1]]


@dataclass(frozen=True)
class Packed:
    """A micro-batch of packed documents as the layers take them: the (b, L) ids on the grid's
    device and the chunks each ring member holds (balanced_order)."""
    ids: torch.Tensor
    order: ChunkOrder


def ids_of(documents):
    """The (b, L) ids of packed documents given as ids or as Packed (None: None)."""
    return documents.ids if isinstance(documents, Packed) else documents


def order_of(documents) -> ChunkOrder | None:
    """The chunk order packed documents carry (None: the positions' zigzag or contiguous order)."""
    return documents.order if isinstance(documents, Packed) else None


def with_ids(documents, ids):
    """documents with other ids (e.g. a rank's rows), the same order."""
    return Packed(ids, documents.order) if isinstance(documents, Packed) else ids


def chunk_visibility(documents: torch.Tensor, chunks: int, causal: bool) -> torch.Tensor:
    """(chunks, chunks) bool: whether query chunk i has a token that may attend to a token of key
    chunk j in some row (the same document, and not after it when causal): a chunk spans the
    documents from its first token's to its last token's, and two spans meet or they do not."""
    b, length = documents.shape
    c = length // chunks
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    ordinal = start.long().cumsum(1)  # each token's document, counted along its row
    lo, hi = ordinal[:, ::c], ordinal[:, c - 1::c]
    meet = ((lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])).any(0)
    return meet.tril() if causal else meet


def chunk_work(visible: torch.Tensor, causal: bool) -> list:
    """Each query chunk's attention work in blocks a ring computes: one per visible key chunk, half
    for its own (the causal diagonal block)."""
    w = visible.double().sum(1)
    if causal:
        w -= 0.5 * visible.diagonal().double()
    return w.tolist()


def _chunks_per_member(length: int, members: int) -> int:
    for m in (8, 4, 2):
        if length % (members * m) == 0 and length // (members * m) >= MIN_CHUNK:
            return m
    return 2 if length % (2 * members) == 0 else 1


def balanced_order(documents: torch.Tensor, members: int, causal: bool, balance: bool = True) -> ChunkOrder:
    """The chunks of a packed micro-batch's sequence dealt to a ring's members by attention work
    (on the host, from the host's ids): each member an equal number of chunks, the work of each
    (chunk_work, summed over its chunks) within a few percent of the mean: the longest-processing-
    time rule under equal counts, then swaps between the heaviest and lightest members while they
    lower the heaviest. balance=False: the zigzag's two chunks a member (contiguous when not
    causal), with the same visibility (the order today's ring takes, its invisible blocks skipped)."""
    documents = documents.detach().to("cpu")
    length = documents.shape[1]
    m = _chunks_per_member(length, members) if balance else (2 if causal else 1)
    if length % (members * m):
        raise GridError(f"a sequence of {length} tokens does not split into {members * m} chunks for {members} "
                        "ring members")
    chunks = members * m
    visible = chunk_visibility(documents, chunks, causal)
    pairs = frozenset((int(i), int(j)) for i, j in visible.nonzero().tolist())
    if not balance:
        dealt = [(r, 2 * members - 1 - r) if causal else (r,) for r in range(members)]
        return ChunkOrder(length // chunks, tuple(dealt), pairs)
    work = chunk_work(visible, causal)
    held = [[] for _ in range(members)]
    load = [0.0] * members
    for j in sorted(range(chunks), key=lambda j: (-work[j], j)):
        r = min((r for r in range(members) if len(held[r]) < m), key=lambda r: (load[r], r))
        held[r].append(j)
        load[r] += work[j]
    for _ in range(4 * chunks):  # swaps that lower the heaviest member's work
        hi = max(range(members), key=lambda r: load[r])
        lo = min(range(members), key=lambda r: load[r])
        gap = load[hi] - load[lo]
        best = max(((a, b) for a in held[hi] for b in held[lo] if 0 < work[a] - work[b] < gap),
                   key=lambda ab: min(work[ab[0]] - work[ab[1]], gap - (work[ab[0]] - work[ab[1]])), default=None)
        if best is None:
            break
        a, b = best
        held[hi][held[hi].index(a)], held[lo][held[lo].index(b)] = b, a
        load[hi] += work[b] - work[a]
        load[lo] += work[a] - work[b]
    return ChunkOrder(length // chunks, tuple(tuple(sorted(h)) for h in held), pairs)


def member_work(order: ChunkOrder, causal: bool) -> list:
    """Each ring member's attention work in (query, key) token pairs a ring that skips invisible
    blocks computes on it: chunk_work over its chunks, a block being chunk x chunk pairs."""
    n = len(order.members) * len(order.members[0])
    visible = torch.zeros(n, n, dtype=torch.bool, device="cpu")  # host bookkeeping
    for i, j in order.visible or ((i, j) for i in range(n) for j in range(n) if not causal or j <= i):
        visible[i, j] = True
    work = chunk_work(visible, causal)
    return [order.chunk ** 2 * sum(work[j] for j in held) for held in order.members]
