"""Shared pieces of the attention tests: random inputs and the comparison with the fp64
reference under flash-attn's rule (within 2x PyTorch's own low-precision error, plus a floor)."""

from __future__ import annotations

import math

import torch
from conftest import TOL

from flashlite.masking.masks import torch_visible
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rand(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def assert_close_to_reference(out, q, k, v, causal=False, scale=None, lse=None):
    """Compare with fp64 math attention; allow 2x PyTorch's low-precision error + ATOL."""
    ref, ref_lse = ref_attention(q, k, v, causal, scale, upcast=True, return_lse=True)
    torch_lp, torch_lse = ref_attention(q, k, v, causal, scale, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    err = (out.double() - ref).abs().max().item()
    torch_err = (torch_lp.double() - ref).abs().max().item()
    assert err <= 2 * torch_err + TOL[q.dtype].floor, (err, torch_err)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "wrong -inf rows"
        fin = torch.isfinite(ref_lse)
        diff = (lse[fin].double() - ref_lse[fin]).abs().max().item()
        torch_diff = (torch_lse[fin].double() - ref_lse[fin]).abs().max().item()
        floor = TOL[q.dtype].floor * max(1.0, ref_lse[fin].abs().max().item())
        assert diff <= 2 * torch_diff + floor, diff


def _rows_reference(q, k, v, causal, rows):
    """fp64 reference for a subset of query rows (long sequences: the full matrix is huge)."""
    nq, nk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = (q[:, :, rows].double() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch_visible(nq, nk, True, rows=rows), -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv
