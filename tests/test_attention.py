"""flashlite.attention against an fp64 reference.

Rule (flash-attn's): the error of our output against the fp64 reference must stay within 2x the
error of PyTorch's own math attention in the same low precision, plus a small absolute floor.
On CPU the kernel runs in Triton's interpreter with a pinned 16x16 tile (``CPU_CONFIG``), so
lengths of 17, 100, 130 cover full tiles, partial tiles and several tiles per sequence.
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import DTYPES, assert_close_to_reference, rand
from conftest import TOL, maybe_compile

import flashlite
from flashlite.kernels.configs import (
    CPU_CONFIG,
    GPU_CONFIGS,
    HOPPER_CONFIGS,
    PIN_ENV,
    Config,
    as_triton_config,
    pinned_config,
)
from flashlite.masking.masks import CAUSAL, describe
from flashlite.ops.attention import (
    Request,
    attention_fwd,
)
from flashlite.reference import attention as ref_attention

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
