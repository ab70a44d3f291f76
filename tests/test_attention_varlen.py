"""flashlite.attention_varlen (issue 11, must 3): packed sequences of different lengths, forward
and backward, against the fp64 reference run on each sequence alone.

Each sequence's output, LSE and gradients must be within twice PyTorch's own low-precision error
(the same math in the inputs' dtype) plus the dtype's floor.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TOL

import flashlite
from flashlite.reference import attention as ref_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (query lengths, key lengths, causal, window, softcap): lengths 0 and 1, Nq != Nk per sequence
CASES = [
    ([5, 0, 17, 1], [9, 4, 17, 30], False, None, None),
    ([12, 7, 20], [12, 30, 5], True, None, None),
    ([16, 33, 1], [16, 33, 40], True, (4, 0), 2.0),
    ([3, 40, 6], [50, 8, 0], False, (3, 2), None),
    ([1], [1], False, None, 5.0),
]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _per_sequence(fn, q, k, v, cu_q, cu_k, do):  # noqa: ANN001, ANN202
    """(out, lse, dq, dk, dv) of ``fn`` on each sequence alone, packed back together."""
    out, lse = (
        torch.zeros_like(q, dtype=torch.float64),
        torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64),
    )
    grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for i in range(cu_q.shape[0] - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if qs.start == qs.stop:
            continue
        leaves = [t[s].transpose(0, 1).unsqueeze(0).detach().requires_grad_()
                  for t, s in ((q, qs), (k, ks), (v, ks))]  # fmt: skip
        o, l_ = fn(*leaves)
        o.backward(do[qs].transpose(0, 1).unsqueeze(0).to(o.dtype))
        out[qs], lse[:, qs] = o[0].transpose(0, 1).double(), l_[0].double()
        for g, leaf, s in zip(grads, leaves, (qs, ks, ks), strict=True):
            if leaf.grad is not None:
                g[s] = leaf.grad[0].transpose(0, 1).double()
    return out, lse, *grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_matches_each_sequence_alone(case: tuple, dtype: torch.dtype) -> None:
    lq, lk, causal, window, softcap = case
    cu_q, cu_k = _offsets(lq), _offsets(lk)
    q = torch.randn(sum(lq), 4, 24, dtype=dtype)
    k, v = (torch.randn(sum(lk), 2, 24, dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    opts = {"causal": causal, "window": window, "softcap": softcap}
    out, lse = flashlite.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), **opts,
                                          return_lse=True)  # fmt: skip
    assert out.shape == q.shape and lse.shape == (4, sum(lq)) and lse.dtype == torch.float32
    out.backward(do)
    got = (out, lse, *(t.grad for t in leaves))
    kw = {"causal": causal, "window": window, "softcap": softcap, "return_lse": True}
    want = _per_sequence(lambda a, b, c: ref_attention(a, b, c, upcast=True, **kw), q, k, v,
                         cu_q, cu_k, do)  # fmt: skip
    torch_lp = _per_sequence(lambda a, b, c: ref_attention(a, b, c, **kw), q, k, v, cu_q, cu_k,
                             do)  # fmt: skip
    for name, g, w, t in zip(["out", "lse", "dq", "dk", "dv"], got, want, torch_lp, strict=True):
        assert torch.equal(torch.isneginf(g), torch.isneginf(w)), name
        fin = torch.isfinite(w)
        if not fin.any():
            continue
        err = (g[fin].double() - w[fin]).abs().max().item()
        torch_err = (t[fin].double() - w[fin]).abs().max().item()
        floor = TOL[dtype].floor * max(1.0, w[fin].abs().max().item())
        assert err <= 2 * torch_err + floor, (name, err, torch_err)


def test_varlen_equals_dense_for_equal_lengths_and_compiles() -> None:
    q, k, v = (torch.randn(2, 13, 2, 16) for _ in range(3))  # b n h d
    dense = flashlite.attention(q, k, v, causal=True, layout="b n h d")
    cu = torch.tensor([0, 13, 26], dtype=torch.int32)
    packed = [t.reshape(26, 2, 16) for t in (q, k, v)]
    out = flashlite.attention_varlen(*packed, cu, cu, 13, 13, causal=True)
    torch.testing.assert_close(out, dense.reshape(26, 2, 16), atol=1e-6, rtol=0)

    def step(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.attention_varlen(q, k, v, cu, cu, 13, 13, causal=True).sum()

    leaves = [t.clone().requires_grad_() for t in packed]
    eager = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(*leaves), leaves)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b)
    # the forward op with the varlen arguments: schema, fake, autograd, AOT dispatch
    from torch.library import opcheck

    views = [t.unsqueeze(0).transpose(1, 2) for t in packed]  # (1, H, total, D)
    views[0].requires_grad_()
    fields = {"causal": True, "scale": 0.25, "max_seqlen_q": 13, "max_seqlen_k": 13}
    opcheck(torch.ops.flashlite.attention_fwd.default, (*views, None, cu, cu), fields)


def test_bad_varlen_arguments_are_refused() -> None:
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        flashlite.attention_varlen(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="start at 0"):
        flashlite.attention_varlen(q, q, q, torch.tensor([1, 4, 10], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="never decrease"):
        bad, ok = (torch.tensor(c, dtype=torch.int32) for c in ([0, 7, 4, 10], [0, 3, 4, 10]))
        flashlite.attention_varlen(q, q, q, bad, ok, 7, 6)
    with pytest.raises(ValueError, match="packed length 10"):
        flashlite.attention_varlen(q, q, q, torch.tensor([0, 4, 9], dtype=torch.int32), cu, 6, 6)
    with pytest.raises(ValueError, match="max_seqlen"):
        flashlite.attention_varlen(q, q, q, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="same number of sequences"):
        flashlite.attention_varlen(q, q, q, cu, torch.tensor([0, 10], dtype=torch.int32), 6, 10)
    with pytest.raises(ValueError, match="total, heads, head_dim"):
        flashlite.attention_varlen(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="max_seqlen"):
        flashlite.attention_varlen(q, q, q, cu, cu, 6.0, 6)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_varlen(dtype: torch.dtype, causal: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lq = [1, 2048, 777, 3001, 64]
    lk = [1, 2048, 1500, 3001, 0]
    cu_q, cu_k = _offsets(lq).cuda(), _offsets(lk).cuda()
    q = torch.randn(sum(lq), 8, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lk), 2, 128, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashlite.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                     window=(512, -1))  # fmt: skip
    out.backward(do)
    for i in range(len(lq)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        one = [t[s].transpose(0, 1).unsqueeze(0).float().requires_grad_()
               for t, s in ((q, qs), (k, ks), (v, ks))]  # fmt: skip
        want = ref_attention(*one, causal, window=(512, -1))
        want.backward(do[qs].transpose(0, 1).unsqueeze(0).float())
        pairs = [(out[qs], want[0].transpose(0, 1))] + [
            (leaf.grad[s], r.grad[0].transpose(0, 1))
            for leaf, r, s in zip(leaves, one, (qs, ks, ks), strict=True)
        ]
        for got, w in pairs:
            if got.numel() == 0:  # (a sequence without keys has no key gradients)
                continue
            assert torch.isfinite(got).all()
            tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
            assert (got.float() - w).abs().max().item() <= tol * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_descriptors_equal_pointer_loads_and_keep_sequences_apart(causal: bool) -> None:
    """With TMA descriptors a tile may cross into the next sequence: the masks and the zeroed
    value tail keep that sequence's rows out, even infinite values."""
    from flashlite.masking.masks import describe
    from flashlite.ops.attention import Request, attention_fwd

    lq, lk = [5, 21, 1, 18], [9, 21, 30, 2]
    cu_q, cu_k = _offsets(lq), _offsets(lk)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, sum(lq), 32, generator=gen, dtype=torch.float16)
    k, v = (torch.randn(1, 2, sum(lk), 32, generator=gen, dtype=torch.float16) for _ in range(2))
    v[:, :, cu_k[1] : cu_k[2]] = float("inf")  # sequence 1's values: inf
    k[:, :, cu_k[3] :] = float("nan")  # sequence 3's keys: NaN
    runs = [
        attention_fwd(
            q,
            k,
            v,
            Request.of_mask(
                describe(causal),
                32**-0.5,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max(lq),
                max_seqlen_k=max(lk),
            ),
            use_desc=desc,
        )
        for desc in (False, True)
    ]
    assert runs[1][2] is not None and runs[1][2].use_desc
    for i in (0, 2):  # the sequences beside the non-finite ones
        rows = slice(cu_q[i], cu_q[i + 1])
        for got, want in zip(runs[1][:2], runs[0][:2], strict=True):
            assert torch.isfinite(got[..., rows, :] if got.dim() == 4 else got[..., rows]).all()
            torch.testing.assert_close(got[..., rows, :] if got.dim() == 4 else got[..., rows],
                                       want[..., rows, :] if want.dim() == 4 else want[..., rows],
                                       atol=0, rtol=0)  # fmt: skip


def test_unvalidated_offsets_stay_inside_the_tensors() -> None:
    """``validate=False`` (no host sync) equals the validated call for good offsets; bad ones
    (past the packed length, decreasing, negative) are clamped in the kernels, never read or
    written outside the tensors."""
    lq = [5, 21, 1]
    cu = _offsets(lq)
    q, k, v = (torch.randn(sum(lq), 2, 16) for _ in range(3))
    good = [flashlite.attention_varlen(q, k, v, cu, cu, 21, 21, causal=True, validate=check)
            for check in (True, False)]  # fmt: skip
    torch.testing.assert_close(good[0], good[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="packed length"):
        flashlite.attention_varlen(q, k, v, cu + 1, cu, 21, 21)
    for bad in ([0, 30, 2, 400], [-5, 3, 3, 27]):
        cu_bad = torch.tensor(bad, dtype=torch.int32)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashlite.attention_varlen(*leaves, cu_bad, cu_bad, 8, 8, validate=False)
        out.sum().backward()
        assert out.shape == q.shape and all(t.grad is not None for t in leaves)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "max_q", "message"),
    [
        ([1, 5, 9], [0, 4, 9], 8, r"cu_seqlens_q must start at 0; got cu_seqlens_q\[0\] = 1"),
        (
            [0, 5, 9],
            [0, 4, 8],
            8,
            r"cu_seqlens_k must end at the packed length 9; got "
            r"cu_seqlens_k\[2\] = 8",
        ),  # fmt: skip
        (
            [0, 6, 4, 9],
            [0, 3, 6, 9],
            8,
            r"cu_seqlens_q must never decrease; got "
            r"cu_seqlens_q\[2\] - cu_seqlens_q\[1\] = -2",
        ),  # fmt: skip
        (
            [0, 1, 9],
            [0, 3, 9],
            5,
            r"max_seqlen \(5\) is below the longest sequence of "
            r"cu_seqlens_q \(sequence 1 has 8\)",
        ),  # fmt: skip
        ([0, 4, 9], [0, 4, 9], 8, None),
    ],
)
def test_offsets_checked_on_the_device(cu_q: list, cu_k: list, max_q: int,
                                       message: str | None) -> None:  # fmt: skip
    """The GPU's default check, run here in the interpreter: the kernel records the first bad
    offset without a sync, the next check raises it (naming it an earlier call's), and the
    record is cleared."""
    from flashlite.ops.attention import checks
    from flashlite.ops.common import take_record

    q_off, k_off = (torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k))
    assert checks.check_offsets_on_device(q_off, k_off, 9, 9, max_q, 8)
    if message is None:
        checks._report_offsets_problems(q_off.device, True, earlier=False)  # nothing recorded
        return
    with pytest.raises(ValueError, match=message):
        checks._report_offsets_problems(q_off.device, True, earlier=False)
    assert take_record("offsets", q_off.device, True) is None  # cleared
    assert checks.check_offsets_on_device(q_off, k_off, 9, 9, max_q, 8)  # records it again
    good = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"an earlier flashlite.attention_varlen call.*" + message):
        checks.check_offsets_on_device(good, good, 9, 9, 8, 8)


def test_varlen_validate_takes_true_false_or_sync() -> None:
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = flashlite.attention_varlen(q, k, v, cu, cu, 5, 5, validate="sync")
    assert torch.isfinite(out).all()
    with pytest.raises(TypeError, match="validate must be True, False or 'sync'"):
        flashlite.attention_varlen(q, k, v, cu, cu, 5, 5, validate="no")


@pytest.mark.gpu
def test_gpu_default_varlen_reports_bad_offsets_from_a_later_call() -> None:
    q, k, v = (torch.randn(9, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    good = torch.tensor([0, 4, 9], dtype=torch.int32, device="cuda")
    bad = torch.tensor([0, 6, 9], dtype=torch.int32, device="cuda")  # 6 > max_seqlen 5
    out = flashlite.attention_varlen(q, k, v, bad, good, 5, 5)  # no sync, no error yet
    assert out.shape == q.shape
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="an earlier flashlite.attention_varlen call"):
        flashlite.attention_varlen(q, k, v, good, good, 5, 5)
    ok = flashlite.attention_varlen(q, k, v, good, good, 5, 5)
    assert torch.isfinite(ok).all()
