"""Absorbed multi-head latent attention for decoding (:func:`flashlite.attention_mla_decode`):
one latent cache whose first columns are the values, against fp64 attention over it, against the
non-absorbed computation (per-head keys and values made up from the latent through explicit
up-projections), paged and split, with new latents appended in place."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, maybe_compile
from torch.library import opcheck

import flashlite

# small DeepSeek shapes for the interpreter: 32 value columns + 16 rotary (the real: 512 + 64)
DL, DR = 32, 16
D = DL + DR


def _reference(q, latent, lens, n_new, scale, causal=True, dtype=torch.float64):  # noqa: ANN001, ANN202
    """Absorbed attention of batch rows in ``dtype`` (fp64: the reference; the inputs' own:
    torch's low-precision error): ``(B, Nq, Hq, DL)`` and the LSE ``(B, Hq, Nq)``."""
    outs, lses = [], []
    nq = q.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b]) + n_new
        kv = latent[b, :n, 0].to(dtype)
        s = torch.einsum("qhd,kd->hqk", q[b].to(dtype), kv) * scale
        if causal:
            pos = torch.arange(nq)[:, None] + n - nq
            s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.softmax(s, -1).nan_to_num(0.0) @ kv[:, :DL]).transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("splits", [1, 3])
def test_against_fp64(dtype: torch.dtype, paged: bool, splits: int) -> None:
    b, nq, hq, cap = 2, 2, 8, 96
    q = torch.randn(b, nq, hq, D, dtype=dtype)
    latent = torch.randn(b, cap, 1, D, dtype=dtype)
    new = torch.randn(b, nq, 1, D, dtype=dtype)
    lens = torch.tensor([29, 77], dtype=torch.int32)  # (not tile multiples)
    cache, table = latent.clone(), None
    if paged:  # pages of 32, shuffled
        table = torch.tensor([[2, 0, 5], [4, 1, 3]], dtype=torch.int32)
        cache = torch.empty(6, 32, 1, D, dtype=dtype)
        for i in range(b):
            for j in range(3):
                cache[table[i, j]] = latent[i, 32 * j : 32 * j + 32]
    out, lse = flashlite.attention_mla_decode(
        q, cache, cache_seqlens=lens, scale=0.3, head_dim_v=DL, latent_new=new,
        block_table=table, num_splits=splits, return_lse=True,
    )  # fmt: skip
    if paged:  # back to one row per batch, to check the append and the reference
        cache = torch.stack([cache[table[i]].reshape(96, 1, D) for i in range(b)])
    for i in range(b):
        n = int(lens[i])
        assert torch.equal(cache[i, n : n + nq], new[i])  # appended in place
    want, want_lse = _reference(q, cache, lens, nq, 0.3)
    assert out.shape == (b, nq, hq, DL) and out.dtype == dtype
    low, _ = _reference(q, cache, lens, nq, 0.3, dtype=dtype)  # torch in the inputs' dtype
    torch_err = (low.double() - want).abs().max().item()
    assert (out.double() - want).abs().max() <= 2 * torch_err + TOL[dtype].floor
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)


def test_equals_the_non_absorbed_computation() -> None:
    """Per-head keys ``[c·W_uk ; k_pe]`` and values ``c·W_uv`` made up from the latent through
    explicit up-projections, attended per head, give the absorbed result (its queries
    ``q_nope·W_ukᵀ``), with the values' up-projection applied after: to bf16 precision."""
    b, hq, cap, d_nope, d_v = 2, 4, 64, 24, 16
    lens = torch.tensor([40, 63], dtype=torch.int32)
    latent = torch.randn(b, cap, 1, D)
    w_uk = torch.randn(hq, DL, d_nope) / DL**0.5  # latent -> each head's key (nope part)
    w_uv = torch.randn(hq, DL, d_v) / DL**0.5  # latent -> each head's value
    q_nope, q_pe = torch.randn(b, 1, hq, d_nope), torch.randn(b, 1, hq, DR)
    scale = (d_nope + DR) ** -0.5
    # non-absorbed: per-head K (B, Hq, N, d_nope + DR) and V (B, Hq, N, d_v), bf16
    c, k_pe = latent[:, :, 0, :DL], latent[:, :, 0, DL:]
    k = torch.cat([torch.einsum("bnl,hld->bhnd", c, w_uk),
                   k_pe[:, None].expand(b, hq, cap, DR)], -1)  # fmt: skip
    v = torch.einsum("bnl,hld->bhnd", c, w_uv)
    qh = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
    want = flashlite.attention(
        *(x.to(torch.bfloat16) for x in (qh, k, v)), seqlens_k=lens, scale=scale, causal=True
    )
    # absorbed: q' = [q_nope·W_ukᵀ ; q_pe] against the latent, then the values' up-projection
    q_abs = torch.cat([torch.einsum("bqhd,hld->bqhl", q_nope, w_uk), q_pe], -1)
    out = flashlite.attention_mla_decode(
        q_abs.to(torch.bfloat16), latent.to(torch.bfloat16), cache_seqlens=lens - 1,
        scale=scale, head_dim_v=DL, latent_new=latent[torch.arange(b), lens - 1, None].to(
            torch.bfloat16),
    )  # fmt: skip
    got = torch.einsum("bqhl,hld->bhqd", out.float(), w_uv)
    torch.testing.assert_close(got, want.float(), atol=3e-2, rtol=3e-2)


def test_compiled_and_opcheck() -> None:
    q = torch.randn(1, 1, 4, D)
    latent = torch.randn(1, 32, 1, D)
    lens = torch.tensor([20], dtype=torch.int32)

    def step(q, latent, lens):  # noqa: ANN001, ANN202
        return flashlite.attention_mla_decode(q, latent, cache_seqlens=lens, scale=0.2,
                                              head_dim_v=DL)  # fmt: skip

    torch.testing.assert_close(maybe_compile(step, True)(q, latent, lens), step(q, latent, lens))
    fields = {"cache_seqlens": lens, "causal": True, "scale": 0.2, "validate": "off",
              "head_dim_v": DL}  # fmt: skip
    opcheck(torch.ops.flashlite.attention_mla_decode.default, (q, latent, None), fields)


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"head_dim_v": D}, ValueError, "must be wider than head_dim_v"),
        ({"head_dim_v": 24}, ValueError, "power of two"),
        ({"latent": torch.randn(1, 32, 2, D)}, ValueError, "one latent head"),
        ({"latent": torch.randn(32, 1, D)}, ValueError, "must have 4 dimensions"),
        ({"q": torch.randn(1, 4, D)}, ValueError, "must have 4 dimensions"),
        ({"scale": None}, TypeError, "scale must be a positive number"),
        ({"lens": torch.tensor([3])}, TypeError, "cache_seqlens must have dtype torch.int32"),
        ({"latent": torch.randn(1, 32, 1, D, dtype=torch.float64)}, TypeError, "dtype"),
    ],
    ids=["narrow_cache", "not_pow2", "heads", "cache_rank", "q_rank", "scale", "lens", "dtype"],
)
def test_bad_input(change: dict, error: type, words: str) -> None:
    args = {
        "q": torch.randn(1, 1, 4, D),
        "latent": torch.randn(1, 32, 1, D),
        "lens": torch.tensor([3], dtype=torch.int32),
        "scale": 0.2,
        "head_dim_v": DL,
    }
    args |= change  # fmt: skip
    with pytest.raises(error, match=words):
        flashlite.attention_mla_decode(
            args["q"], args["latent"], cache_seqlens=args["lens"], scale=args["scale"],
            head_dim_v=args["head_dim_v"],
        )  # fmt: skip


@pytest.mark.gpu
def test_deepseek_shapes_on_the_gpu() -> None:
    """DeepSeek's own shapes on the GPU (128 heads, 576 = 512 + 64, pages of 64, two new
    tokens) against fp64 of a few batch rows."""
    b, nq, hq, cap = 4, 2, 128, 4096
    q = torch.randn(b, nq, hq, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(b * cap // 64, device="cuda", dtype=torch.int32).view(b, cap // 64)
    cache = torch.randn(b * cap // 64, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([1, 1000, 2500, 4000], dtype=torch.int32, device="cuda")
    new = torch.randn(b, nq, 1, 576, dtype=torch.bfloat16, device="cuda")
    out = flashlite.attention_mla_decode(q, cache, cache_seqlens=lens, scale=0.1, latent_new=new,
                                         block_table=table)  # fmt: skip
    flat = torch.stack([cache[table[i]].reshape(cap, 1, 576) for i in range(b)]).cpu()
    want, _ = _reference_full(q.cpu(), flat, lens.cpu(), nq, 0.1)
    assert (out.cpu().double() - want).abs().max() <= 2e-2


def _reference_full(q, latent, lens, n_new, scale):  # noqa: ANN001, ANN202
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b]) + n_new
        kv = latent[b, :n, 0].double()
        s = torch.einsum("qhd,kd->hqk", q[b].double(), kv) * scale
        pos = torch.arange(q.shape[1])[:, None] + n - q.shape[1]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        outs.append((torch.softmax(s, -1) @ kv[:, :512]).transpose(0, 1))
    return torch.stack(outs), None


def test_bad_lengths_and_pages_are_reported() -> None:
    """The cache step's value checks (as attention_kvcache's): a length past the capacity, a
    page outside the pool; ``validate="sync"`` before anything is written, the default on the
    device (this call, on the CPU)."""
    q = torch.randn(1, 1, 4, D)
    latent = torch.randn(1, 32, 1, D)
    new = torch.randn(1, 1, 1, D)
    full, later = torch.tensor([32], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashlite.attention_mla_decode(
            q, latent, cache_seqlens=full, scale=0.2, head_dim_v=DL, latent_new=new,
            validate="sync",
        )  # fmt: skip
    pages = torch.randn(2, 16, 1, D)
    table = torch.tensor([[0, 5]], dtype=torch.int32)  # page 5 of a pool of 2
    with pytest.raises(ValueError, match="page"):
        flashlite.attention_mla_decode(
            q, pages, cache_seqlens=later, scale=0.2, head_dim_v=DL, block_table=table
        )
