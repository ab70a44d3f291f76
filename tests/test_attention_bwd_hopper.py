"""The fused Hopper (Gluon) attention backward: taken only for plain backwards and only where
it runs, a failed build falls back, it builds for sm_90 (no GPU needed), and on an sm_90 GPU it
matches fp64 while deterministic mode keeps the Triton backward."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import rand
from conftest import TOL

import flashlite
from flashlite.kernels import configs as C
from flashlite.masking.masks import CAUSAL, describe
from flashlite.ops.attention import Request
from flashlite.reference import attention as ref_attention


def test_fused_hopper_backward_only_takes_plain_backwards(monkeypatch: pytest.MonkeyPatch) -> None:
    # soft caps, per-batch lengths and pinned configs keep the Triton kernels even where the
    # fused Gluon kernel would run, and a plain window takes the fused flex kernel over its
    # band (the tables backend); a plain one (causal as a window too) asks for it, and a
    # launch that declines leaves the Triton kernels' answer
    import flashlite.ops.attention.ops as ops
    from flashlite.ops.attention import attention_fwd
    from flashlite.ops.attention.plan import Plan

    calls, folded = [], []
    monkeypatch.setattr(ops.planner, "hopper_bwd_applies", lambda *a: True)  # (and the window's)
    # spies: the fused kernel's plan records the ask and hands over the Triton pair's; the
    # window's records its tiles and hands back q, k, v as the "gradients"
    monkeypatch.setattr(
        ops.planner.hopper, "plan_bwd", lambda q, k, r, fallback: calls.append(r) or fallback()
    )
    window = lambda r, block: folded.append(block) or Plan("tables", lambda *a: a[1:4])  # noqa: E731
    monkeypatch.setattr(ops.planner.tables_bwd, "plan_window_bwd", window)
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    o, lse, _ = attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25))
    do = torch.randn_like(o)
    seqlens = torch.tensor([30], dtype=torch.int32)
    for mask, kwargs in ((describe(True, (8, 0)), {}), (describe(True, None, 5.0), {}),
                         (describe(True, (8, 0), 5.0), {}),
                         (CAUSAL, {"seqlens_k": seqlens}),
                         (describe(True, (8, 0)), {"seqlens_k": seqlens}),
                         (CAUSAL, {"config": C.CPU_BWD_CONFIG})):  # fmt: skip
        fields = {n: kwargs.pop(n) for n in list(kwargs) if n in Request._fields}
        ops.attention_bwd(
            do, q, k, v, o, lse, None, Request.of_mask(mask, 0.25, **fields), **kwargs
        )
    assert calls == [] and folded == [(128, 128)]  # the fused kernel's tiles
    want = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25), config=C.CPU_BWD_CONFIG
    )
    got = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    # causal written as a window is the same plan: decided once, at the first call
    again = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(describe(False, (-1, 0)), 0.25)
    )
    assert [c.causal for c in calls] == [True]  # causal reaches the plan
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


def test_fused_hopper_backward_is_only_chosen_where_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flashlite.kernels.attention import hopper_bwd as KHB
    from flashlite.ops.attention import HOPPER_ENV, hopper_bwd_applies

    cpu = rand(1, 2, 64, 128)
    assert not hopper_bwd_applies(*(cpu,) * 6)
    if not torch.cuda.is_available():
        return
    dev = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert not hopper_bwd_applies(*(dev.float(),) * 6)  # fp32
    assert not hopper_bwd_applies(*(dev[..., :96].contiguous(),) * 6)  # no such head dim
    runs_here = torch.cuda.get_device_capability()[0] == 9 and KHB.available()
    assert hopper_bwd_applies(*(dev,) * 6) == runs_here
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not hopper_bwd_applies(*(dev,) * 6)  # its dQ sums in no fixed order
    monkeypatch.undo()
    monkeypatch.setenv(HOPPER_ENV, "0")
    assert not hopper_bwd_applies(*(dev,) * 6)


def test_fused_hopper_backward_that_fails_to_build_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a Triton whose Gluon differs: one warning, then the Triton kernels give the answer
    import warnings

    import flashlite.ops.attention.ops as ops
    from flashlite.ops.attention import attention_fwd

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute")

    monkeypatch.setattr(ops.planner, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(ops.planner.hopper, "plan_bwd_hopper", broken)
    monkeypatch.setattr(ops.planner.hopper, "bwd_failed", set())
    q, k, v = (rand(1, 2, 40, 16) for _ in range(3))
    o, lse, _ = attention_fwd(q, k, v, Request.of_mask(CAUSAL, 0.25))
    do = torch.randn_like(o)
    want = ops.attention_bwd(
        do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25), config=C.CPU_BWD_CONFIG
    )
    with pytest.warns(RuntimeWarning, match="fused attention backward kernel failed"):
        got = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = ops.attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 0.25))
    assert not [w for w in seen if "fused Hopper" in str(w.message)]  # no second warning
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


_SM90_BWD_BUILD = """
import inspect, os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from flashlite.kernels.attention import hopper_bwd as H
from flashlite.ops.attention.backends import common_gluon as CG

d, causal = int(sys.argv[1]), sys.argv[2] == "1"
x = torch.empty(2, 4, 256, d, dtype=torch.bfloat16)
acc = torch.empty(2, 4, 256, d, dtype=torch.float32)
fn = H._attention_bwd_hopper_kernel
names = list(fn.arg_names)
descs = [CG.descriptor(x, H.BLOCK_M, d), CG.descriptor(x, H.BLOCK_M, d),
         CG.descriptor(x, H.BLOCK_N, d), CG.descriptor(x, H.BLOCK_N, d),
         CG.descriptor(acc, H.BLOCK_M, d // 2)]
sig = {n: mangle_type(t) for n, t in zip(names[:5], descs)}
sig.update(LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16", sm_scale="fp32")
consts = dict(STAGES=H.STAGES, GROUP_H=H.CAUSAL_GROUP_H, IS_CAUSAL=causal, LISTED=False,
              MASK_MOD=None, N_MASK_BUF=0, SCORE_MOD=None, SCORE_GRAD=None, N_SCORE_BUF=0,
              HAS_SCORE=False)
if sys.argv[4] == "1":  # block tables, a document-causal mask and ALiBi (flex_attention's call)
    from flashlite.masking import gallery
    mask = gallery.document_causal(torch.zeros(1, 256, dtype=torch.int32))
    score = gallery.alibi(gallery.alibi_slopes(4))
    tables = names[names.index("FULL_NUM"):names.index("MB0")]
    buffers = names[names.index("MB0"):names.index("SB3") + 1]
    sig.update({n: ("*i32" if n.isupper() else "i32") for n in tables})
    sig.update(dict(zip(buffers, ["*i32", "i32", "i32", "i32", "*fp32", "i32", "i32", "i32"])))
    consts.update(LISTED=True, MASK_MOD=mask.fn, N_MASK_BUF=2, SCORE_MOD=score.fn,
                  SCORE_GRAD=score.grad_fn, N_SCORE_BUF=1, HAS_SCORE=True)
# a constexpr not named above takes its default: never built as a runtime integer
consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts},
          **consts}
assert all(v is not inspect.Parameter.empty for v in consts.values()), consts
sig.update({n: "i32" for n in names if n not in sig and n not in consts})
sig.update(dict.fromkeys(consts, "constexpr"))
src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
from triton.backends.nvidia.compiler import get_ptxas

path = os.path.join(sys.argv[3], "k.ptx")
open(path, "w").write(k.asm["ptx"])
out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                     capture_output=True, text=True)
print("SHARED", k.metadata.shared)
print(out.stdout + out.stderr)
"""


@pytest.mark.parametrize("listed", [False, True], ids=["plain", "flex"])
def test_fused_hopper_backward_builds_for_sm90(listed: bool, tmp_path) -> None:  # noqa: ANN001
    # No GPU needed: Triton compiles the Gluon kernel for sm_90a and its ptxas reports. A code
    # change that breaks the build, outgrows shared memory or makes ptxas serialise the async
    # products (warnings C7513/C7514) fails here. (Its few spilled scalars depend on the Triton
    # version's compiler: 80 bytes with the 3.6 the H200 runs.) ``listed``: flex_attention's
    # variant over block tables, with a document-causal mask and ALiBi.
    import os
    import subprocess
    import sys

    from flashlite.kernels.attention import hopper_bwd as KHB

    if not KHB.available():
        pytest.skip("this Triton has no usable Gluon")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    cmd = [sys.executable, "-c", _SM90_BWD_BUILD, "128", str(int(not listed)), str(tmp_path),
           str(int(listed))]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout
    assert "C7513" not in report and "C7514" not in report, report
    shared = int(report.split("SHARED", 1)[1].split()[0])
    assert shared <= 227 * 1024, shared  # an sm_90 block's most


def _needs_fused_hopper_backward() -> None:
    from flashlite.kernels.attention import hopper_bwd as KHB

    if torch.cuda.get_device_capability()[0] != 9 or not KHB.available():
        pytest.skip("the fused Gluon backward runs on sm_90 with Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk,hq,hkv,layout", [
    (1024, 1024, 4, 2, "b h n d"),  # GQA
    (1000, 3001, 4, 1, "b h n d"),  # odd lengths (partial tiles, TMA padding), MQA
    (3001, 1000, 2, 2, "b h n d"),  # Nq > Nk: causal rows that see no key
    (129, 129, 2, 2, "b n h d"),  # transformers' layout (strided heads), one row past a block
    (1, 300, 2, 2, "b h n d"),  # one query row
])  # fmt: skip
def test_gpu_fused_hopper_backward(dtype, causal, d, nq, nk, hq, hkv, layout) -> None:  # noqa: ANN001
    # through the autograd op, with an LSE gradient too: within 2x PyTorch's own error
    from flashlite.ops.attention import hopper_bwd_applies

    _needs_fused_hopper_backward()
    shape = (lambda h, n: (2, h, n, d)) if layout == "b h n d" else (lambda h, n: (2, n, h, d))
    q = torch.randn(*shape(hq, nq), device="cuda", dtype=dtype)
    k, v = (torch.randn(*shape(hkv, nk), device="cuda", dtype=dtype) for _ in range(2))
    views = [t if layout == "b h n d" else t.transpose(1, 2) for t in (q, k, v)]
    assert hopper_bwd_applies(views[0], *views[1:], views[0], views[1], views[2])
    do = torch.randn_like(views[0])
    dlse = torch.randn(views[0].shape[:3], device="cuda")

    def grads(fn, *ts):  # noqa: ANN001, ANN202
        ts = [t.detach().clone().requires_grad_() for t in ts]
        o, lse = fn(*ts)
        # rows that see no key have LSE −inf: their gradient comes through the output only
        seen = torch.isfinite(lse)
        ((o.float() * do.float()).sum() + (lse.float() * dlse)[seen].sum()).backward()
        return [t.grad for t in ts]

    def ref(a, b, c):  # noqa: ANN001, ANN202
        return ref_attention(a, b, c, causal, return_lse=True)

    want = grads(ref, *(t.float() for t in views))
    torch_lp = grads(ref, *views)
    got = grads(lambda a, b, c: flashlite.attention(a, b, c, causal=causal, return_lse=True),
                *views)  # fmt: skip
    for g, w, t in zip(got, want, torch_lp, strict=True):
        assert torch.isfinite(g).all()
        err = (g.float() - w).abs().max().item()
        torch_err = (t.float().nan_to_num() - w).abs().max().item()
        assert err <= 2 * torch_err + TOL[dtype].floor * max(1.0, w.abs().max().item())


@pytest.mark.gpu
def test_gpu_deterministic_mode_keeps_the_triton_backward() -> None:
    # torch.use_deterministic_algorithms: the fused kernel's dQ sums in no fixed order, so the
    # two Triton kernels run, and two runs agree bit for bit
    from flashlite.ops.attention import attention_bwd, bwd_config

    _needs_fused_hopper_backward()
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    o, lse = flashlite.attention(q, k, v, causal=True, return_lse=True)
    do = torch.randn_like(o)
    pinned = attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5),
                           config=bwd_config(q.device, q.dtype, 128, True))  # fmt: skip
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [
            attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5))
            for _ in range(2)
        ]
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b, p in zip(*runs, pinned, strict=True):
        assert torch.equal(a, b) and torch.equal(a, p)
    fused = attention_bwd(do, q, k, v, o, lse, None, Request.of_mask(CAUSAL, 128**-0.5))
    for f, p in zip(fused, pinned, strict=True):  # the fused one is close, not equal
        assert (f.float() - p.float()).abs().max() <= 2e-2 * p.float().abs().max()
