"""The byte counters themselves: the rules for torch ops, the interpreter's hooks restored
(after an error too), nested counters that each count everything, and compiled kernels refused."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from flashlite import traffic


def test_op_counter_rules() -> None:
    x = torch.randn(4, 8)
    with traffic.count_torch_ops() as ops:
        y = x.t().reshape(-1)  # transpose is a view; flattening it copies (clone)
        x.unsqueeze(0).expand(3, 4, 8)  # views: nothing moves
        z = torch.empty(4, 8)  # allocation: nothing moves
        z.copy_(x)  # write-only destination
        z.mul_(2.0)  # read and write in place
    n = 4 * 8 * 4
    assert ops.traffic.parts == {"clone": [n, n], "copy_": [n, n], "mul_": [n, n]}
    assert y.shape == (32,)
    assert traffic.tensor_bytes(x.unsqueeze(0).expand(5, 4, 8)) == n  # broadcast counts once


@pytest.mark.interpreter
def test_counters_restore_the_interpreter() -> None:
    from triton.runtime import interpreter

    before = interpreter.interpreter_builder.create_masked_load
    with traffic.count_kernels(), traffic.count_torch_ops():
        pass
    assert interpreter.interpreter_builder.create_masked_load == before
    assert "create_masked_load" not in vars(interpreter.interpreter_builder)


@pytest.mark.interpreter
def test_nested_kernel_counters_each_count_everything() -> None:
    # each counter holds its own counts (no module state): nested three deep, all see every byte
    dtype = torch.float16
    with traffic.count_kernels() as outer, traffic.count_kernels() as inner:
        innermost = traffic.count_softmax(3, 100, dtype, "online")
    model = traffic.model_softmax(3, 100, dtype, "online").total
    assert outer.traffic.total == inner.traffic.total == innermost.total == model


def test_memory_hooks_restore_on_error_and_name_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import triton
    from triton.runtime import interpreter

    from flashlite.traffic.hooks import interpreter_memory_hooks

    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    call = vars(executor)["__call__"]
    hooks = interpreter_memory_hooks(
        lambda *a: None, lambda *a: None, lambda name: contextlib.nullcontext()
    )
    with pytest.raises(KeyError), hooks:
        raise KeyError("inside")
    assert "create_masked_load" not in vars(builder) and vars(executor)["__call__"] is call
    monkeypatch.delattr(type(builder), "create_masked_store")  # a Triton without the hook point
    missing = pytest.raises(RuntimeError, match=f"triton {re.escape(triton.__version__)}")
    with missing, interpreter_memory_hooks(on_store=lambda *a: None):
        pass
    assert "create_masked_load" not in vars(builder)


def test_kernel_counting_refuses_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # where kernels are compiled (a CUDA machine) the interpreter hooks would see nothing
    from flashlite import _backend

    monkeypatch.setattr(_backend, "kernels_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), traffic.count_kernels():
        pass
    with traffic.count_torch_ops() as ops:  # torch ops need no interpreter
        torch.ones(4) + 1
    assert ops.traffic.total > 0
