"""The Gluon twins of the (m, s) helpers (:mod:`flashlite.stats_gluon`) against the torch twins.

On the GPU each twin runs in a tiny Gluon kernel on fp32 tiles and is held against
:mod:`flashlite.stats`'s torch twins in fp64: rows of −inf, the identity (−inf, 0), values near
±1e4 and +inf. On the CPU: the module's names and its import guard, and every test kernel built
for sm_90 (Triton compiles Gluon without a GPU; the interpreter cannot run it).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import reduce
from pathlib import Path

import pytest
import torch

from flashlite import stats
from flashlite import stats_gluon as SG

INF = math.inf
LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
R, C = 16, 32  # the test tiles: R rows of C columns
HAS_GLUON = SG.GLUON_IMPORT_ERROR is None

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from flashlite.stats_gluon import (
        finalize_lse,
        lse_log2,
        merge_partials,
        online_update,
        probs_from_lse_t,
        probs_from_pair,
        rescale,
        tile_stats,
    )

    @gluon.constexpr_function
    def _tile_layout():  # noqa: ANN202
        return gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])

    @gluon.constexpr_function
    def _row_layout():  # noqa: ANN202
        return gl.BlockedLayout([1], [32], [4], [0])

    @gluon.jit
    def _tile(R: gl.constexpr, C: gl.constexpr):
        """Row-major offsets of an ``[R, C]`` tile, its rows' and its columns'."""
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, _tile_layout()))
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, _tile_layout()))
        return gl.expand_dims(rows, 1) * C + gl.expand_dims(cols, 0), rows, cols

    @gluon.jit
    def _row(C: gl.constexpr):
        """This program's row ``r`` of a row-major ``[R, C]`` tile, as a 1-D tile: ``r`` and
        the row's offsets."""
        r = gl.program_id(0)
        return r, r * C + gl.arange(0, C, layout=_row_layout())

    @gluon.jit
    def _online_update_kernel(
        M,
        S,
        X,
        SHIFT,
        MO,
        SO,
        AO,
        PO,
        R: gl.constexpr,
        C: gl.constexpr,
        UNITS: gl.constexpr,
        SHIFTED: gl.constexpr,
    ):
        tile, rows, _ = _tile(R, C)
        m, s, a, p = online_update(
            gl.load(M + rows),
            gl.load(S + rows),
            gl.load(X + tile),
            UNITS,
            gl.load(SHIFT + rows),
            SHIFTED,
        )
        gl.store(MO + rows, m)
        gl.store(SO + rows, s)
        gl.store(AO + rows, a)
        gl.store(PO + tile, p)

    @gluon.jit
    def _tile_stats_kernel(
        X,
        MO,
        SO,
        PO,
        R: gl.constexpr,
        C: gl.constexpr,
        SCALE: gl.constexpr,
        FMA: gl.constexpr,
        ONE_D: gl.constexpr,
    ):
        if ONE_D:  # program r: row r as a 1-D tile, scalar statistics
            rows, tile = _row(C)
        else:
            tile, rows, _ = _tile(R, C)
        m, s, p = tile_stats(gl.load(X + tile), SCALE, FMA)
        gl.store(MO + rows, m)
        gl.store(SO + rows, s)
        gl.store(PO + tile, p)

    @gluon.jit
    def _merge_partials_kernel(
        M, S, MO, SO, R: gl.constexpr, C: gl.constexpr, SCALE: gl.constexpr, ONE_D: gl.constexpr
    ):
        if ONE_D:
            rows, tile = _row(C)
        else:
            tile, rows, _ = _tile(R, C)
        m, s = merge_partials(gl.load(M + tile), gl.load(S + tile), SCALE)
        gl.store(MO + rows, m)
        gl.store(SO + rows, s)

    @gluon.jit
    def _rows_kernel(MA, MB, S, LO, RO, R: gl.constexpr, SCALE: gl.constexpr):
        """``finalize_lse(MA, S)`` and ``rescale(MA, MB)``, elementwise over ``R`` values."""
        i = gl.arange(0, R, layout=_row_layout())
        m = gl.load(MA + i)
        gl.store(LO + i, finalize_lse(m, gl.load(S + i), SCALE))
        gl.store(RO + i, rescale(m, gl.load(MB + i), SCALE))

    @gluon.jit
    def _probs_from_lse_t_kernel(
        XT, LSE, L2O, PO, P2O, R: gl.constexpr, C: gl.constexpr, SCALE: gl.constexpr
    ):
        """An ``[R keys, C queries]`` tile, one LSE per column: the probabilities from the
        natural LSE, and from its base-2 form (as a kernel that converts it once passes it)."""
        tile, _, cols = _tile(R, C)
        xt = gl.load(XT + tile)
        lse = gl.load(LSE + cols)
        lse2 = lse_log2(lse)
        gl.store(L2O + cols, lse2)
        gl.store(PO + tile, probs_from_lse_t(xt, lse, SCALE))
        gl.store(P2O + tile, probs_from_lse_t(xt, lse2, SCALE, True))

    @gluon.jit
    def _probs_from_pair_kernel(
        X,
        M,
        S,
        W,
        PO,
        R: gl.constexpr,
        C: gl.constexpr,
        SCALE: gl.constexpr,
        FMA: gl.constexpr,
        ONE_D: gl.constexpr,
        WEIGHTED: gl.constexpr,
    ):
        if ONE_D:
            rows, tile = _row(C)
        else:
            tile, rows, _ = _tile(R, C)
        x, m, s = gl.load(X + tile), gl.load(M + rows), gl.load(S + rows)
        if WEIGHTED:
            p = probs_from_pair(x, m, s, SCALE, FMA, gl.load(W + rows))
        else:
            p = probs_from_pair(x, m, s, SCALE, FMA)
        gl.store(PO + tile, p)


# --------------------------------------------------------------------------- inputs, references
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(huge: bool) -> torch.Tensor:
    """``[R, C]`` fp32 logits: random rows, a row of −inf, a row with some −inf, a row holding
    +inf (NaN probabilities, as torch's) and, with ``huge``, rows near ±1e4 (the subtraction
    before the scale keeps them exact in fp32)."""
    g = _gen()
    x = torch.randn(R, C, generator=g) * 3
    x[1] = -INF
    x[2, ::3] = -INF
    x[3, 5] = INF
    if huge:
        x[4] = 1e4 + torch.rand(C, generator=g)
        x[5] = -1e4 + torch.rand(C, generator=g)
    return x


def _f32(v: float) -> float:
    """``v`` as the fp32 constant a kernel holds."""
    return torch.tensor(v, dtype=torch.float32).item()


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().double()


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-30) -> None:
    # atol: exp2 flushes results below fp32's normal range to 0
    torch.testing.assert_close(_d(got), want, rtol=rtol, atol=atol, equal_nan=True)


def _needs_gluon() -> None:
    if not HAS_GLUON:
        pytest.skip(f"this Triton has no usable Gluon ({SG.GLUON_IMPORT_ERROR})")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the Gluon kernels run on sm_80+")


def _cuda(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous().cuda() for t in ts]


# --------------------------------------------------------------------------- GPU: each twin
@pytest.mark.gpu
@pytest.mark.parametrize(
    "units,shifted,huge", [(1.0, False, True), (LOG2E, False, False), (1.0, True, False)]
)
def test_gpu_online_update(units: float, shifted: bool, huge: bool) -> None:
    # the pair in exp2 units: stats.torch_online_update of (x·units + shift)·ln 2, m·ln 2
    _needs_gluon()
    g = _gen(1)
    x = _logits(huge)
    m = torch.randn(R, generator=g) * 3 + 1
    s = 1 + 4 * torch.rand(R, generator=g)
    m[:2], s[:2] = -INF, 0.0  # the identity, with a tile and with a row of −inf
    m[6] = 50.0  # above the whole tile: alpha = 1
    if huge:
        m[4] = 1e4 + 0.5
    shift = torch.randn(R, generator=g) if shifted else torch.zeros(R)
    out = [torch.empty(R, device="cuda") for _ in range(3)] + [torch.empty(R, C, device="cuda")]
    _online_update_kernel[(1,)](*_cuda(m, s, x, shift), *out, R, C, units, shifted)
    y = _d(x) * _f32(units) + (_d(shift)[:, None] if shifted else 0.0)
    m_ref, s_ref, a_ref, p_ref = stats.torch_online_update(_d(m) * LN2, _d(s), y * LN2)
    _close(out[0], m_ref / LN2, rtol=1e-6)
    for got, want in zip(out[1:], (s_ref, a_ref, p_ref), strict=True):
        _close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("one_d", [False, True], ids=["tile", "row"])
@pytest.mark.parametrize(
    "scale,fma,huge", [(LOG2E, False, True), (LOG2E, True, False), (1.0, False, True)]
)
def test_gpu_tile_stats(scale: float, fma: bool, huge: bool, one_d: bool) -> None:
    _needs_gluon()
    x = _logits(huge)
    k = _f32(scale) * LN2  # the exponent's factor in natural units
    out = [torch.empty(R, device="cuda"), torch.empty(R, device="cuda")]
    p = torch.empty(R, C, device="cuda")
    _tile_stats_kernel[(R if one_d else 1,)](*_cuda(x), *out, p, R, C, scale, fma, one_d)
    m_ref, s_ref = stats.torch_tile_stats(_d(x) * k)
    identity = torch.full((R,), -INF, dtype=torch.float64), torch.zeros(R, dtype=torch.float64)
    _close(out[0], m_ref / k, rtol=1e-6)
    _close(out[1], s_ref)
    _close(p, stats.torch_online_update(*identity, _d(x) * k)[3])


@pytest.mark.gpu
@pytest.mark.parametrize("one_d", [False, True], ids=["tile", "row"])
@pytest.mark.parametrize("scale", [LOG2E, 1.0])
def test_gpu_merge_partials(scale: float, one_d: bool) -> None:
    # against stats.merge folded over the partials, padding partials the identity (−inf, 0)
    _needs_gluon()
    g = _gen(2)
    m = torch.randn(R, C, generator=g) * 5
    m[4] = 1e4 + torch.rand(C, generator=g)
    s = 1 + 3 * torch.rand(R, C, generator=g)
    pad = torch.rand(R, C, generator=g) < 0.3
    m[pad], s[pad] = -INF, 0.0
    m[1], s[1] = -INF, 0.0  # nothing but identities: the identity
    m[3, 7], s[3, 7] = INF, 2.0  # a part holding +inf: the union's LSE is +inf
    out = [torch.empty(R, device="cuda"), torch.empty(R, device="cuda")]
    _merge_partials_kernel[(R if one_d else 1,)](*_cuda(m, s), *out, R, C, scale, one_d)
    k = _f32(scale) * LN2
    pairs = [(_d(m[:, j]) * k, _d(s[:, j])) for j in range(C)]
    m_ref, s_ref = reduce(lambda a, b: stats.merge(*a, *b), pairs)
    _close(out[0], m_ref / k, rtol=1e-6)
    _close(out[1], s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [LOG2E, 1.0])
def test_gpu_finalize_lse_and_rescale(scale: float) -> None:
    _needs_gluon()
    g = _gen(3)
    m = torch.randn(R, generator=g) * 5
    s = 1 + 10 * torch.rand(R, generator=g)
    m_new = torch.maximum(m, torch.randn(R, generator=g) * 5)
    m[0], s[0], m_new[0] = -INF, 0.0, -INF  # the identity: LSE −inf, rescale 0
    m[1], s[1], m_new[1] = INF, math.nan, INF  # +inf, whatever s is
    m[2], s[2], m_new[2] = INF, 1.0, INF
    m[3], m_new[3] = -INF, 2.0  # an empty sum moved onto a maximum: 0
    m[4], m_new[4] = 1e4 + 0.25, 1e4 + 1.5
    m[5], m_new[5] = -1e4, -1e4
    lse, r = torch.empty(R, device="cuda"), torch.empty(R, device="cuda")
    _rows_kernel[(1,)](*_cuda(m, m_new, s), lse, r, R, scale)
    k = _f32(scale * LN2)  # (finalize_lse's constexpr product: 1 for LOG2E)
    _close(lse, stats.torch_finalize_lse(_d(m) * k, _d(s)), rtol=1e-6, atol=1e-6)
    k = _f32(scale) * LN2
    _close(r, stats.torch_rescale(_d(m) * k, _d(m_new) * k))


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [LOG2E, 1.0])
def test_gpu_probs_from_lse_t(scale: float) -> None:
    # the transposed tile (keys × queries), one LSE per query; a query that saw nothing has
    # LSE −inf and gets 0, not NaN
    _needs_gluon()
    g = _gen(4)
    xt = torch.randn(R, C, generator=g) * 3
    xt[:, 2] = -INF
    k = _f32(scale) * LN2
    lse = torch.logsumexp(_d(xt) * k, 0).float()
    lse[5] += 1.0  # any LSE: its probabilities need not sum to 1
    out = [
        torch.empty(C, device="cuda"),
        torch.empty(R, C, device="cuda"),
        torch.empty(R, C, device="cuda"),
    ]
    _probs_from_lse_t_kernel[(1,)](*_cuda(xt, lse), *out, R, C, scale)
    assert torch.isinf(out[0][2]) and out[0][2] > 0
    _close(out[0], torch.where(_d(lse) == -INF, INF, _d(lse) * LOG2E), rtol=1e-6)
    want = stats.torch_probs_from_lse((_d(xt) * k).T, _d(lse)).T
    _close(out[1], want)
    _close(out[2], want)


@pytest.mark.gpu
@pytest.mark.parametrize("one_d", [False, True], ids=["tile", "row"])
@pytest.mark.parametrize(
    "scale,fma,huge,weighted",
    [(LOG2E, False, True, True), (LOG2E, True, False, True), (1.0, False, True, False)],
)
def test_gpu_probs_from_pair(
    scale: float, fma: bool, huge: bool, weighted: bool, one_d: bool
) -> None:
    # e^(x − lse)·w with lse = stats.torch_finalize_lse of the pair: a row of −inf (the
    # identity pair) gives 0, the +inf row NaN where torch's softmax has it
    _needs_gluon()
    x = _logits(huge)
    k = _f32(scale) * LN2
    m = x.amax(1)
    s = stats.torch_tile_stats(_d(x) * k)[1].float()
    w = 0.5 + torch.rand(R, generator=_gen(5)) if weighted else torch.ones(R)
    p = torch.empty(R, C, device="cuda")
    _probs_from_pair_kernel[(R if one_d else 1,)](
        *_cuda(x, m, s, w), p, R, C, scale, fma, one_d, weighted
    )
    lse = stats.torch_finalize_lse(_d(m) * k, _d(s))
    _close(p, stats.torch_probs_from_lse(_d(x) * k, lse) * _d(w)[:, None])
    assert (p[1] == 0).all()


# --------------------------------------------------------------------------- CPU: the module
def test_twins_are_named_after_stats_helpers() -> None:
    # every twin mirrors a @triton.jit helper of flashlite.stats (a private one: its name
    # without the underscore); without Gluon the module holds none
    # (a jitted function, or the interpreter's stand-in, keeps the Python function as .fn)
    assert set(SG.__all__) >= {"GLUON_IMPORT_ERROR", "TWINS"}
    for name in SG.TWINS:
        helper = getattr(stats, name if hasattr(stats, name) else "_" + name, None)
        assert helper.fn.__name__.lstrip("_") == name, name
        if HAS_GLUON:
            assert name in SG.__all__ and getattr(SG, name).fn.__name__ == name
        else:
            assert not hasattr(SG, name)


def test_gluon_kernels_take_their_statistics_from_the_twins() -> None:
    root = Path(__file__).parents[1] / "flashlite" / "kernels"
    # (the attention kernels' partitions live in their *_parts modules)
    for path in (
        "attention/hopper_parts.py",
        "attention/hopper_bwd_parts.py",
        "attention/hopper_bwd_consumer.py",
        "softmax_gluon.py",
        "cross_entropy_gluon.py",
    ):
        assert "from flashlite.stats_gluon import" in (root / path).read_text(), path


def test_imports_without_gluon() -> None:
    # a Triton without Gluon: the module (and the package) import, and say why there are no
    # twins
    code = (
        "import sys\n"
        "sys.modules['triton.experimental.gluon'] = None\n"
        "import flashlite\n"
        "from flashlite import stats_gluon as SG\n"
        "assert SG.GLUON_IMPORT_ERROR and 'gluon' in SG.GLUON_IMPORT_ERROR, SG.GLUON_IMPORT_ERROR\n"
        "assert SG.__all__ == ['GLUON_IMPORT_ERROR', 'TWINS'], SG.__all__\n"
        "assert not any(hasattr(SG, n) for n in SG.TWINS)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


_SM90_BUILD = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, sys.argv[1])
import test_stats_gluon as T

for name, consts in T.BUILDS:
    fn = getattr(T, name)
    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in consts else "*fp32" for n in names}
    src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print("built", name)
"""

#: The test kernels (one variant each way they are called) for the build on the CPU.
BUILDS = [
    ("_online_update_kernel", dict(R=R, C=C, UNITS=LOG2E, SHIFTED=True)),
    ("_tile_stats_kernel", dict(R=R, C=C, SCALE=LOG2E, FMA=True, ONE_D=False)),
    ("_tile_stats_kernel", dict(R=R, C=C, SCALE=LOG2E, FMA=False, ONE_D=True)),
    ("_merge_partials_kernel", dict(R=R, C=C, SCALE=LOG2E, ONE_D=False)),
    ("_merge_partials_kernel", dict(R=R, C=C, SCALE=1.0, ONE_D=True)),
    ("_rows_kernel", dict(R=R, SCALE=LOG2E)),
    ("_probs_from_lse_t_kernel", dict(R=R, C=C, SCALE=LOG2E)),
    ("_probs_from_pair_kernel", dict(R=R, C=C, SCALE=LOG2E, FMA=True, ONE_D=False, WEIGHTED=True)),
    ("_probs_from_pair_kernel", dict(R=R, C=C, SCALE=1.0, FMA=False, ONE_D=True, WEIGHTED=False)),
]


def test_twin_kernels_build_for_sm90() -> None:
    # No GPU needed: Triton compiles the test kernels, and so every twin, for sm_90a
    if not HAS_GLUON:
        pytest.skip(f"this Triton has no usable Gluon ({SG.GLUON_IMPORT_ERROR})")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    cmd = [sys.executable, "-c", _SM90_BUILD, str(Path(__file__).parent)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("built") == len(BUILDS), done.stdout
