"""Shared test setup: seeding, the per-dtype tolerance table, the ``gpu`` marker and devices."""

from __future__ import annotations

import pytest
import torch

import flashlite  # noqa: F401  (switches on the interpreter before any test imports triton)
from flashlite import _backend

#: (atol, rtol) per dtype for results compared against an fp64 reference. fp32 leaves room for
#: exp2-vs-exp and summation-order differences; fp16/bf16 are about 2x one rounding of the output
#: (the kernels compute in fp32 and round once on the store).
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}


def devices() -> list[str]:
    """Devices every device-parametrised test runs on: CPU always, CUDA when there is one."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices())
def device(request: pytest.FixtureRequest) -> str:
    """Parametrise a test over :func:`devices`."""
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    # Same random inputs on every run and whatever order tests run in.
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    compiled = pytest.mark.skip(
        reason="counts kernels in Triton's interpreter, off in this process (CUDA machine): "
        "run these with TRITON_INTERPRET=1"
    )
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "interpreter" in item.keywords and not _backend.kernels_interpreted():
            item.add_marker(compiled)
