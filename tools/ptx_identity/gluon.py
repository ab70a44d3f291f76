"""The Gluon (Hopper) kernels, which no CPU test launches: compiled offline through flashlite's
own plan functions (CPU stand-in tensors), the first launch of each case compiled and stopped.
Dense attention forward/backward, the flex-over-tables kernels with the mods the recorded Triton
flex launches used, and the prefetching cross-entropy kernel."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tools.ptx_identity.driver import normalise
from tools.ptx_identity.record import Key
from tools.ptx_identity.results import Results
from tools.ptx_identity.specs import build

Case = tuple[str, Callable[[], None]]
#: the flex constexprs that pick a mod; their values come from the records
MOD_KEYS = ("MASK_MOD", "N_MASK_BUF", "SCORE_MOD", "SCORE_GRAD", "N_SCORE_BUF", "HAS_SCORE")
MOD_SLOTS = ("MB0", "MB1", "MB2", "MB3", "SB0", "SB1", "SB2", "SB3")
B, H, N = 1, 2, 512


class _Launched(BaseException):
    """Raised where the kernel would launch (a BaseException: no handler of flashlite's eats it)."""


@contextlib.contextmanager
def first_launch(seen: list[tuple[str, Any]]) -> Iterator[None]:
    """While active, a launch compiles (kept in ``seen``) and stops its case."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        compiled = original(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append((getattr(self, "__name__", None) or self.fn.__name__, compiled))
        raise _Launched

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def dense_cases() -> Iterator[Case]:
    """Hopper attention forward (dtype, head dim, causal, sinks) and backward."""
    from flashlite.kernels.attention import hopper as kh
    from flashlite.ops.attention.backends import hopper as bh

    def fwd(d: int, causal: bool, sinks: bool, dtype: torch.dtype) -> None:
        q, k, v, o = (_t(B, H, N, d, dtype=dtype) for _ in range(4))
        lse = _t(B, H, N, dtype=torch.float32)
        run = bh.plan_fwd_hopper(q, k, causal, 0.1, kh.CONFIGS[d], sinks)
        run(q, k, v, o, lse, _t(H, dtype=torch.float32) if sinks else None)

    def bwd(d: int, dtype: torch.dtype) -> None:
        qs, k, v, do, dq, dk, dv = (_t(B, H, N, d, dtype=dtype) for _ in range(7))
        lse, delta = (_t(B, H, N, dtype=torch.float32) for _ in range(2))
        acc = _t(B, H, N, d, dtype=torch.float32)
        for causal in (False, True):  # both in one case: each stops at its first launch
            run = bh.plan_bwd_hopper(qs, k, do, dk, dv, causal, 0.1)
            with contextlib.suppress(_Launched):
                run(qs, k, v, do, lse, delta, dq, dk, dv, acc)

    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for causal in (False, True):
                for sinks in (False, True):
                    name = f"gluon fwd d{d} {dtype} causal={causal} sinks={sinks}"
                    yield name, lambda a=(d, causal, sinks, dtype): fwd(*a)
            yield f"gluon bwd d{d} {dtype}", lambda a=(d, dtype): bwd(*a)


def flex_cases(records: dict[Key, int], limit: int = 6) -> Iterator[Case]:
    """Gluon flex forward/backward with the mods (and mod buffers) of up to ``limit`` distinct
    recorded Triton flex launches per kernel; ALiBi as well where the score mod is ALiBi's."""
    from flashlite.kernels.attention import flex as kf

    kernels = {
        "_flex_fwd_kernel": kf._flex_fwd_kernel,
        "_flex_bwd_dkdv_kernel": kf._flex_bwd_dkdv_kernel,
    }
    seen: set[tuple[str, tuple[Any, ...]]] = set()
    for key in sorted(records, key=repr):
        if key[1] not in kernels:
            continue
        kw = dict(key[3])
        mods_spec = tuple((k, kw[k]) for k in MOD_KEYS if k in kw)
        if (key[1], mods_spec) in seen or sum(1 for s in seen if s[0] == key[1]) >= limit:
            continue
        seen.add((key[1], mods_spec))
        positional = dict(zip([p.name for p in kernels[key[1]].params], key[2], strict=False))
        mod_args = [build(positional[n]) for n in MOD_SLOTS]
        mods = {k: build(v) for k, v in mods_spec}
        forward = key[1] == "_flex_fwd_kernel"
        score = dict(mods_spec).get("SCORE_MOD")
        alibis = (False, True) if forward and score and "alibi" in repr(score) else (False,)
        tag = ",".join(str(v[1])[:24] if v[0] == "J" else str(v) for _, v in mods_spec)
        for alibi in alibis:
            for d in (64, 128):
                a = (forward, mods, mod_args, d, alibi)
                yield f"gluon flex {key[1][6:9]} d{d} alibi={alibi} {tag}", lambda a=a: _flex(*a)


def _flex(forward: bool, mods: dict[str, Any], mod_args: list[Any], d: int, alibi: bool) -> None:
    from flashlite.kernels.attention import hopper as kh
    from flashlite.ops.attention.backends.tables import gluon as tg

    tables = tuple(torch.zeros(B, H, 4, 4, dtype=torch.int32) for _ in range(4))
    strides = (16, 16, 4, 16, 16, 4)
    f32 = torch.float32
    if forward:
        q, k, v, o = (_t(B, H, N, d) for _ in range(4))
        fwd_mods = {k: v for k, v in mods.items() if k != "SCORE_GRAD"}  # the backward's only
        args = (q, k, v, o, _t(B, H, N, dtype=f32), tables, strides, 0.1, kh.CONFIGS[d])
        tg.plan_flex_fwd(*args, mod_args, {**fwd_mods, "ALIBI": alibi})
    else:
        qs, k, v, do, dq, dk, dv = (_t(B, H, N, d) for _ in range(7))
        lse, delta = (_t(B, H, N, dtype=f32) for _ in range(2))
        acc = _t(B, H, N, d, dtype=f32)
        args = (qs, k, v, do, lse, delta, dq, dk, dv, acc, tables, strides, 0.1)
        tg.plan_flex_bwd(*args, mod_args, mods)


def cross_entropy_cases() -> Iterator[Case]:
    """The prefetching cross-entropy kernel through its host plan: dtype, an even and an uneven
    vocabulary, smoothing, z-loss and the (count, check, reduce) modes."""
    from flashlite.ops.cross_entropy import plan

    def case(
        dtype: torch.dtype, vocab: int, smooth: float, z: float, mode: tuple[bool, bool, int]
    ) -> None:
        x = torch.empty(8, vocab, dtype=dtype)
        target = torch.zeros(8, dtype=torch.int64)
        grad = torch.empty_like(x)
        run = plan._plan_prefetch(x, target, grad, (-100, smooth, z, 0.0), mode)
        losses = torch.empty(8, dtype=torch.float32)
        scale = None if mode[0] else torch.ones(1)
        bad = torch.zeros(3, dtype=torch.int64) if mode[1] else None
        out = torch.empty(1) if mode[2] else None
        run(x, target, scale, grad, losses, torch.empty_like(losses), bad, out)

    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (32768, 40000):
            for smooth in (0.0, 0.1):
                for z in (0.0, 1e-4):
                    for mode in ((False, False, 0), (True, True, 2), (False, True, 1)):
                        name = f"gluon ce {str(dtype)[6:]} V={vocab} eps={smooth} z={z} mode={mode}"
                        yield name, lambda a=(dtype, vocab, smooth, z, mode): case(*a)


def run_cases(cases: list[Case], results: Results, verbose: bool = True) -> None:
    """Compile each case's launches into ``results``."""
    from flashlite import _teams

    seen: list[tuple[str, Any]] = []
    fits = _teams.teams_fit
    _teams.teams_fit = lambda n_chunks, device: True  # CPU tensors: the team kernels fit
    try:
        for name, call in cases:
            start = time.time()
            seen.clear()
            try:
                with first_launch(seen), contextlib.suppress(_Launched):
                    call()
            except Exception as e:  # noqa: BLE001  (one case's failure must not hide the others)
                results.error(name, e)
                if verbose:
                    print(f"{name:70s} {results.cases[name]}", flush=True)
                continue
            if not seen:
                results.error(name, RuntimeError("nothing launched"))
            for kernel, compiled in seen:
                results.add(name, kernel, normalise(compiled.asm["ptx"]))
            if verbose:
                print(f"{name:70s} {results.cases[name]} {time.time() - start:5.1f}s", flush=True)
    finally:
        _teams.teams_fit = fits
