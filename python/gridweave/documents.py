"""Packed documents: several documents in one training sequence, attention within
each (ring-flash-attn's varlen API, torchtitan's document masking). A batch of packed sequences
carries its document ids: an int64 (b, L) tensor, one id per token of the whole sequence, equal
ids for one document's tokens (which are consecutive). Every attention path (dense, both rings,
RSA, Ulysses, USP) takes the ids of the whole sequence and masks by them."""
from __future__ import annotations

import torch

from .errors import GridError
from .layout import Layout, local_slices


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
