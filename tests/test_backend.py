"""flashlite._backend: where kernels run, the Triton version, and the interpreter's quirks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

import flashlite
from flashlite import _backend, _launch, _teams
from flashlite.kernels.common import cast

# A process that imports triton before flashlite. Without CUDA flashlite turns the interpreter
# on itself (its kernels are decorated afterwards; Triton's own jit library is made again). With
# CUDA, CPU tensors run on the GPU. With TRITON_INTERPRET=1 set first, everything interprets;
# with TRITON_INTERPRET=0 set by the user, nothing can run on a CPU and flashlite says so.
TRITON_FIRST = textwrap.dedent(
    """
    import sys
    if sys.argv[1:] == ["compile"]:  # torch.compile imports triton (the usual way it happens)
        import torch
        torch.compile(lambda t: t * 2)(torch.ones(3))
        assert "triton" in sys.modules
    else:
        import triton, triton.language
    import torch, flashlite
    torch.manual_seed(0)
    x = torch.randn(3, 100, requires_grad=True)
    try:
        y = flashlite.log_softmax(x)
    except RuntimeError as err:
        print("error:", err)
        raise SystemExit(0)
    y.sum().backward()
    xr = x.detach().double().requires_grad_()
    torch.log_softmax(xr, -1).sum().backward()
    assert (y.double() - torch.log_softmax(xr, -1)).abs().max() < 1e-5
    assert (x.grad.double() - xr.grad).abs().max() < 1e-5
    q, k, v = (torch.randn(1, 2, 33, 40) for _ in range(3))
    o = flashlite.attention(q, k, v, causal=True)
    ref = flashlite.reference.attention(q, k, v, True, upcast=True)
    assert (o.double() - ref).abs().max() < 1e-5
    print("ok")
    """
)


def _run(code: str, interpret: bool | None, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python, ``TRITON_INTERPRET`` unset (None), ``1`` or ``0``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = "1" if interpret else "0"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["import", "compile"])
def test_triton_imported_first(how: str) -> None:
    out = _run(TRITON_FIRST, None, how)
    assert out.returncode == 0, out.stderr[-3000:]
    problem = _backend._interpreter_problem()
    if problem is not None and not torch.cuda.is_available():  # (said clearly, as below)
        assert problem in out.stdout, out.stdout
    else:  # CPU: interpreted all the same; CUDA: CPU tensors went to the GPU and back
        assert out.stdout.strip().endswith("ok"), out.stdout


def test_triton_imported_first_with_the_interpreter_off() -> None:
    # TRITON_INTERPRET=0 is the user's: flashlite leaves it, and on a CPU says what to do
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels compile")
    out = _run(TRITON_FIRST, False, "import")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRITON_INTERPRET=1" in out.stdout and "before" in out.stdout, out.stdout


def test_triton_imported_first_with_the_interpreter_on() -> None:
    out = _run(TRITON_FIRST, True, "import")
    assert out.returncode == 0, out.stderr[-3000:]
    problem = _backend._interpreter_problem()
    if problem is not None:  # e.g. Triton 3.6 with numpy 2.5 (the GPU machine): said clearly
        assert problem in out.stdout, out.stdout
    else:
        assert out.stdout.strip().endswith("ok"), out.stdout


def test_nothing_in_triton_is_patched() -> None:
    from triton.runtime.jit import JITFunction

    # the methods are the ones Triton's own module defines
    assert JITFunction.__call__.__module__ == "triton.runtime.jit"
    assert JITFunction.__getitem__.__module__ == "triton.runtime.jit"


def test_minimum_triton_version_is_enforced_and_declared() -> None:
    import re
    from pathlib import Path

    assert _backend.TRITON_VERSION >= _backend.MIN_TRITON
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]$", pyproject, re.M)
    assert deps is not None, "pyproject.toml states its dependencies on one line"
    declared = re.findall(r'"(triton[^"]*)"', deps.group(1))
    assert declared == [f"triton>={'.'.join(map(str, _backend.MIN_TRITON))}"]
    # Triton's interpreter (every kernel on a CPU) imports numpy, which torch does not install
    assert re.search(r'"numpy[>=<]', deps.group(1)), "numpy must be a dependency"


def test_other_devices_get_a_clear_error() -> None:
    x = torch.empty(2, 3, device="meta")
    with pytest.raises(ValueError, match="x is on device meta"):
        flashlite.softmax(x)
    with pytest.raises(ValueError, match="q is on device meta"):
        flashlite.attention(*(torch.empty(1, 1, 2, 16, device="meta") for _ in range(3)))


def test_interpreter_workarounds_only_in_the_interpreter() -> None:
    interp = _backend.kernels_interpreted()
    assert _backend.dot_upcast(torch.bfloat16) == interp
    assert _backend.round_bf16(torch.bfloat16) == interp
    for dtype in (torch.float16, torch.float32):
        assert not _backend.dot_upcast(dtype) and not _backend.round_bf16(dtype)


# --------------------------------------------------------------------------- bf16 rounding
@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, cast(x, Y.dtype.element_ty, ROUND_BF16), mask=offs < n)


def _bf16_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    # exact half-way cases (both neighbours even/odd), the largest finite values, ±0, ±inf
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 - 2**-9], dtype=torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895e38, -3.3895e38])
    return torch.cat([normal, halfway, special]).float()


def test_bf16_cast_rounds_like_torch_bit_for_bit() -> None:
    dev = _backend.compute_device(torch.device("cpu"))
    x = _bf16_inputs().to(dev)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, y, x.numel(), BLOCK=1024, ROUND_BF16=_backend.round_bf16(torch.bfloat16)
    )
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    nan = torch.tensor([float("nan")] * 4, device=dev)
    ynan = torch.empty(4, dtype=torch.bfloat16, device=dev)
    _cast_kernel[(1,)](nan, ynan, 4, BLOCK=4, ROUND_BF16=_backend.round_bf16(torch.bfloat16))
    assert torch.isnan(ynan).all()


def test_bf16_results_are_not_biased() -> None:
    # truncation made every CPU bf16 result low; rounding to nearest leaves signed errors centred
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    out, lse = flashlite.attention(q, k, v, return_lse=True)
    ref, ref_lse = flashlite.reference.attention(q, k, v, upcast=True, return_lse=True)
    err = out.double() - ref
    assert err.mean().abs() < 0.1 * err.abs().mean(), (err.mean(), err.abs().mean())
    # The LSE keeps one offset the GPU has too: the kernel folds scale·log2(e) into Q and rounds
    # that to bf16 once (PRESCALE_Q), which moves the large scores consistently. Rounded to
    # nearest, the kernel's LSE is that computation's to fp32 accuracy.
    c = 32**-0.5 * 1.4426950408889634
    q_scaled = (q.float() * c).to(torch.bfloat16).double()
    scores_log2 = q_scaled @ k.double().transpose(-1, -2)
    want = torch.logsumexp(scores_log2 * 0.6931471805599453, -1)
    assert (lse.double() - want).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 4e-3
    x = torch.randn(64, 200, dtype=torch.bfloat16)
    err = flashlite.softmax(x).double() - torch.softmax(x.double(), -1)
    assert err.mean().abs() < 0.1 * err.abs().mean(), (err.mean(), err.abs().mean())


@pytest.mark.gpu
def test_gpu_direct_launch_keeps_specialisations_apart() -> None:
    # The Launcher reuses compiled kernels by key: an aligned call must not lend its kernel
    # (which assumes 16-byte alignment and divisible strides) to a misaligned or odd-sized one.
    for n in (16, 17, 1, 64):
        for offset in (0, 1, 0):
            buf = torch.randn(offset + 4 * n, device="cuda")
            x = buf[offset:].view(4, n)
            y = flashlite.softmax(x)
            err = (y - torch.softmax(x, -1)).abs().max().item()
            assert err < 1e-6, (n, offset, err)
    for offset in (0, 1, 0):
        buf = torch.randn(offset + 2 * 40 * 4 * 16, device="cuda", dtype=torch.float16)
        q = buf[offset:].view(2, 40, 4, 16)  # misaligned by 2 bytes when offset is 1
        out = flashlite.attention(q, q, q, causal=True, layout="b n h d")
        aligned = q.clone()  # same values, aligned storage
        want = flashlite.attention(aligned, aligned, aligned, causal=True, layout="b n h d")
        err = (out.float() - want.float()).abs().max().item()
        assert err == 0, (offset, err)
        ref = flashlite.reference.attention(*(t.transpose(1, 2) for t in (q, q, q)), True,
                                            upcast=True)  # fmt: skip
        ref_err = (out.transpose(1, 2).double() - ref).abs().max().item()
        assert ref_err < 2e-3, (offset, ref_err)


@pytest.mark.gpu
def test_gpu_raw_launch_and_launch_hooks() -> None:
    # On the Triton version _raw_launch was written against, a bound launch calls the compiled
    # kernel's C launcher directly (right results, on the current stream); a launch hook (what
    # a profiler adds) sends it through Triton's own path, which calls the hook.
    from triton import knobs

    x = torch.randn(8, 1000, device="cuda")
    want = torch.softmax(x, -1)
    assert (flashlite.softmax(x) - want).abs().max().item() < 1e-6
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = flashlite.softmax(x)
    side.synchronize()
    assert (y - want).abs().max().item() < 1e-6
    if _backend.TRITON_VERSION == _launch._RAW_LAUNCH_TESTED:
        kernel_id = id(_softmax_kernel())
        compiled = next(run.compiled for key, run in _launch._bound.items() if key[0] == kernel_id)
        assert _launch._raw_launch(compiled) is not None
    seen: list[object] = []
    hooks = knobs.runtime
    saved = hooks.launch_enter_hook
    hooks.launch_enter_hook = lambda metadata: seen.append(metadata)
    try:
        assert (flashlite.softmax(x) - want).abs().max().item() < 1e-6
    finally:
        hooks.launch_enter_hook = saved
    assert seen, "the launch hook was not called"


def _softmax_kernel() -> object:
    """The Triton kernel a small fp32 softmax forward launches (a launcher has compiled it)."""
    from flashlite.kernels import softmax as KS

    launched = {key[0] for key in _launch._bound}
    for name in dir(KS):
        kernel = getattr(KS, name)
        if id(kernel) in launched:
            return kernel
    raise AssertionError("no launched softmax kernel found")


class _FakeKernel:
    """Records warmups and launches the way a Triton JIT function receives them."""

    def __init__(self) -> None:
        self.warmups: list[tuple[tuple, dict]] = []
        self.launches: list[tuple[object, tuple, dict]] = []

    def warmup(self, *args: object, **kwargs: object) -> str:
        self.warmups.append((args, kwargs))
        return "compiled"

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_bound_launches_are_keyed_by_what_triton_specialises_on() -> None:
    # ints by Triton's classes (1, multiples of 16, 32/64-bit), floats by type, constexpr
    # parameters by value: a decode loop whose key count grows by one per step binds a few
    # launches, not one per step
    class Param:
        def __init__(self, name: str, is_constexpr: bool) -> None:
            self.name, self.is_constexpr = name, is_constexpr

    kernel = _FakeKernel()
    kernel.params = [Param("n", False), Param("x", False), Param("BLOCK", True)]  # type: ignore[attr-defined]
    launcher = _launch.Launcher(kernel)
    key = launcher._key
    assert key((1000, 0.5, 64), {}) == key((1003, 2.0, 64), {})
    assert key((1000, 0.5, 64), {}) != key((1008, 0.5, 64), {})  # divisible by 16
    assert key((16, 0.5, 64), {}) != key((1, 0.5, 64), {})  # 1 is a constant
    assert key((5, 0.5, 64), {}) != key((2**31 + 5, 0.5, 64), {})  # i64
    assert key((5, 0.5, 64), {}) != key((5, 0.5, 128), {})  # a constexpr's value
    assert _launch._int_class(-32) == (0, False, True)


@pytest.mark.parametrize(
    ("capacity", "n_rows", "teams"), [(528, 1000, 33), (528, 10, 10), (8, 5, 1)]
)
def test_launch_teams_sizes_a_resident_cooperative_grid(
    capacity: int, n_rows: int, teams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on a GPU: as many teams of 16 as fit at once (never more than the rows, at least one),
    # launched cooperatively, the team count passed as the last argument
    # (the team count is found once per kernel, options, rows and tensor types: a second call
    # launches without another warmup)
    monkeypatch.setattr(_teams, "resident_programs", lambda compiled, index: capacity)
    _teams._team_counts.clear()
    kernel = _FakeKernel()
    for _ in range(2):
        got = _teams.launch_teams(kernel, ["x", 7], {"BLOCK_N": 64}, 16, n_rows,
                                    torch.device("cuda", 0))  # fmt: skip
        assert got == teams
    assert kernel.warmups == [(("x", 7, n_rows), {"BLOCK_N": 64, "launch_cooperative_grid": True,
                                                  "grid": (1,)})]  # fmt: skip
    assert kernel.launches == 2 * [((teams * 16, 1, 1), ("x", 7, teams),
                                    {"BLOCK_N": 64, "launch_cooperative_grid": True})]  # fmt: skip


def test_launch_teams_in_the_interpreter_takes_single_program_teams_only() -> None:
    kernel = _FakeKernel()
    assert _teams.launch_teams(kernel, ["x"], {}, 1, 8, torch.device("cpu")) == 3
    assert kernel.launches == [((3,), ("x", 3), {})] and kernel.warmups == []
    with pytest.raises(ValueError, match="teams of 4 programs need a CUDA device"):
        _teams.launch_teams(kernel, ["x"], {}, 4, 8, torch.device("cpu"))


# --------------------------------------------------------------------------- launch fallback
LAUNCH_FALLBACK = textwrap.dedent(
    """
    import torch, flashlite
    from flashlite import _launch
    from flashlite.kernels import softmax as KS
    assert _launch.LAUNCH_MODE == "triton"
    assert not _launch.launcher(KS._softmax_bwd_kernel).direct
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, 300, device=dev, requires_grad=True)
    y = flashlite.softmax(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(torch.softmax(xr, -1), xr, torch.ones_like(xr))
    assert (y.double() - torch.softmax(xr, -1)).abs().max() < 1e-5
    assert (g.double() - gr).abs().max() < 1e-5
    q = torch.randn(1, 2, 40, 32, device=dev, dtype=torch.float16)
    o = flashlite.attention(q, q, q, causal=True)
    ref = flashlite.reference.attention(q, q, q, True, upcast=True)
    assert (o.double() - ref).abs().max() < 2e-3
    print("ok", len(_launch._bound))
    """
)


def _run_with_launch_env(value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLASHLITE_LAUNCH": value}
    return subprocess.run([sys.executable, "-c", LAUNCH_FALLBACK], env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip


def test_launch_env_falls_back_to_tritons_own_launch() -> None:
    # FLASHLITE_LAUNCH=triton: no bound launch anywhere (nothing enters the bound-launch
    # cache), right results forward and backward; on a GPU the same (the gpu twin below)
    done = _run_with_launch_env("triton")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "0"]


@pytest.mark.gpu
def test_gpu_launch_env_falls_back_to_tritons_own_launch() -> None:
    test_launch_env_falls_back_to_tritons_own_launch()


def test_launch_env_refuses_unknown_values() -> None:
    done = _run_with_launch_env("fast")
    assert done.returncode != 0
    assert "FLASHLITE_LAUNCH='fast' is not one of direct, triton" in done.stderr


# --------------------------------------------------------------------------- bounded caches
def test_caches_are_bounded_over_a_thousand_shapes() -> None:
    # every cache lives in one registry with a limit; a sweep over 1000 row lengths (each a new
    # kind of call for the softmax plans) leaves each at or under its limit, oldest dropped
    from flashlite import _caches

    limits = {name: c.limit for name, c in _caches.caches().items()}
    assert {"softmax.fwd", "softmax.fwd_dense", "softmax.bwd", "launch.bound"} <= set(limits)
    small = _caches.caches()["softmax.fwd_dense"]  # (dense rows: planned by shape)
    saved = small.limit
    small.limit = 50  # (a small limit, so 1000 shapes overflow it many times over quickly)
    try:
        for n in range(1, 1001):
            flashlite.softmax(torch.randn(1, n))
        assert len(small) == 50
        latest = {key[0][1] for key in small}  # the row lengths still planned: the newest
        assert latest == set(range(951, 1001))
    finally:
        small.limit = saved
    for name, cache in _caches.caches().items():
        assert len(cache) <= cache.limit, name


@pytest.mark.skipif(not _backend.INTERPRETED, reason="the interpreter's numpy warnings only")
def test_interpreter_floating_point_warnings_are_off_inside_launches_only() -> None:
    """Masked rows compute with −inf on purpose; in the interpreter numpy would warn about it on
    every call ("divide by zero", "invalid value"). flashlite's launches quiet it, and leave the
    caller's numpy settings as they were."""
    import warnings

    import numpy as np

    before = np.geterr()
    x = torch.randn(4, 100)
    x[0] = -math.inf
    x[1, :50] = -math.inf
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        flashlite.softmax(x)
        flashlite.log_softmax(x)
        flashlite.attention(q, k, k, causal=True)  # (its first four rows see no key)
        flashlite.cross_entropy(x[2:], torch.tensor([1, 2]))
    assert np.geterr() == before
    with pytest.warns(RuntimeWarning):  # (numpy itself still warns the user's own code)
        np.log(np.zeros(1))
