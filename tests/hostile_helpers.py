"""Shared pieces of the hostile-input tests (``test_hostile_*.py``): small KV caches with their
fp64 reference and shuffled pages, and cross-entropy's fp64 reference and inputs."""

from __future__ import annotations

import math

import torch

INF = math.inf


KV_B, KV_HQ, KV_HKV, KV_D, KV_CAP = 4, 4, 2, 16, 64


def _kv_reference(q, k_cache, v_cache, lengths):  # noqa: ANN001, ANN202
    """(B, Nq, Hq, D) in fp64: each batch's queries against its first ``lengths[b]`` keys."""
    from test_attention_kvcache import _reference

    return _reference(*(t.double() for t in (q, k_cache, v_cache)), lengths, True, causal=True)


def _kv(device="cpu", cap=KV_CAP):  # noqa: ANN001, ANN202
    q = torch.randn(KV_B, 1, KV_HQ, KV_D, device=device)
    k, v = (torch.randn(KV_B, cap, KV_HKV, KV_D, device=device) for _ in range(2))
    return q, k, v


def _pages(k, v, page):  # noqa: ANN001, ANN202
    """The caches in shuffled pages of ``page`` keys (plus two spare pages): pages, table."""
    per = k.shape[1] // page
    pool = KV_B * per + 2
    table = torch.randperm(pool)[: KV_B * per].view(KV_B, per).to(torch.int32)
    kp, vp = (torch.randn(pool, page, KV_HKV, KV_D) for _ in range(2))
    for b in range(KV_B):
        for j in range(per):
            kp[table[b, j]], vp[table[b, j]] = (t[b, j * page : (j + 1) * page] for t in (k, v))
    return kp, vp, table


_F = torch.nn.functional


def _ce_ref(x, t, w=None, *, ii=-100, reduction="mean", eps=0.0, z=0.0, softcap=None,  # noqa: ANN001, ANN202
            z_by="count"):  # fmt: skip
    """fp64 cross-entropy of ``(N, V)`` logits (torch's, weighted mean included) plus z·lse² per
    kept token; a mean divides the z-loss by the kept targets' count (``z_by="count"``: Liger's
    convention) or, as the cross-entropy term, by their class weights (``"weight"``)."""
    x = x.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    wd = w.double() if w is not None else None
    ce = _F.cross_entropy(x, t, wd, ignore_index=ii, reduction=reduction, label_smoothing=eps)
    kept = t != ii
    zt = z * torch.where(kept, torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "none":
        return ce + zt
    if reduction == "sum":
        return ce + zt.sum()
    if z_by == "count" or wd is None:
        return ce + zt.sum() / kept.sum()
    return ce + zt.sum() / torch.where(kept, wd[t.clamp(0, x.shape[-1] - 1)], 0.0).sum()


def _ce_inputs(n=6, v=40, h=16, seed=11, device="cpu"):  # noqa: ANN001, ANN202
    """Logits, hidden states, an output layer, its bias, targets (one ignored) and class weights
    far from 1 (so that their sum and the targets' count differ)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=gen) * 3
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / 4
    bias = torch.randn(v, generator=gen)
    t = torch.randint(0, v, (n,), generator=gen)
    t[1] = -100
    cw = torch.rand(v, generator=gen) * 3 + 0.1
    return tuple(a.to(device) for a in (x, hidden, weight, bias, t, cw))
