"""Cross-entropy's peak GPU memory at the large vocabularies of flash-attn's own test file.

One forward + backward of the loss (mean) on a leaf of logits, as flash-attn's
``tests/losses/test_cross_entropy.py`` runs it: ``4·4096`` rows of 50257 and 128256 classes in
16-bit, ``4096`` rows of 128256 in fp32. The peak is ``torch.cuda.max_memory_allocated`` over
the step, the logits and targets included, read from an empty allocator; ``extra`` is that
peak minus the logits and one logits-sized gradient (what any loss must hold). Providers:
flashlite (default, and ``inplace_backward=True`` on the leaf), torch in the logits' dtype,
torch on an fp32 copy (flash-attn's test's reference) and, where installed, Liger. Every
gradient is checked against torch's fp32 one before its memory is read.

    python benchmarks/bench_ce_memory.py
    python benchmarks/bench_ce_memory.py --replot benchmarks/results/ce-memory-<device>.json
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import device_name, device_slug, metadata, start, write_results

import flashlite
from flashlite.plotting import Bars, Figure, Panel

#: flash-attn's test shapes (rows, classes, dtype): batch 4 × seqlen 4096 in 16-bit, one
#: sequence in fp32 ("Otherwise OOM", its comment says)
SHAPES = [
    (16384, 50257, torch.bfloat16),
    (16384, 128256, torch.bfloat16),
    (16384, 128256, torch.float16),
    (4096, 128256, torch.float32),
]
GIB = 2**30


def _providers() -> tuple[dict[str, Callable[..., torch.Tensor]], list[str]]:
    notes: list[str] = []
    providers: dict[str, Callable[..., torch.Tensor]] = {
        "flashlite": lambda x, t: flashlite.cross_entropy(x, t),
        "flashlite inplace_backward": lambda x, t: flashlite.cross_entropy(
            x, t, inplace_backward=True
        ),
        "torch": lambda x, t: F.cross_entropy(x, t),
        "torch on fp32 copy": lambda x, t: F.cross_entropy(x.float(), t),
    }
    try:
        from importlib.metadata import version

        from liger_kernel.transformers.functional import (  # type: ignore[import-not-found]
            liger_cross_entropy,
        )

        providers["liger"] = lambda x, t: liger_cross_entropy(x, t)
        notes.append(f"Liger {version('liger-kernel')}")
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        notes.append(f"Liger not available ({type(e).__name__})")
    return providers, notes


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure(
    n: int, v: int, dtype: torch.dtype, name: str, fn: Callable[..., torch.Tensor]
) -> dict[str, Any]:
    """One provider at one shape: peak GiB of a forward + backward on a fresh leaf, and its
    gradient's error against torch's fp32 gradient (computed first, then freed)."""
    gen = torch.Generator(device="cuda").manual_seed(n + v)
    x = torch.randn(n, v, device="cuda", dtype=dtype, generator=gen)
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[:10] = -100
    ref = x.to(torch.float32, copy=True).requires_grad_()
    F.cross_entropy(ref, t).backward()
    want = ref.grad.to(dtype)  # (compared in the logits' dtype: a copy held while measuring)
    del ref
    _fresh()
    leaf = x.clone().requires_grad_()
    del x
    _fresh()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        fn(leaf, t).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    except torch.cuda.OutOfMemoryError:
        return {"case": f"{n}x{v} {str(dtype)[6:]}", "provider": name, "oom": True}
    logits = leaf.numel() * leaf.element_size()
    err = (leaf.grad.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    row = {
        "case": f"{n}x{v} {str(dtype)[6:]}",
        "provider": name,
        # the step's peak with the logits (and the targets) counted in
        "peak_gib": (peak + logits + t.numel() * t.element_size()) / GIB,
        "extra_gib": max(0, peak - logits) / GIB,  # beyond one logits-sized gradient
        "logits_gib": logits / GIB,
        "grad_err": err,
        "ok": err <= 2e-2 * scale + 1e-6,
    }
    del leaf, want, t
    _fresh()
    return row


def _line(r: dict[str, Any]) -> str:
    """One row of the printed table."""
    head = f"{r['case']:>20} {r['provider']:>28}: "
    if r.get("oom"):
        return head + "OOM"
    return head + (
        f"peak {r['peak_gib']:6.2f} GiB (logits {r['logits_gib']:.2f}), extra "
        f"{r['extra_gib']:6.2f} GiB, grad err {r['grad_err']:.2e} ok={r['ok']}"
    )


def figure(rows: list[dict[str, Any]], device: str) -> Figure:
    """Peak GiB of one forward + backward per shape and provider, the logits' size dashed."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    peak = {(r["case"], r["provider"]): r.get("peak_gib", math.nan) for r in rows}
    panel = Panel(
        bars=[Bars([peak[(c, p)] for c in cases], p) for p in providers],
        categories=cases,
        grid="major",
        ylabel="peak GiB, logits included (lower is better)",
        title="cross-entropy fwd+bwd on a leaf, mean, flash-attn's test shapes",
    )
    return Figure([[panel]], title=f"cross-entropy peak memory, {device}", panel_size=(10, 4.5))


def main(argv: list[str] | None = None) -> int:
    early = start(argv, __doc__, figure, "bench_ce_memory")
    if early is not None:
        return early
    providers, notes = _providers()
    rows = [measure(n, v, dt, name, fn) for n, v, dt in SHAPES for name, fn in providers.items()]
    out = [f"note: {note}" for note in notes]
    out += [_line(r) for r in rows]
    print("\n".join(out))
    write_results(
        f"ce-memory-{device_slug()}",
        rows,
        metadata(notes=notes),
        figure=figure(rows, device_name()),
        log="\n".join(out),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
