"""torch's fused attention on grouped-query heads (Ainslie et al. 2023): key/value heads handed
to the kernel as they are where it groups them, repeated to the query heads where it cannot."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kernel_groups_heads(t: torch.Tensor, masked: bool) -> bool:
    """Whether torch's fused attention takes grouped key/value heads of `t`'s device and dtype as
    they are (enable_gqa) with no mask: CPU's flash kernel does; on CUDA only flash attention,
    which runs half precision alone (float32 would take the math kernel with its scores kept)."""
    return not masked and (t.device.type != "cuda" or t.dtype in (torch.float16, torch.bfloat16))


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads (b, g, s, d) each repeated to `heads` (a multiple of g): group j's copies
    in a row, so query head i reads copy i (grouped-query attention's map i -> i // (heads / g))."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def grouped_attention(q, k, v, causal: bool, mask=None) -> torch.Tensor:
    """torch's attention of q (b, h, s, d) over k, v (b, g, s', d) with g dividing h (query head i
    reads key/value head i // (h / g)): the kernel groups them where it can, else they are repeated.
    mask: a boolean (b, 1, s, s') mask (packed documents, causality included), or None."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and mask is None, attn_mask=mask)
    if kernel_groups_heads(q, mask is not None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal and mask is None, attn_mask=mask)
