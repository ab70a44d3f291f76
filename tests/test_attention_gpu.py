"""flashlite.attention on a CUDA device (compiled kernels): long sequences, every config of the
tables, the Hopper kernel's measured configs, and CPU tensors on a machine with a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
from attention_helpers import DTYPES, _rows_reference, assert_close_to_reference, rand

import flashlite
from flashlite.kernels.configs import (
    GPU_CONFIGS,
    HOPPER_CONFIGS,
    default_config,
    keep_config,
)
from flashlite.masking.masks import describe
from flashlite.ops.attention import (
    HOPPER_ENV,
    Request,
    attention_fwd,
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,d,hq,hkv", [
    (4096, 4096, 128, 16, 16),  # the benchmark shape family, autotuned
    (16384, 16384, 64, 4, 2),  # long, GQA
    (1000, 3001, 111, 4, 1),  # odd lengths, odd head dim (pointer loads), MQA
    (3001, 1000, 59, 2, 2),  # Nq > Nk: fully masked rows when causal
    (777, 777, 256, 2, 2),  # largest head dim
])  # fmt: skip
def test_gpu_long(dtype, causal, nq, nk, d, hq, hkv) -> None:
    q = rand(1, hq, nq, d, dtype=dtype, device="cuda")
    k, v = (
        rand(1, hkv, nk, d, dtype=dtype, device="cuda"),
        rand(1, hkv, nk, d, dtype=dtype, device="cuda"),
    )
    if (nq, d) == (4096, 128) and dtype != torch.float32:
        out, lse = flashlite.attention(q, k, v, causal=causal, return_lse=True)  # autotuned
    else:  # one fitting config: autotuning every specialisation here would cost minutes
        cfg = default_config(max(16, triton.next_power_of_2(d)), q.element_size(), False)
        out, lse, _ = attention_fwd(q, k, v, Request.of_mask(describe(causal), d**-0.5), config=cfg)
    assert torch.isfinite(out).all() and out.dtype == dtype
    assert torch.isfinite(lse[:, :, max(0, nq - nk) :]).all()
    rows = torch.unique(
        torch.cat([torch.arange(0, nq, max(1, nq // 97)), torch.tensor([nq - 1])])
    ).cuda()
    ref = _rows_reference(q, k, v, causal, rows)
    err = (out[:, :, rows].double() - ref).abs().max().item()
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert err <= tol, err


@pytest.mark.gpu
def test_gpu_every_config_is_correct() -> None:
    # Triton has returned NaN for some warp-specialised configs: every config must be right
    for causal in (False, True):
        for d in (64, 128):
            q, k, v = (rand(2, 4, 1500, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            rows = torch.arange(0, 1500, 7, device="cuda")
            ref = _rows_reference(q, k, v, causal, rows)
            for cfg in dict.fromkeys([*GPU_CONFIGS, *HOPPER_CONFIGS.values()]):
                if not keep_config(cfg, d, 2, True):
                    continue
                out = attention_fwd(
                    q, k, v, Request.of_mask(describe(causal), d**-0.5), config=cfg
                )[0]
                err = (out[:, :, rows].double() - ref).abs().max().item()
                assert err < 3e-2, (cfg, d, causal, err)


@pytest.mark.gpu
def test_gpu_hopper_runs_the_measured_configs(monkeypatch) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("HOPPER_CONFIGS apply to sm_90 only")
    monkeypatch.setenv(HOPPER_ENV, "0")  # the Triton kernel's table (D=128 runs Gluon otherwise)
    for (block_d, causal), cfg in HOPPER_CONFIGS.items():
        q, k, v = (rand(1, 2, 300, block_d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        # descriptor loads: the table serves problems past DESC_MIN_WORK
        out, lse, info = attention_fwd(
            q, k, v, Request.of_mask(describe(causal), block_d**-0.5), use_desc=True
        )
        assert info is not None
        c = info.config
        assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == cfg[:4]
        assert (c.lazy_rescale, c.overlap) == cfg[5:]
        assert_close_to_reference(out.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, lse=lse.cpu())


@pytest.mark.gpu
def test_gpu_cpu_tensors_still_work_on_a_cuda_machine() -> None:
    # CPU tensors go to the GPU and back (same strides: slices of one packed qkv buffer too)
    qkv = rand(1, 20, 3, 2, 16)
    q, k, v = qkv.unbind(2)
    out = flashlite.attention(q, k, v, layout="b n h d", causal=True)
    assert out.device.type == "cpu"
    assert_close_to_reference(*(t.transpose(1, 2) for t in (out, q, k, v)), True)
    x = torch.randn(3, 1000)
    torch.testing.assert_close(flashlite.softmax(x), torch.softmax(x, -1))
    # and compiling for the GPU still works afterwards (a leaked interpreter patch broke it)
    qc = rand(1, 2, 20, 48, device="cuda")
    assert_close_to_reference(flashlite.attention(qc, qc, qc).cpu(), *(qc.cpu(),) * 3)
