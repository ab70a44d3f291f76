"""The flex kernels' Hopper side without a GPU: the kernels with mods build for sm_90 without
spilling, a Gluon build that fails falls back to the Triton kernels, and the fused backward's
host code hands its kernel what it reads."""

from __future__ import annotations

import math

import pytest
import torch

import flashlite
from flashlite.masking import gallery

_SM90_MOD_BUILD = """
import os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from flashlite.masking import gallery
from flashlite.kernels.attention import decode as KD
from flashlite.kernels.attention import flex as KF
from flashlite.ops.attention.backends.tables import args as FA
from flashlite.ops.attention.backends.tables import bwd as TB
from flashlite.ops.attention.backends.tables import fwd as TF

which = sys.argv[1]
kernel = {"fwd": KF._flex_fwd_kernel, "dkdv": KF._flex_bwd_dkdv_kernel,
          "dq": KF._flex_bwd_dq_kernel, "decode": KD._attention_decode_kernel}[which]
names = list(kernel.arg_names)
mods = dict(MASK_MOD=gallery._document_causal, N_MASK_BUF=2, SCORE_MOD=gallery._alibi,
            N_SCORE_BUF=1)
if which == "decode":
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, IS_CAUSAL=True,
                  WINDOW=False, SOFTCAP=False, HAS_SEQLENS=True, HAS_SINKS=False, PAGE_SIZE=0,
                  USE_DESC=False, PRESCALE_Q=True, DOT_FP32=False, DOT_PRECISION="tf32",
                  ROUND_BF16=False, **mods)
    options = {"num_warps": 4, "num_stages": 3}
else:  # varlen, with the options the plans give D 128 bf16
    bwd = which != "fwd"
    opts = FA.plan_options(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16), 128, 128, bwd, True)
    options = {k: opts.pop(k) for k in ("num_warps", "num_stages")}
    consts = dict(HAS_SCORE=True, VARLEN=True, **opts, **mods)
    if bwd:
        consts["SCORE_GRAD"] = gallery._alibi_grad
for p in kernel.params:  # the constexprs left at their defaults
    if p.is_constexpr and p.name not in consts and p.has_default:
        consts[p.name] = p.default
ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DK": "*bf16",
        "DV": "*bf16", "DQ": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "SINKS": "*fp32",
        "MB0": "*i32", "SB0": "*fp32", "sm_scale": "fp32", "softcap": "fp32"}
sig = {n: "constexpr" if n in consts else ptrs.get(n, "*i32" if n.isupper() else "i32")
       for n in names}
sig.update({n: "i32" for n in ("MB1", "MB2", "MB3", "SB1", "SB2", "SB3")})
src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
path = os.path.join(sys.argv[2], "k.ptx")
open(path, "w").write(k.asm["ptx"])
out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                     capture_output=True, text=True)
print(out.stdout + out.stderr)
"""


@pytest.mark.parametrize("which", ["fwd", "dkdv", "dq", "decode"])
def test_mod_kernels_build_for_sm90(which: str, tmp_path) -> None:  # noqa: ANN001
    """No GPU needed: Triton compiles the varlen flex kernels (with the plans' options) and the
    decode kernel, each with a document-causal mask and ALiBi, for sm_90 (what a GPU would
    run), and its ptxas reports. A change that breaks their build, or makes them spill a
    kilobyte as 64-key varlen tiles did, fails on CPU too."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    run = subprocess.run([sys.executable, "-c", _SM90_MOD_BUILD, which, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", run.stdout)]
    assert spills and max(spills) <= 256, run.stdout


def test_hopper_build_failures_fall_back_to_the_triton_kernels(monkeypatch) -> None:  # noqa: ANN001
    """Where the Gluon kernels would run but fail to build, one warning per direction and the
    Triton kernels' results (the dispatch, on CPU: the Gluon launches themselves are broken)."""
    import warnings

    from flashlite import _caches
    from flashlite.kernels.attention import hopper as KH
    from flashlite.ops.attention.backends.tables import bwd as TB
    from flashlite.ops.attention.backends.tables import fwd as TF

    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))  # fmt: skip
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=128)  # fmt: skip
    go = torch.randn_like(q)

    def run() -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flashlite.flex_attention(*leaves, block_mask=bm)
        return (o.detach(), *torch.autograd.grad(o, leaves, go))

    want = run()

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute")

    _caches.clear()  # (the reference calls planned the Triton kernels)
    monkeypatch.setattr(TF, "hopper_config", lambda *a: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(TB, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(TF, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TB, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TF, "plan_flex_fwd", broken)
    monkeypatch.setattr(TB, "plan_flex_bwd", broken)
    monkeypatch.setattr(TF, "hopper_failed", set())
    monkeypatch.setattr(TB, "hopper_bwd_failed", set())
    with pytest.warns(RuntimeWarning) as caught:
        got = run()
    said = sorted(
        str(w.message).split(" kernel failed")[0] for w in caught if "Hopper" in str(w.message)
    )  # (not an old interpreter's numpy warnings)
    assert said == ["flashlite: the Hopper flex", "flashlite: the Hopper flex backward"], said
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = run()
    assert not [w for w in seen if "Hopper" in str(w.message)]  # no second warning
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


def test_fused_backward_receives_what_its_kernel_reads(monkeypatch) -> None:  # noqa: ANN001
    """The host side of the fused Hopper backward on CPU, with the Gluon launch replaced by a
    stand-in: it gets ``Qs = Q·scale·log2 e`` (as the forward rounded it) in dQ's memory, delta,
    a zeroed accumulator, the ``q_*`` tables with their strides and the mods; what it writes is
    what the call returns, and an LSE gradient reaches delta."""
    from flashlite.ops.attention.backends.tables import args as FA
    from flashlite.ops.attention.backends.tables import bwd as TB

    gen = torch.Generator().manual_seed(4)
    b, h, n, d = 2, 2, 40, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen).half() for _ in range(3))
    go, gl = torch.randn(b, h, n, d, generator=gen).half(), torch.randn(b, h, n, generator=gen)
    mm = gallery.document_causal(gallery.random_documents(b, n, 3, seed=2))
    bm = flashlite.create_block_mask(mm, b, None, n, n, device="cpu", BLOCK_SIZE=128)
    scale = d**-0.5
    seen = {}

    def stand_in(qs, k_, v_, do, lse, delta, dq, dk, dv, acc, tables, strides, scale_, bufs,
                 mods):  # noqa: ANN001, ANN202  # fmt: skip
        seen.update(qs_is_dq=qs is dq, acc_zero=bool((acc == 0).all()), mods=mods)
        seen.update(qs=qs.clone(), delta=delta, tables=tables, strides=strides)
        dq.fill_(1.0), dk.fill_(2.0), dv.fill_(3.0)
        return lambda *a: None  # (the plan's launch for later calls: none here)

    monkeypatch.setattr(TB, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(TB, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TB, "plan_flex_bwd", stand_in)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashlite.flex_attention(*leaves, block_mask=bm, return_lse=True)
    dq, dk, dv = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    assert seen["qs_is_dq"] and seen["acc_zero"]
    qs = (q.float() * (scale * math.log2(math.e))).half()  # (as the forward rounded it)
    torch.testing.assert_close(seen["qs"], qs, atol=0, rtol=0)
    want_delta = (o.detach().float() * go.float()).sum(-1) - gl
    torch.testing.assert_close(seen["delta"], want_delta, atol=2e-3, rtol=2e-3)
    assert all(a is w for a, w in zip(seen["tables"], (bm.q_num_blocks, bm.q_indices,
               bm.full_q_num_blocks, bm.full_q_indices), strict=True))  # fmt: skip
    assert seen["strides"] == FA.table_args(bm.q_num_blocks, bm.q_indices)
    assert seen["mods"]["MASK_MOD"] is mm.fn and not seen["mods"]["HAS_SCORE"]
