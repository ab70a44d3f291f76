"""Shared pieces of the HBM traffic tests (``test_traffic_*.py``): attention shapes and the
committed H200 measurements."""

from __future__ import annotations

from pathlib import Path

import torch

from flashlite.traffic import AttentionShape


def _shape(
    b: int, h: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype, causal: bool
) -> AttentionShape:
    return AttentionShape(b, h, nq, d, seq_k=nk, kv_heads=hkv, dtype=dtype, causal=causal)


# (B, H, Hkv, Nq, Nk, D): the code path each one exercises in the kernel's loop bounds
ATTENTION_SHAPES = [
    (1, 2, 2, 16, 16, 16),  # whole tiles only: no masked tile when not causal
    (1, 2, 2, 33, 17, 8),  # partial query and key tiles; causal: Nq > Nk, top rows see nothing
    (2, 4, 2, 17, 40, 24),  # GQA, Nk > Nq (diagonal shifted right), D not a power of two
    (1, 3, 1, 5, 7, 8),  # MQA, a single partial tile each way
]


MEASURED = Path(__file__).parents[1] / "benchmarks" / "results" / "traffic-nvidia-h200.json"
