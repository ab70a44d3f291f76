"""What the traffic tools talk about: an attention call's shape, a byte count, and the names of
the methods and softmax algorithms every traffic function accepts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flashlite.masking import masks

#: Methods every traffic function accepts; the sdpa-* ones can only be measured on a GPU.
ATTENTION_METHODS = ("naive", "flashlite", "sdpa-flash", "sdpa-cudnn")
#: Softmax kernels of :mod:`flashlite.kernels.softmax` (``auto`` resolves to one of the last two).
SOFTMAX_ALGORITHMS = ("three_pass", "online", "single_read", "split")
#: GPU-only (their programs wait for each other, which the interpreter cannot run; prefetch is
#: Gluon, which it cannot run either): modelled only
SOFTMAX_GPU_ALGORITHMS = ("team", "prefetch")
_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)``.

    ``kv_heads=None`` means ``Hkv = H`` (no GQA); ``seq_k=None`` means ``Nk = Nq``.
    ``dtype=torch.float8_e4m3fn``: FP8 attention, e4m3 q, k, v with one descale factor per
    tensor and a bf16 output; in decoding, an e4m3 cache read by bf16 queries.
    ``head_dim_v``: V's and O's head dim where it is not ``head_dim`` (DeepSeek's 192/128).
    """

    batch: int
    heads: int
    seq_q: int
    head_dim: int
    seq_k: int | None = None
    kv_heads: int | None = None
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_q", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.heads % self.hkv:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.hkv}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype={self.dtype} is not one of {list(_DTYPES)}")

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def nk(self) -> int:
        return self.seq_q if self.seq_k is None else self.seq_k

    @property
    def mask(self) -> masks.Mask:
        """The call's mask (causal or none), as the launchers and the torch twins take it."""
        return masks.describe(self.causal)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def dv(self) -> int:
        """V's and O's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def fp8(self) -> bool:
        """FP8 inputs (a cache, in decoding): their descale factors are read too."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def out_itemsize(self) -> int:
        """Bytes per output element (and per query element in decoding): bf16's for FP8."""
        return 2 if self.fp8 else self.itemsize

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.head_dim_v is None:  # (the usual shape: its JSON as before V had its own)
            del d["head_dim_v"]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> AttentionShape:
        return AttentionShape(**{**d, "dtype": _DTYPES[d["dtype"]]})


@dataclass
class Traffic:
    """Bytes read and written by one call; ``parts[name] = [read, write]`` breaks them down."""

    read: int = 0
    write: int = 0
    parts: dict[str, list[int]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.read + self.write

    def add(self, name: str, read: int, write: int) -> None:
        self.read += read
        self.write += write
        part = self.parts.setdefault(name, [0, 0])
        part[0] += read
        part[1] += write


def byte_fields(**figures: Traffic | None) -> dict[str, int | None]:
    """``{name}_bytes`` / ``_read`` / ``_write`` entries for JSON rows; None where absent."""
    out: dict[str, int | None] = {}
    for name, t in figures.items():
        out[f"{name}_bytes"] = t.total if t is not None else None
        out[f"{name}_read"] = t.read if t is not None else None
        out[f"{name}_write"] = t.write if t is not None else None
    return out


def make_inputs(
    shape: AttentionShape, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)`` for ``shape``."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, D = shape.batch, shape.heads, shape.hkv, shape.head_dim
    q = torch.randn(B, H, shape.seq_q, D, generator=g)
    k = torch.randn(B, Hkv, shape.nk, D, generator=g)
    v = torch.randn(B, Hkv, shape.nk, shape.dv, generator=g)
    return tuple(t.to(device=device, dtype=shape.dtype) for t in (q, k, v))  # type: ignore[return-value]


#: Bytes an FP8 program reads of its descale factors: q's, k's and v's, fp32 each.
DESCALE_BYTES = 3 * 4
