"""flashlite.attention against an fp64 reference.

Rule (flash-attn's): the error of our output against the fp64 reference must stay within 2x the
error of PyTorch's own math attention in the same low precision, plus a small absolute floor.
On CPU the kernel runs in Triton's interpreter with a pinned 16x16 tile (``CPU_CONFIG``), so
lengths of 17, 100, 130 cover full tiles, partial tiles and several tiles per sequence.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
from conftest import TOL, maybe_compile

import flashlite
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.configs import (
    CPU_CONFIG,
    GPU_CONFIGS,
    HOPPER_CONFIGS,
    PIN_ENV,
    Config,
    as_triton_config,
    default_config,
    keep_config,
    pinned_config,
)
from flashlite.masking.masks import CAUSAL, describe, torch_visible
from flashlite.ops.attention import (
    HOPPER_ENV,
    Request,
    attention_fwd,
    empty_output,
    hopper_config,
)
from flashlite.ops.attention.backends import hopper as HP
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


# --------------------------------------------------------------------------- lengths and masks
LENGTHS = [
    (1, 1),  # one query, one key: a single partial tile
    (17, 17),  # one full tile + a 1-row/1-key tail
    (100, 130),  # several tiles, Nq < Nk: causal diagonal offset by 30
    (130, 100),  # Nq > Nk: with causal the first 30 rows see no key (output 0, LSE -inf)
    (1, 130),  # decoding-like: one query against a long cache
    (130, 1),
]


# every length eager; compiled (dynamic shapes, ~5 s each in CI) for the two ragged ones
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("nq", "nk", "use_compile"),
    [*((nq, nk, False) for nq, nk in LENGTHS), (100, 130, True), (130, 100, True)],
    ids=lambda v: ("compiled" if v else "eager") if isinstance(v, bool) else str(v),
)
def test_lengths(nq: int, nk: int, causal: bool, use_compile: bool) -> None:
    q, k, v = rand(1, 4, nq, 64), rand(1, 2, nk, 64), rand(1, 2, nk, 64)
    out, lse = maybe_compile(flashlite.attention, use_compile)(
        q, k, v, causal=causal, return_lse=True
    )
    assert_close_to_reference(out, q, k, v, causal, lse=lse)


@pytest.mark.parametrize("d", [1, 16, 40, 59, 64, 80, 111, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims(d: int, dtype: torch.dtype, use_compile: bool) -> None:
    # every D from 1 to 256 works: D is padded to a power of two >= 16 on chip and masked
    q, k, v = (
        rand(1, 2, 33, d, dtype=dtype),
        rand(1, 2, 20, d, dtype=dtype),
        rand(1, 2, 20, d, dtype=dtype),
    )
    out = maybe_compile(flashlite.attention, use_compile)(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_desc", [False, True], ids=["pointers", "descriptors"])
def test_dtypes_and_load_paths(dtype: torch.dtype, use_desc: bool) -> None:
    # both load paths of the kernel: tensor descriptors (TMA on a GPU) and masked pointers
    q, k, v = (
        rand(2, 2, 45, 32, dtype=dtype),
        rand(2, 2, 37, 32, dtype=dtype),
        rand(2, 2, 37, 32, dtype=dtype),
    )
    for causal in (False, True):
        out, lse, info = attention_fwd(
            q, k, v, Request.of_mask(describe(causal), 32**-0.5), use_desc=use_desc
        )
        assert info is not None and info.use_desc == use_desc
        assert_close_to_reference(out, q, k, v, causal, lse=lse)


#: the kernel's loop variants, each on the interpreter's tile (they must all agree)
VARIANTS = {
    "eager": CPU_CONFIG,
    "lazy": CPU_CONFIG._replace(lazy_rescale=True),
    "overlap": CPU_CONFIG._replace(overlap=True),
    "lazy-overlap": CPU_CONFIG._replace(lazy_rescale=True, overlap=True),
}


# each variant in one dtype, every dtype covered (the product took 33 s of CI)
@pytest.mark.parametrize(
    ("variant", "dtype"), [(v, DTYPES[i % len(DTYPES)]) for i, v in enumerate(VARIANTS)], ids=str
)
def test_loop_variants(variant: str, dtype: torch.dtype) -> None:
    # lazy: the accumulator is rescaled only on tiles that move a row's reference maximum;
    # growing scores (a ramp along the keys) make the reference move on most tiles.
    # overlap: tile j's p·v is issued after tile j+1's scores, a prologue and an epilogue
    # around the loop; lengths cover no full tile (nk < 16), exactly one and two full tiles,
    # partial tails, and causal rows that see no key.
    cfg = VARIANTS[variant]
    for nq, nk in [(40, 70), (70, 40), (1, 33), (32, 32), (17, 16), (5, 9)]:
        q, k, v = (rand(1, 2, n, 32, dtype=dtype) for n in (nq, nk, nk))
        k = k + torch.linspace(0, 3, nk).to(k.dtype)[:, None]
        for causal in (False, True):
            out, lse, info = attention_fwd(
                q, k, v, Request.of_mask(describe(causal), 32**-0.5), config=cfg
            )
            assert info is not None
            assert (info.config.lazy_rescale, info.config.overlap) == cfg[5:]
            assert_close_to_reference(out, q, k, v, causal, lse=lse)


def test_configs_round_trip_through_the_autotuner_form() -> None:
    # the autotuner holds triton.Configs; Config.of must give back the config they came from
    for cfg in [*GPU_CONFIGS, *HOPPER_CONFIGS.values(), *VARIANTS.values()]:
        assert Config.of(as_triton_config(cfg)) == cfg


def test_pinned_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIN_ENV, "16,32,4,1,0,1,1")
    assert pinned_config() == Config(16, 32, 4, 1, False, True, True)
    monkeypatch.setenv(PIN_ENV, "16,32,4,1")
    assert pinned_config() == Config(16, 32, 4, 1)
    q = rand(1, 2, 40, 32)
    out, _, info = attention_fwd(q, q, q, Request.of_mask(CAUSAL, 32**-0.5))
    assert info is not None and (info.config.block_m, info.config.block_n) == (16, 32)
    assert_close_to_reference(out, q, q, q, True)
    monkeypatch.setenv(PIN_ENV, "16,32")
    with pytest.raises(ValueError, match=PIN_ENV):
        pinned_config()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
def test_gqa_mqa(hq: int, hkv: int, use_compile: bool) -> None:
    q, k, v = rand(2, hq, 19, 32), rand(2, hkv, 23, 32), rand(2, hkv, 23, 32)
    out = maybe_compile(flashlite.attention, use_compile)(q, k, v, causal=True)
    assert_close_to_reference(out, q, k, v, True)


def test_custom_scale_and_lse_against_logsumexp(use_compile: bool) -> None:
    q, k, v = (
        rand(1, 2, 20, 16, dtype=torch.float32),
        rand(1, 2, 28, 16, dtype=torch.float32),
        rand(1, 2, 28, 16, dtype=torch.float32),
    )
    out, lse = maybe_compile(flashlite.attention, use_compile)(q, k, v, scale=0.3, return_lse=True)
    assert_close_to_reference(out, q, k, v, False, 0.3, lse=lse)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.3
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_give_zero_and_neg_inf(use_compile: bool) -> None:
    # causal with Nq = 40 > Nk = 8: rows i < 32 see no key (j <= i - 32)
    q, k, v = rand(1, 1, 40, 16), rand(1, 1, 8, 16), rand(1, 1, 8, 16)
    out, lse = maybe_compile(flashlite.attention, use_compile)(
        q, k, v, causal=True, return_lse=True
    )
    assert (out[0, 0, :32] == 0).all() and torch.isneginf(lse[0, 0, :32]).all()
    assert torch.isfinite(lse[0, 0, 32:]).all()
    assert_close_to_reference(out, q, k, v, True, lse=lse)


def test_large_scores_do_not_overflow() -> None:
    q, k, v = rand(1, 1, 24, 32) * 30, rand(1, 1, 24, 32) * 30, rand(1, 1, 24, 32)
    assert_close_to_reference(flashlite.attention(q, k, v), q, k, v)


# --------------------------------------------------------------------------- layouts and strides
def test_layout_b_n_h_d_reads_packed_qkv_without_copies(use_compile: bool) -> None:
    b, n, h, d = 2, 21, 4, 32
    qkv = rand(b, n, 3, h, d)  # a packed projection output, as flash-attn's qkvpacked API takes
    q, k, v = qkv.unbind(2)  # strided views, no copies
    out = maybe_compile(flashlite.attention, use_compile)(q, k, v, layout="b n h d", causal=True)
    assert out.shape == (b, n, h, d)
    expect = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), True, upcast=True)
    torch_lp = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), True)
    err = (out.transpose(1, 2).double() - expect).abs().max().item()
    assert err <= 2 * (torch_lp.double() - expect).abs().max().item() + TOL[torch.float16].floor


def test_non_contiguous_strides(use_compile: bool) -> None:
    # head dim strided (not unit stride) and sequence sliced with a step
    base = rand(1, 2, 64, 80)
    q = base[:, :, ::2, ::2]  # (1, 2, 32, 40), stride 2 along D
    k = rand(1, 2, 40, 29).transpose(-1, -2)  # (1, 2, 29, 40), D has stride 29
    v = rand(1, 2, 29, 40)
    assert not q.is_contiguous() and not k.is_contiguous()
    assert_close_to_reference(maybe_compile(flashlite.attention, use_compile)(q, k, v), q, k, v)


def test_empty_inputs() -> None:
    q, k = rand(0, 2, 5, 16), rand(0, 2, 5, 16)
    assert flashlite.attention(q, k, k).shape == (0, 2, 5, 16)
    q = rand(1, 2, 0, 16)
    assert flashlite.attention(q, rand(1, 2, 3, 16), rand(1, 2, 3, 16)).shape == (1, 2, 0, 16)


# --------------------------------------------------------------------------- bad input
def _bad(q_shape, k_shape, v_shape=None, dtype=torch.float16, k_dtype=None):
    v_shape = v_shape or k_shape
    return (
        rand(*q_shape, dtype=dtype),
        rand(*k_shape, dtype=k_dtype or dtype),
        rand(*v_shape, dtype=dtype),
    )


S = (1, 2, 5, 16)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: _bad((2, 5, 16), S), ValueError, "q must have 4"),
        (lambda: _bad(S, (2, 2, 5, 16)), ValueError, "batch"),
        (lambda: _bad((1, 3, 5, 16), S), ValueError, "multiple"),
        (lambda: _bad(S, S, (1, 2, 6, 16)), ValueError, "same shape"),
        (lambda: _bad(S, (1, 2, 5, 8)), ValueError, "head dim"),
        (lambda: _bad((1, 2, 5, 300), (1, 2, 5, 300)), NotImplementedError, "1 to 256"),
        (lambda: _bad(S, S, k_dtype=torch.float32), TypeError, "one dtype"),
        (lambda: _bad(S, S, dtype=torch.float64), TypeError, "dtype"),
        (lambda: (rand(*S).int(),) * 3, TypeError, "dtype"),
        (lambda: ([1.0], rand(*S), rand(*S)), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input(make, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        flashlite.attention(*make())


def test_bad_layout_and_scale() -> None:
    q = rand(1, 2, 5, 16)
    with pytest.raises(ValueError, match="layout"):
        flashlite.attention(q, q, q, layout="b d n h")
    with pytest.raises(ValueError, match="scale"):
        flashlite.attention(q, q, q, scale=-1.0)
    with pytest.raises(TypeError, match="scale"):
        flashlite.attention(q, q, q, scale="0.1")
    # the wrong rank in the other layout: the same ValueError, not an error from a transpose
    for bad in (rand(5), rand(2, 5, 16)):
        with pytest.raises(ValueError, match=r"q must have 4 dimensions \(b n h d\)"):
            flashlite.attention(bad, q, q, layout="b n h d")


# --------------------------------------------------------------------------- GPU (compiled kernels)
def _rows_reference(q, k, v, causal, rows):
    """fp64 reference for a subset of query rows (long sequences: the full matrix is huge)."""
    nq, nk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = (q[:, :, rows].double() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch_visible(nq, nk, True, rows=rows), -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d,hq,hkv", [
    (4096, 4096, 128, 16, 16),  # the benchmark shape family, autotuned
    (16384, 16384, 64, 4, 2),  # long, GQA
    (1000, 3001, 111, 4, 1),  # odd lengths, odd head dim (pointer loads), MQA
    (3001, 1000, 59, 2, 2),  # Nq > Nk: fully masked rows when causal
    (777, 777, 256, 2, 2),  # largest head dim
])  # fmt: skip
def test_gpu_long(dtype, causal, nq, nk, d, hq, hkv) -> None:
    q = rand(1, hq, nq, d, dtype=dtype, device="cuda")
    k, v = (
        rand(1, hkv, nk, d, dtype=dtype, device="cuda"),
        rand(1, hkv, nk, d, dtype=dtype, device="cuda"),
    )
    if (nq, d) == (4096, 128) and dtype != torch.float32:
        out, lse = flashlite.attention(q, k, v, causal=causal, return_lse=True)  # autotuned
    else:  # one fitting config: autotuning every specialisation here would cost minutes
        cfg = default_config(max(16, triton.next_power_of_2(d)), q.element_size(), False)
        out, lse, _ = attention_fwd(q, k, v, Request.of_mask(describe(causal), d**-0.5), config=cfg)
    assert torch.isfinite(out).all() and out.dtype == dtype
    assert torch.isfinite(lse[:, :, max(0, nq - nk) :]).all()
    rows = torch.unique(
        torch.cat([torch.arange(0, nq, max(1, nq // 97)), torch.tensor([nq - 1])])
    ).cuda()
    ref = _rows_reference(q, k, v, causal, rows)
    err = (out[:, :, rows].double() - ref).abs().max().item()
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert err <= tol, err


@pytest.mark.gpu
def test_gpu_every_config_is_correct() -> None:
    # Triton has returned NaN for some warp-specialised configs: every config must be right
    for causal in (False, True):
        for d in (64, 128):
            q, k, v = (rand(2, 4, 1500, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            rows = torch.arange(0, 1500, 7, device="cuda")
            ref = _rows_reference(q, k, v, causal, rows)
            for cfg in dict.fromkeys([*GPU_CONFIGS, *HOPPER_CONFIGS.values()]):
                if not keep_config(cfg, d, 2, True):
                    continue
                out = attention_fwd(
                    q, k, v, Request.of_mask(describe(causal), d**-0.5), config=cfg
                )[0]
                err = (out[:, :, rows].double() - ref).abs().max().item()
                assert err < 3e-2, (cfg, d, causal, err)


@pytest.mark.gpu
def test_gpu_hopper_runs_the_measured_configs(monkeypatch) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("HOPPER_CONFIGS apply to sm_90 only")
    monkeypatch.setenv(HOPPER_ENV, "0")  # the Triton kernel's table (D=128 runs Gluon otherwise)
    for (block_d, causal), cfg in HOPPER_CONFIGS.items():
        q, k, v = (rand(1, 2, 300, block_d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        # descriptor loads: the table serves problems past DESC_MIN_WORK
        out, lse, info = attention_fwd(
            q, k, v, Request.of_mask(describe(causal), block_d**-0.5), use_desc=True
        )
        assert info is not None
        c = info.config
        assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == cfg[:4]
        assert (c.lazy_rescale, c.overlap) == cfg[5:]
        assert_close_to_reference(out.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, lse=lse.cpu())


@pytest.mark.gpu
def test_gpu_cpu_tensors_still_work_on_a_cuda_machine() -> None:
    # CPU tensors go to the GPU and back (same strides: slices of one packed qkv buffer too)
    qkv = rand(1, 20, 3, 2, 16)
    q, k, v = qkv.unbind(2)
    out = flashlite.attention(q, k, v, layout="b n h d", causal=True)
    assert out.device.type == "cpu"
    assert_close_to_reference(*(t.transpose(1, 2) for t in (out, q, k, v)), True)
    x = torch.randn(3, 1000)
    torch.testing.assert_close(flashlite.softmax(x), torch.softmax(x, -1))
    # and compiling for the GPU still works afterwards (a leaked interpreter patch broke it)
    qc = rand(1, 2, 20, 48, device="cuda")
    assert_close_to_reference(flashlite.attention(qc, qc, qc).cpu(), *(qc.cpu(),) * 3)


# --------------------------------------------------------------------------- Hopper (Gluon) kernel
def test_hopper_kernel_is_only_chosen_where_it_runs(monkeypatch) -> None:
    # CPU tensors, fp32 and head dims without a measured entry keep the Triton kernel
    assert hopper_config(rand(1, 1, 8, 128), 8) is None
    if torch.cuda.is_available():
        assert hopper_config(rand(1, 1, 8, 128, dtype=torch.float32, device="cuda"), 8) is None
        assert hopper_config(rand(1, 1, 8, 96, device="cuda"), 8) is None  # no measured entry
        if torch.cuda.get_device_capability()[0] == 9 and KH.available():
            assert hopper_config(rand(1, 1, 8, 64, device="cuda"), 4096) is not None
            assert hopper_config(rand(1, 1, 8, 64, device="cuda"), 4095) is None  # min_keys
        monkeypatch.setenv(HOPPER_ENV, "0")
        assert hopper_config(rand(1, 1, 8, 128, device="cuda"), 8) is None


def test_hopper_kernel_that_fails_to_build_falls_back(monkeypatch) -> None:
    # a Triton whose Gluon differs: one warning, then the Triton kernel gives the answer
    import flashlite.ops.attention.fwd as ops

    def broken(*args, **kwargs):
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    monkeypatch.setattr(ops.planner, "hopper_config", lambda q, n: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(ops.hopper, "plan_fwd_hopper", broken)
    monkeypatch.setattr(ops.hopper, "fwd_failed", set())
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="Hopper attention kernel failed to build"):
        out, lse, info = attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25), use_desc=True)
    assert not info.config.warp_specialize
    assert_close_to_reference(out, q, k, v, True, 0.25, lse=lse)
    out2, _, _ = attention_fwd(
        q, k, v, Request.of_mask(CAUSAL, 0.25), use_desc=True
    )  # no second warning
    assert torch.equal(out, out2)


_SM90_BUILD = """
import os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from flashlite.kernels.attention import hopper as H
from flashlite.ops.attention.backends import common_gluon as CG
from flashlite.ops.attention.backends import hopper as HP

d, causal = int(sys.argv[1]), sys.argv[2] == "1"
cfg = H.CONFIGS[d]
x = torch.empty(2, 4, 256, d, dtype=torch.bfloat16)
fn = H._attention_fwd_hopper_kernel
names = list(fn.arg_names)
rows = (cfg.block_m // 2, cfg.block_n, cfg.block_n, cfg.block_m // 2)
sig = {n: mangle_type(CG.descriptor(x, r)) for n, r in zip(names[:4], rows)}
sig.update(LSE="*fp32", SINKS="*fp32", n_heads="i32", group="i32", seq_q="i32", seq_k="i32",
           sm_scale="fp32")
consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, IS_CAUSAL=causal,
              HAS_SINKS=sys.argv[4] == "1", ALIBI=False)
tables = names[names.index("KV_NUM"):names.index("MB0")]
buffers = names[names.index("MB0"):names.index("SB3") + 1]
if sys.argv[5] == "1":  # block tables and a causal mask function (flex_attention's call)
    from flashlite.masking import gallery
    mask = gallery.causal()
    sig.update({n: ("*i32" if n.isupper() else "i32") for n in tables})
    sig.update(dict.fromkeys(buffers, "i32"))
    consts.update(LISTED=True, MASK_MOD=mask.fn, N_MASK_BUF=0, SCORE_MOD=mask.fn,
                  N_SCORE_BUF=0, HAS_SCORE=False)
elif sys.argv[5] == "2":  # a document-causal mask and ALiBi
    from flashlite.masking import gallery
    mask = gallery.document_causal(torch.zeros(1, 256, dtype=torch.int32))
    score = gallery.alibi(gallery.alibi_slopes(4))
    sig.update({n: ("*i32" if n.isupper() else "i32") for n in tables})
    sig.update(dict(zip(buffers, ["*i32", "i32", "i32", "i32", "*fp32", "i32", "i32", "i32"])))
    consts.update(LISTED=True, MASK_MOD=mask.fn, N_MASK_BUF=2, SCORE_MOD=score.fn,
                  N_SCORE_BUF=1, HAS_SCORE=True, ALIBI=True)  # (the plan recognises it)
else:  # the plain forward: placeholders (plan_fwd_hopper's zeros)
    sig.update(dict.fromkeys(tables + buffers, "i32"))
    consts.update(LISTED=False, MASK_MOD=None, N_MASK_BUF=0, SCORE_MOD=None, N_SCORE_BUF=0,
                  HAS_SCORE=False)
sig.update(dict.fromkeys(consts, "constexpr"))
src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
from triton.backends.nvidia.compiler import get_ptxas

ptxas = get_ptxas(90).path  # the ptxas Triton itself builds sm_90 code with
path = os.path.join(sys.argv[3], "k.ptx")
open(path, "w").write(k.asm["ptx"])
out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                     capture_output=True, text=True)
print("SHARED", k.metadata.shared)
print(out.stdout + out.stderr)
"""


@pytest.mark.parametrize(
    "d,causal,sinks,listed",
    [(128, True, False, 0), (64, False, False, 0), (128, True, True, 0), (128, False, False, 1),
     (128, False, False, 2)],
)  # fmt: skip
def test_hopper_kernel_builds_for_sm90_without_spills_or_serialised_wgmma(
    d, causal, sinks, listed, tmp_path
):
    # No GPU needed: Triton compiles the Gluon kernel for sm_90a and its ptxas reports. A code
    # change that breaks the build, spills, outgrows shared memory or makes ptxas serialise the
    # async products (warning C7513/C7514: the overlap this kernel exists for) fails here.
    if not KH.available():
        pytest.skip(f"this Triton has no usable Gluon ({KH.GLUON_IMPORT_ERROR})")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    cmd = [
        sys.executable,
        "-c",
        _SM90_BUILD,
        str(d),
        str(int(causal)),
        str(tmp_path),
        str(int(sinks)),
        str(listed),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout
    if listed != 2:  # (mods that hold index tiles may spill a little: measured, not gated)
        assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "C7513" not in report and "C7514" not in report, report
    shared = int(report.split("SHARED", 1)[1].split()[0])
    assert shared <= 227 * 1024, shared  # an sm_90 block's most


def test_hopper_kernel_only_takes_plain_forwards(monkeypatch) -> None:
    # windows, soft caps, per-batch lengths, packed sequences, pinned configs and pointer loads
    # never take the dense Gluon kernel (a default window call takes flex's Hopper kernels
    # instead, where they apply: the tables backend, tested in test_flex.py)
    import flashlite.ops.attention.fwd as ops

    calls = []
    monkeypatch.setattr(ops.planner, "hopper_config", lambda q, n: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(ops.hopper, "run_fwd", lambda *a: calls.append(a) or False)
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    seqlens = torch.tensor([30], dtype=torch.int32)
    for mask, kwargs in ((describe(True, (8, 0)), {}), (describe(True, None, 5.0), {}),
                         (CAUSAL, {"seqlens_k": seqlens}),
                         (CAUSAL, {"config": Config(16, 16, 4, 1)}), (CAUSAL, {"use_desc": False}),
                         (CAUSAL, {"prescale_q": False})):  # fmt: skip
        fields = {n: kwargs.pop(n) for n in list(kwargs) if n in Request._fields}
        attention_fwd(
            q, k, v, Request.of_mask(mask, 0.25, **fields), **({"use_desc": True} | kwargs)
        )
    assert calls == []
    attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25), use_desc=True)  # a plain one asks for it
    assert len(calls) == 1


def _needs_gluon_hopper() -> None:
    if torch.cuda.get_device_capability()[0] != 9 or not KH.available():
        pytest.skip(f"the Gluon kernel runs on sm_90 with Gluon ({KH.GLUON_IMPORT_ERROR})")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", sorted(KH.CONFIGS))
@pytest.mark.parametrize("nq,nk,hq,hkv,layout", [
    (4096, 4096, 8, 8, "b h n d"),  # the benchmark's family
    (1000, 3001, 4, 1, "b h n d"),  # odd lengths (partial tiles, TMA zero padding), MQA
    (3001, 1000, 4, 2, "b h n d"),  # Nq > Nk: causal rows that see no key
    (129, 129, 2, 2, "b n h d"),  # transformers' layout (strided heads), one row past a block
    (1, 4000, 2, 2, "b h n d"),  # one query row
])  # fmt: skip
def test_gpu_hopper_kernel(dtype, causal, d, nq, nk, hq, hkv, layout) -> None:
    _needs_gluon_hopper()
    shape = (lambda h, n: (2, h, n, d)) if layout == "b h n d" else (lambda h, n: (2, n, h, d))
    q = rand(*shape(hq, nq), dtype=dtype, device="cuda")
    k, v = (rand(*shape(hkv, nk), dtype=dtype, device="cuda") for _ in range(2))
    views = [t if layout == "b h n d" else t.transpose(1, 2) for t in (q, k, v)]
    # the kernel itself at every length (the front-end sends D=64 below 4096 keys to Triton)
    out = empty_output(views[0])
    lse = views[0].new_empty(views[0].shape[:3], dtype=torch.float32)
    HP.plan_fwd_hopper(views[0], views[1], causal, d**-0.5, KH.CONFIGS[d])(*views, out, lse)
    assert out.stride() == views[0].stride()  # O keeps q's layout
    if hopper_config(views[0], nk) is not None:  # and the front-end runs it
        out2, lse2, info = attention_fwd(
            *views, Request.of_mask(describe(causal), d**-0.5), use_desc=True
        )
        assert info.config.warp_specialize and info.config.block_m == 128, info
        assert torch.equal(out2, out) and torch.equal(lse2, lse)
    if nq * nk <= 4_000_000:  # the whole fp64 reference
        assert_close_to_reference(*(t.cpu() for t in (out, *views)), causal, lse=lse.cpu())
    else:
        rows = torch.arange(0, nq, 13, device="cuda")
        err = (out[:, :, rows].double() - _rows_reference(*views, causal, rows)).abs().max()
        assert err <= {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper_kernel_trains_like_the_triton_kernel(monkeypatch, causal) -> None:
    # the backward recomputes scores from the saved LSE: it must match what Gluon saved
    _needs_gluon_hopper()
    q, k, v = (rand(2, 4, 1200, 128, dtype=torch.bfloat16, device="cuda").requires_grad_()
               for _ in range(3))  # fmt: skip
    assert hopper_config(q, 1200) is not None and q.numel() * 1200 >= 1 << 30  # past DESC_MIN_WORK
    dy = torch.randn_like(q)
    grads = []
    for env in ("1", "0"):
        monkeypatch.setenv(HOPPER_ENV, env)
        out = flashlite.attention(q, k, v, causal=causal)
        grads.append((out, *torch.autograd.grad(out, (q, k, v), dy)))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        err = (got.float() - want.float()).abs().max()
        assert err <= 2e-2 * want.float().abs().max(), err


@pytest.mark.gpu
def test_gpu_hopper_kernel_through_the_custom_op() -> None:
    # the Gluon forward runs inside flashlite::attention_fwd: its output must match the op's
    # fake (opcheck) and torch.compile(fullgraph=True) must trace and run it
    _needs_gluon_hopper()
    q = rand(1, 8, 1024, 128, dtype=torch.bfloat16, device="cuda")  # 2^30 multiply-adds
    k, v = (rand(1, 4, 1024, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert hopper_config(q, 1024) is not None
    # opcheck runs the backward eagerly and through AOTDispatcher and compares the gradients;
    # the fused Hopper backward sums dQ with atomics in no fixed order (they differed here), so
    # the deterministic Triton backward runs for it (the forward is still the Hopper kernel)
    was, warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.library.opcheck(
            torch.ops.flashlite.attention_fwd.default,
            (q.requires_grad_(), k, v),
            {"causal": True, "scale": 0.125},
        )
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
    eager = flashlite.attention(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: flashlite.attention(a, b, c, causal=True),
                             fullgraph=True)  # fmt: skip
    assert torch.equal(compiled(q, k, v), eager)
