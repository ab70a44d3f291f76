"""Record the Triton launches a Hopper GPU would make, which the CPU tests never reach: the
measured config tables, TMA descriptors, the large-problem paths. flashlite's host code runs
under the interpreter, told that kernels are compiled, the device is sm_90 and every tensor is
TMA-readable; each launch is recorded and skipped (the inputs are never computed).

Run in its own process (it patches flashlite for good): ``TRITON_INTERPRET=1 python -m
tools.ptx_identity.gpu_variants FOLDER``; the CLI's ``record`` does it for you."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tools.ptx_identity import record


def pretend_hopper() -> None:
    """Send flashlite down its compiled-GPU paths: kernels compiled, capability (9, 0), TMA
    allowed, no small-problem shortcut, the tile tables instead of the autotuner."""
    import flashlite  # noqa: F401  (loads every module patched below)
    from flashlite import _backend
    from flashlite.ops.attention.backends.triton import config as tc

    _backend.kernels_interpreted = lambda: False
    _backend.capability = lambda *a, **k: (9, 0)
    original_fixed = tc.fixed_config

    def fixed_config(
        device: Any,
        block_d: int | None = None,
        causal: bool = False,
        dtype: Any = None,
        small: bool = False,
        softcap: bool = False,
    ) -> Any:
        # the table row a Hopper would use (the autotuner's choices are not reproducible)
        pinned = tc.C.pinned_config()
        if pinned is not None:
            return pinned
        return tc._table_entry(block_d, causal, dtype, small, True, softcap)

    # the names were imported into their users' modules: patch every copy
    for module in [m for m in sys.modules.values() if m is not None]:
        if not getattr(module, "__name__", "").startswith("flashlite"):
            continue
        if hasattr(module, "descriptor_ok"):
            module.descriptor_ok = lambda *t: True
        if hasattr(module, "small_problem"):
            module.small_problem = lambda q, k: False
        if getattr(module, "fixed_config", None) is original_fixed:
            module.fixed_config = fixed_config


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _attention(dtype: torch.dtype, d: int, options: dict[str, Any]) -> None:
    import flashlite

    q, k, v = (_t(1, 4, 1024, d, dtype=dtype, grad=True) for _ in range(3))
    o = flashlite.attention(q, k, v, **options)
    o.backward(torch.randn_like(o))


def _varlen(dtype: torch.dtype, d: int) -> None:
    import flashlite

    q, k, v = (_t(1024, 4, d, dtype=dtype, grad=True) for _ in range(3))
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    o = flashlite.attention_varlen(q, k, v, cu, cu, 724, 724, causal=True)
    o.backward(torch.randn_like(o))


def _decode(dtype: torch.dtype, d: int) -> None:
    import flashlite

    q = _t(2, 1, 8, d, dtype=dtype)
    kc, vc = (_t(2, 4096, 2, d, dtype=dtype) for _ in range(2))
    lens = torch.tensor([4000, 100], dtype=torch.int32)
    flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens)
    new = {"k_new": _t(2, 1, 2, d, dtype=dtype), "v_new": _t(2, 1, 2, d, dtype=dtype)}
    flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, **new)


def _cross_entropy() -> None:
    import flashlite

    for dtype in (torch.bfloat16, torch.float32):
        x = _t(64, 32000, dtype=dtype, grad=True)
        y = torch.randint(0, 32000, (64,))
        flashlite.cross_entropy(x, y).backward()
        flashlite.cross_entropy(x, y, label_smoothing=0.1, softcap=20.0).backward()


MASKS: tuple[dict[str, Any], ...] = (
    {},
    {"causal": True},
    {"window": (128, 0)},
    {"softcap": 30.0},
    {"causal": True, "softcap": 30.0},
    {"window": (64, 64)},
)


def cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, call) for every GPU-shaped call the recorder makes."""
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for options in MASKS:
                yield (
                    f"attention {dtype} d{d} {options}",
                    lambda a=(dtype, d, options): _attention(*a),
                )
            yield f"varlen {dtype} d{d}", lambda a=(dtype, d): _varlen(*a)
            yield f"decode {dtype} d{d}", lambda a=(dtype, d): _decode(*a)
    yield "cross_entropy", _cross_entropy


def main(folder: str) -> int:
    """Record every case into ``folder``; a case that fails is reported and skipped."""
    record.install(launch=False)
    pretend_hopper()
    failed = 0
    for name, call in cases():
        try:
            call()
        except Exception as e:  # noqa: BLE001  (one case's failure must not hide the others)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:200]}")
    record.save(folder)
    print("gpu-variant launches recorded:", dict(Counter(k[1] for k in record.RECORDS)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
