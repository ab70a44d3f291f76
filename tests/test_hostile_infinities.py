"""Hostile inputs, +inf: a +inf logit, score, key or LSE gives torch.logsumexp's +inf (and
torch's NaN output where torch gives one) in the statistics, softmax, attention and
cross-entropy, never inf - inf = NaN where the answer is finite.

Each case gives the right value (checked against torch or the fp64 reference) or raises a
clear error naming the argument; none may crash, read outside a tensor or return silent garbage.
Runs on CPU in the interpreter and, for the cases marked ``gpu``, on a CUDA device."""

from __future__ import annotations

import math

import pytest
import torch
from hostile_helpers import INF

import flashlite


def test_merge_with_plus_inf_matches_logsumexp() -> None:
    # a part holding +inf makes the union's LSE +inf, as torch.logsumexp; never inf − inf = NaN
    from flashlite import stats

    m_a = torch.tensor([INF, INF, 1.0, -INF, INF, 2.0])
    s_a = torch.tensor([1.0, 2.0, 1.0, 0.0, 1.0, 1.0])
    m_b = torch.tensor([1.0, INF, INF, -INF, -INF, 3.0])
    s_b = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    m, s = stats.merge(m_a, s_a, m_b, s_b)
    want = torch.logsumexp(torch.stack([m_a + s_a.log(), m_b + s_b.log()]), 0)
    assert not s.isnan().any()
    torch.testing.assert_close(m + s.log(), want)
    torch.testing.assert_close(stats.torch_finalize_lse(m, s), want)
    # finalize gives +inf for m = +inf whatever s is (a tile's own e^(inf − inf) is NaN)
    assert stats.torch_finalize_lse(torch.tensor([INF]), torch.tensor([math.nan])).item() == INF


def test_merge_attention_with_plus_inf_lse_matches_logsumexp() -> None:
    from flashlite import stats

    o = torch.randn(2, 3, 4)
    lse_a = torch.tensor([[INF, 0.5, -INF], [1.0, -INF, INF]])
    lse_b = torch.tensor([[0.1, INF, -INF], [2.0, -INF, -INF]])
    o_m, lse = stats.merge_attention(o, lse_a, o, lse_b)
    torch.testing.assert_close(lse, torch.logsumexp(torch.stack([lse_a, lse_b]), 0))
    assert (o_m[lse.isfinite()] == o_m[lse.isfinite()]).all()  # finite rows: no NaN
    assert (o_m[0, 2] == 0).all() and (o_m[1, 1] == 0).all()  # rows that saw nothing: 0


def test_triton_merge_with_plus_inf_matches_logsumexp() -> None:
    from test_stats import _finalize_lse_kernel, _launch, _merge_pair_kernel, _merge_partials_kernel

    from flashlite.stats import LOG2E

    r = 8
    m_a = torch.tensor([INF, INF, 1.0, -INF, INF, 2.0, -INF, 0.0])
    s_a = torch.tensor([1.0, 2.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    m_b = torch.tensor([1.0, INF, INF, -INF, -INF, 3.0, 5.0, -INF])
    s_b = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 2.0, 0.0])
    want = torch.logsumexp(torch.stack([m_a + s_a.log(), m_b + s_b.log()]), 0)
    m, s, lse = torch.empty(r), torch.empty(r), torch.empty(r)
    _launch(_merge_pair_kernel, m_a, s_a, m_b, s_b, m, s, R=r, SCALE=LOG2E)
    _launch(_finalize_lse_kernel, m, s, lse, R=r, SCALE=LOG2E)
    assert not s.isnan().any()
    torch.testing.assert_close(lse, want)
    mp, sp = torch.stack([m_a, m_b], 1), torch.stack([s_a, s_b], 1)
    _launch(_merge_partials_kernel, mp, sp, m, s, R=r, C=2, SCALE=LOG2E)
    _launch(_finalize_lse_kernel, m, s, lse, R=r, SCALE=LOG2E)
    torch.testing.assert_close(lse, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [None, 2], ids=["plain", "split_kv"])
def test_attention_lse_with_a_plus_inf_key_matches_logsumexp(dtype, splits) -> None:  # noqa: ANN001
    # rows whose score against the +inf key is +inf: LSE +inf (torch.logsumexp) and output NaN
    # (torch's attention); rows where it is −inf stay finite
    q = torch.randn(1, 2, 3, 8).to(dtype)
    k, v = torch.randn(1, 2, 40, 8).to(dtype), torch.randn(1, 2, 40, 8).to(dtype)
    q[..., 0] = torch.tensor([1.0, -1.0, 0.5]).to(dtype)
    k[0, :, 17, 0] = INF
    out, lse = flashlite.attention(q, k, v, return_lse=True, num_splits=splits)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 8**-0.5
    want = torch.logsumexp(scores, -1)
    plus = want == INF
    assert plus[..., 0].all() and not plus[..., 1].any()
    assert (lse[plus] == INF).all()
    torch.testing.assert_close(lse[~plus].double(), want[~plus], atol=2e-2, rtol=2e-2)
    assert out[plus].isnan().all() and out[~plus].isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_hopper_attention_lse_with_a_plus_inf_key_matches_logsumexp(d) -> None:  # noqa: ANN001
    # B·H·N²·D ≥ 2^30: the Gluon forward on sm_90 (the Triton kernel elsewhere)
    q, k, v = (torch.randn(1, 2, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q[..., 0] = torch.where(torch.arange(4096, device="cuda") % 2 == 0, 1.0, -1.0)
    k[0, :, 1000, 0] = INF
    out, lse = flashlite.attention(q, k, v, return_lse=True)
    plus = torch.arange(4096, device="cuda") % 2 == 0
    assert (lse[..., plus] == INF).all() and lse[..., ~plus].isfinite().all()
    assert out[:, :, plus].isnan().all() and out[:, :, ~plus].isfinite().all()


@pytest.mark.gpu
def test_gpu_cross_entropy_lse_of_long_rows_with_plus_inf_is_plus_inf() -> None:
    # rows of 64k logits: the Gluon team kernel on a GPU that runs it
    x = torch.randn(4, 65536, device="cuda", dtype=torch.bfloat16)
    x[1, 3] = INF
    t = torch.zeros(4, dtype=torch.long, device="cuda")
    loss, lse = flashlite.cross_entropy(x, t, reduction="none", return_lse=True)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), -1), atol=1e-4, rtol=1e-5)
    assert loss[1].isnan() and loss[[0, 2, 3]].isfinite().all()


def test_softmax_of_a_row_with_plus_inf_is_nan_as_in_torch() -> None:
    x = torch.tensor([[INF, 1.0, 2.0], [1.0, 2.0, 3.0], [-INF, 1.0, INF]])
    for ours, theirs in ((flashlite.softmax, torch.softmax),
                         (flashlite.log_softmax, torch.log_softmax)):  # fmt: skip
        torch.testing.assert_close(ours(x, -1), theirs(x, -1), equal_nan=True)


def test_cross_entropy_lse_with_a_plus_inf_logit_is_plus_inf() -> None:
    x = torch.tensor([[INF, 1.0, 2.0], [1.0, 2.0, 3.0]])
    loss, lse = flashlite.cross_entropy(x, torch.tensor([1, 0]), reduction="none", return_lse=True)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    want = torch.nn.functional.cross_entropy(x, torch.tensor([1, 0]), reduction="none")
    torch.testing.assert_close(loss, want, equal_nan=True)
