"""flashlite._backend: which Triton runs a kernel, and the interpreter's quirks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashlite
from flashlite import _backend

# A process that imports triton before flashlite keeps compiled @triton.jit functions: CPU
# tensors must still run the same kernels (in the interpreter without a GPU; on a CUDA machine
# through the GPU and back).
MIXED = textwrap.dedent(
    """
    import os, triton
    import torch, flashlite
    from triton.runtime.jit import JITFunction
    from flashlite.kernels import attention_fwd, softmax
    assert os.environ.get("TRITON_INTERPRET") != "1"
    assert isinstance(softmax._softmax_single_read_fwd_kernel, JITFunction)
    torch.manual_seed(0)
    x = torch.randn(3, 100, requires_grad=True)
    y = flashlite.log_softmax(x)
    y.sum().backward()
    xr = x.detach().double().requires_grad_()
    torch.log_softmax(xr, -1).sum().backward()
    assert (y.double() - torch.log_softmax(xr, -1)).abs().max() < 1e-5
    assert (x.grad.double() - xr.grad).abs().max() < 1e-5
    q, k, v = (torch.randn(1, 2, 33, 40) for _ in range(3))
    o, lse = flashlite.attention(q, k, v, causal=True, return_lse=True)
    ref = flashlite.reference.attention(q, k, v, True, upcast=True)
    assert (o.double() - ref).abs().max() < 1e-5
    print("ok")
    """
)


def test_cpu_tensors_run_where_kernels_are_compiled() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", MIXED], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_other_devices_get_a_clear_error() -> None:
    x = torch.empty(2, 3, device="meta")
    with pytest.raises(ValueError, match="x is on device meta"):
        flashlite.softmax(x)
    with pytest.raises(ValueError, match="q is on device meta"):
        flashlite.attention(*(torch.empty(1, 1, 2, 16, device="meta") for _ in range(3)))


def test_bf16_dots_are_upcast_only_in_the_interpreter() -> None:
    cpu = torch.device("cpu")  # interpreted unless a CUDA machine compiles them
    assert _backend.dot_upcast(torch.bfloat16, cpu) == _backend.kernels_interpreted()
    assert not _backend.dot_upcast(torch.float16, cpu)
    assert not _backend.dot_upcast(torch.float32, cpu)
