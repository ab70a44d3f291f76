"""The Hopper (Gluon) attention forward: chosen only where it runs and only for plain forwards,
a failed build falls back, it builds for sm_90 without spills or serialised wgmma (no GPU
needed), and on an sm_90 GPU it matches the reference and trains like the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import _rows_reference, assert_close_to_reference, rand

import flashlite
from flashlite.kernels.attention import hopper as KH
from flashlite.kernels.configs import (
    Config,
)
from flashlite.masking.masks import CAUSAL, describe
from flashlite.ops.attention import (
    HOPPER_ENV,
    Request,
    attention_fwd,
    empty_output,
    hopper_config,
)
from flashlite.ops.attention.backends import hopper as HP


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
    import flashlite.ops.attention.ops as ops

    def broken(*args, **kwargs):
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    monkeypatch.setattr(ops.planner, "hopper_config", lambda q, n: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(ops.planner.hopper, "plan_fwd_hopper", broken)
    monkeypatch.setattr(ops.planner.hopper, "fwd_failed", set())
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
    # instead, where they apply: the tables backend, tested in test_flex_window.py)
    import flashlite.ops.attention.ops as ops

    calls = []
    monkeypatch.setattr(ops.planner, "hopper_config", lambda q, n: KH.HopperConfig(128, 128, 3))
    # (a spy that records the ask and hands over the Triton kernel's plan)
    monkeypatch.setattr(ops.planner.hopper, "plan_fwd", lambda *a: calls.append(a) or a[-1]())
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
