"""Shared test setup: seeding, the per-dtype tolerance table, the ``gpu`` marker and devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

import flashlite  # noqa: F401  (switches on the interpreter before any test imports triton)
from flashlite import _backend, _caches


class Tol(NamedTuple):
    """Tolerances against an fp64 reference, one row per dtype."""

    #: softmax-family outputs and gradients: ``assert_close(atol, rtol)``
    atol: float
    rtol: float
    #: attention: absolute floor on top of 2x PyTorch's own low-precision error (flash-attn's rule)
    floor: float


#: The one tolerance table. fp32 leaves room for exp2-vs-exp and summation-order differences;
#: fp16/bf16 are about 2x one rounding of the output (the kernels compute in fp32 and round once
#: on the store).
TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(1e-5, 1e-5, 2e-5),
    torch.float16: Tol(1e-3, 2e-3, 1e-3),
    torch.bfloat16: Tol(8e-3, 1.6e-2, 8e-3),
}

# Correctness tests also run compiled: each parametrisation compiles a small graph of its own.
torch._dynamo.config.recompile_limit = 1_000_000
torch._dynamo.config.accumulated_recompile_limit = 1_000_000


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def use_compile(request: pytest.FixtureRequest) -> bool:
    """Run the test's flashlite calls eagerly, then under ``torch.compile``."""
    return request.param


def maybe_compile(fn: Callable[..., Any], use_compile: bool) -> Callable[..., Any]:
    """``fn``, or ``fn`` under ``torch.compile(fullgraph=True, dynamic=True)`` (a graph break
    fails the test)."""
    return torch.compile(fn, fullgraph=True, dynamic=True) if use_compile else fn


def devices() -> list[str]:
    """Devices every device-parametrised test runs on: CPU always, CUDA when there is one."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices())
def device(request: pytest.FixtureRequest) -> str:
    """Parametrise a test over :func:`devices`."""
    return request.param


@pytest.fixture(autouse=True)
def _fresh_plans(request: pytest.FixtureRequest) -> Any:
    """A test that monkeypatches (config tables, kernel choices) plans with what it patched, and
    leaves no plan made under its patches to the tests after it."""
    patches = "monkeypatch" in request.fixturenames
    if patches:
        _caches.clear()
    yield
    if patches:
        _caches.clear()


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
