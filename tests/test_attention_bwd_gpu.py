"""flashlite.attention's backward on a CUDA device (compiled kernels): long sequences and every
backward config, each gradient within 2x PyTorch's own low-precision error of fp32 math."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL

import flashlite
from flashlite.kernels import configs as C
from flashlite.masking.masks import describe
from flashlite.ops.attention import Request
from flashlite.reference import attention as ref_attention


def _gpu_case(q, k, v, causal, config=None):  # noqa: ANN001, ANN202
    """Largest gradient error of flashlite (optionally with a pinned backward config) and of
    PyTorch's own low-precision math attention, both against fp32 math on the GPU."""
    from flashlite.ops.attention import attention_bwd

    do = torch.randn_like(q)

    def grads(fn, *ts):  # noqa: ANN001, ANN202
        ts = [t.detach().clone().requires_grad_() for t in ts]
        fn(*ts).backward(do.to(ts[0].dtype))
        return [t.grad for t in ts]

    want = grads(lambda a, b, c: ref_attention(a, b, c, causal), q.float(), k.float(), v.float())
    torch_lp = grads(lambda a, b, c: ref_attention(a, b, c, causal), q, k, v)
    if config is None:
        got = grads(lambda a, b, c: flashlite.attention(a, b, c, causal=causal), q, k, v)
    else:
        o, lse = flashlite.attention(q, k, v, causal=causal, return_lse=True)
        got = attention_bwd(
            do,
            q,
            k,
            v,
            o,
            lse,
            None,
            Request.of_mask(describe(causal), q.shape[-1] ** -0.5),
            config=config,
        )
    for g, w, t in zip(got, want, torch_lp, strict=True):
        assert torch.isfinite(g).all()
        err = (g.float() - w).abs().max().item()
        torch_err = (t.float() - w).abs().max().item()
        assert err <= 2 * torch_err + TOL[q.dtype].floor * max(1.0, w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "nq,nk,d,hq,hkv",
    [
        (4096, 4096, 64, 2, 2),
        (2000, 3001, 128, 4, 2),
        (3001, 1000, 96, 2, 1),
        (16384, 16384, 128, 1, 1),
        (1024, 1024, 256, 2, 2),
    ],  # fmt: skip
)
def test_gpu_long(dtype, causal, nq, nk, d, hq, hkv) -> None:  # noqa: ANN001
    q = torch.randn(1, hq, nq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, hkv, nk, d, device="cuda", dtype=dtype) for _ in range(2))
    _gpu_case(q, k, v, causal)


def _backward_configs() -> list[C.BwdConfig]:
    return sorted({C.GPU_BWD_CONFIG, C.GPU_BWD_SMALL_CONFIG, C.CPU_BWD_CONFIG,
                   *C.HOPPER_BWD_CONFIGS.values()})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", _backward_configs(), ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_backward_config(config: C.BwdConfig, d: int) -> None:
    # every config the library can pick, where it picks it: the big tiles for 16-bit inputs up
    # to D = 128, the small ones everywhere; ragged lengths, Nq != Nk, GQA, causal
    small = config in (C.GPU_BWD_SMALL_CONFIG, C.CPU_BWD_CONFIG)
    for dtype in (torch.bfloat16, torch.float32):
        if not small and (dtype == torch.float32 or d > 128):
            continue
        q = torch.randn(1, 2, 300, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, 1, 257, d, device="cuda", dtype=dtype) for _ in range(2))
        _gpu_case(q, k, v, True, config)
