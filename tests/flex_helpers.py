"""Shared pieces of the flex tests (``test_flex_*.py``): the gallery of mods at the tests'
sizes, their block masks, the fp64 references for packed sequences and KV-cache decoding, and
the comparisons several files make."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from conftest import TOL

import flashlite
from flashlite import reference
from flashlite.masking import block_mask as BM
from flashlite.masking import gallery, mods

N, D, BLOCK = 72, 32, 32  # a ragged last tile both ways, several tiles per row


def _ids(b: int, n: int, docs: int = 4) -> torch.Tensor:
    return torch.sort(torch.randint(0, docs, (b, n)), dim=1).values.to(torch.int32)


def _gallery(h: int, b: int) -> dict[str, tuple[mods.MaskMod | None, mods.ScoreMod | None]]:
    ids = _ids(b, N)
    return {
        "causal": (gallery.causal(), None),
        "sliding_window": (gallery.sliding_window(20), None),
        "prefix_lm": (gallery.prefix_lm(10), None),
        "document": (gallery.document(ids), None),
        "document_causal": (gallery.document_causal(ids), None),
        "alibi": (gallery.causal(), gallery.alibi(gallery.alibi_slopes(h))),
        "tanh_softcap": (None, gallery.tanh_softcap(3.0)),
        "relative_bias": (gallery.causal(), gallery.relative_bias(torch.randn(h, 9))),
    }


GALLERY = list(_gallery(4, 2))


def _block_mask(mm: mods.MaskMod | None, b: int, h: int | None = None) -> BM.BlockMask | None:
    if mm is None:
        return None
    batch = b if mm.name.startswith("flashlite.gallery.document") else None
    return flashlite.create_block_mask(mm, batch, h, N, N, device="cpu", BLOCK_SIZE=BLOCK)


def _grads(out: tuple[torch.Tensor, torch.Tensor], leaves: list[torch.Tensor],
           go: torch.Tensor, gl: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    o, lse = out
    return torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)


def assert_fp32_against_fp64(
    out: tuple[torch.Tensor, torch.Tensor], leaves: list[torch.Tensor], **reference_kw: object
) -> None:
    """An fp32 ``(o, lse)`` of ``leaves`` (q, k, v) and its gradients (through both outputs)
    against :func:`flashlite.reference.attention` in fp64 with ``reference_kw``."""
    exact = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.attention(*exact, return_lse=True, **reference_kw)
    go, gl = torch.randn_like(out[0]), torch.randn_like(out[1])
    got = _grads(out, leaves, go, gl)
    want = _grads((ref[0], ref[1].double()), exact, go.double(), gl.double())
    torch.testing.assert_close(out[0].double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref[1].double(), atol=2e-5, rtol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=3e-5, rtol=1e-5)


def _assert_within_twice_torchs_error(o, low, exact, inputs, leaves, dtype) -> None:  # noqa: ANN001
    """``o`` (from 16-bit ``inputs``) and its gradients are within 2x the error of ``low``, the
    same math in torch at the input precision, against ``exact`` (fp64 ``leaves``), plus the
    tolerance table's floor."""
    go = torch.randn_like(o)
    got = torch.autograd.grad(o, inputs, go)
    want = torch.autograd.grad(exact, leaves, go.double())
    torch_low = torch.autograd.grad(low, inputs, go)
    floor = TOL[dtype].floor
    assert (o.double() - exact).abs().max() <= 2 * (low.double() - exact).abs().max() + floor
    for a, w, t in zip(got, want, torch_low, strict=True):
        assert (a.double() - w).abs().max() <= 2 * (t.double() - w).abs().max() + 4 * floor


def _assert_compiled_equals_eager(step, compiled, q, k, v, *rest) -> None:  # noqa: ANN001
    """``compiled(q, k, v, *rest)`` and ``step``'s eager call agree bit for bit, gradients to
    q, k and v (of the output's sum) included."""
    o = compiled(q, k, v, *rest)
    o.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    e = step(q, k, v, *rest)
    e.sum().backward()
    assert torch.equal(o, e)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(g, t.grad)


@triton.jit
def _prefix_per_sequence(b, h, q_idx, kv_idx, prefix):
    return (kv_idx < tl.load(prefix + b)) | (q_idx >= kv_idx)


def _prefix_per_sequence_t(b, h, q_idx, kv_idx, prefix):  # type: ignore[no-untyped-def]
    return (kv_idx < prefix[b]) | (q_idx >= kv_idx)


def _packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_reference(q, k, v, cu_q, cu_k, mm, sm):  # noqa: ANN001, ANN202
    """fp64 attention of each packed sequence on its own, the mods seeing it as batch b and
    positions from its start: ``(o (total_q, Hq, D), lse (Hq, total_q))``."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        ks, vs = (t[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(hq // hkv, 0)
                  for t in (k, v))  # fmt: skip
        s = qs @ ks.transpose(-1, -2) * d**-0.5
        dev = q.device
        idx = (torch.tensor(b, device=dev), torch.arange(hq, device=dev)[:, None, None],
               torch.arange(qs.shape[1], device=dev)[None, :, None],
               torch.arange(ks.shape[1], device=dev)[None, None, :])  # fmt: skip
        if sm is not None:
            s = sm(s, *idx).to(q.dtype)  # (a bias table's fp32 promotes 16-bit scores)
        if mm is not None:
            s = torch.where(mm(*idx), s, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0, LSE -inf
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _varlen_case(name: str, hq: int, lq: list[int], lk: list[int]):  # noqa: ANN202
    """(mask, score, per-sequence block mask?) of a varlen case."""
    prefix = torch.tensor([2, 0, 7, 1, 3], dtype=torch.int32)[: len(lq)]
    return {
        "causal+alibi": (gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq)), False),
        "prefix per sequence": (mods.mask_mod(_prefix_per_sequence, prefix,
                                              torch_fn=_prefix_per_sequence_t,
                                              name="tests.prefix_per_sequence"), None, True),
        "softcap, no mask": (None, gallery.tanh_softcap(2.0), False),
        "window+relative bias": (gallery.sliding_window(9),
                                 gallery.relative_bias(torch.randn(hq, 7)), False),
    }[name]  # fmt: skip


# sequences of 0, 1, a ragged tile and several tiles; keys shorter and longer than queries
VARLEN_Q, VARLEN_K = [23, 1, 0, 40, 9], [23, 5, 3, 31, 17]


def _kvcache_reference(q, kc, vc, lens, mm, causal=True, window=None, sm=None):  # noqa: ANN001, ANN202
    """fp64 decode step over caches that already hold the new keys: query i of Nq sits at
    position ``lens[b] − Nq + i`` (lens: lengths after the append); ``sm`` a score function."""
    bsz, nq, hq, d = q.shape
    group = hq // kc.shape[2]
    out = torch.zeros(bsz, nq, hq, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(lens[b])
        qpos, kpos = torch.arange(n - nq, n)[:, None], torch.arange(n)[None]
        for h in range(hq):
            s = q[b, :, h].double() @ kc[b, :n, h // group].double().T * d**-0.5
            if sm is not None:
                s = sm(s, torch.tensor(b), torch.tensor(h), qpos, kpos).double()
            seen = mm(torch.tensor(b), torch.tensor(h), qpos, kpos) if mm is not None else True
            if causal:
                seen = seen & (kpos <= qpos)
            if window is not None:
                seen = seen & (kpos >= qpos - window)
            p = torch.softmax(s.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)
            out[b, :, h] = p @ vc[b, :n, h // group].double()
    return out
