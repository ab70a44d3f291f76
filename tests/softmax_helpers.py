"""Shared pieces of the softmax tests: the ops and their torch references, the paths'
block tables, and the comparisons of outputs and gradients with the fp64 reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from conftest import TOL

import flashlite

NEG_INF = -math.inf
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FNS = {"softmax": flashlite.softmax, "log_softmax": flashlite.log_softmax}
REFS = {"softmax": torch.softmax, "log_softmax": torch.log_softmax}


# path id -> (algorithm, block-table overrides). Rows of n elements take the path when
# next_pow2(n) > 16 for "split"; the looping paths tile every n > 8.
PATHS: dict[str, tuple[str, dict[str, int]]] = {
    # auto, row fits on chip: single-read forward, one-tile backward
    "single_read": ("auto", {}),
    # auto, row "too long" (SINGLE_READ_MAX=16): split forward with 8-column chunks and a
    # CHUNKS_PAD > n_chunks merge; backward takes the looping two-pass path with 8-wide tiles
    "split": ("auto", {"SINGLE_READ_MAX": 16, "SPLIT_CHUNK": 8, "LOOP_TILE": 8}),
    # online forward over 8-wide tiles (several tiles, ragged last one); one-tile backward
    "online": ("online", {"LOOP_TILE": 8}),
    # three_pass forward over 8-wide tiles; one-tile backward
    "three_pass": ("three_pass", {"LOOP_TILE": 8}),
}


def _reference(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    return REFS[op](x.double(), dim)


def _assert_matches(y: torch.Tensor, x: torch.Tensor, dim: int, op: str) -> None:
    assert y.dtype == x.dtype and y.shape == x.shape
    atol, rtol = TOL[x.dtype][:2]
    torch.testing.assert_close(y.double(), _reference(x, dim, op), atol=atol, rtol=rtol)


def _grads(fn: Callable, x: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    xr = x.detach().clone().requires_grad_(True)
    fn(xr, dim).backward(dy)
    assert xr.grad is not None
    return xr.grad


def _assert_grad_close(dx: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, op: str) -> None:
    """fp32: close to the fp64 gradient. fp16/bf16: the saved output is rounded to the input
    dtype (as in torch), and log_softmax's ``dy − e^z Σdy`` multiplies that rounding by a row
    sum, so the bound is the flash-attention one: at most 2x torch's own error plus atol."""
    assert dx.dtype == x.dtype
    ref = _grads(REFS[op], x.double(), dy.double(), -1)
    atol, rtol = TOL[x.dtype][:2]
    if x.dtype == torch.float32:
        torch.testing.assert_close(dx.double(), ref, atol=atol, rtol=rtol)
        return
    torch_err = (_grads(REFS[op], x, dy, -1).double() - ref).abs().max().item()
    err = (dx.double() - ref).abs().max().item()
    assert err <= 2 * torch_err + atol, f"max error {err:.3g}, torch's {torch_err:.3g}"
