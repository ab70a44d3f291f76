"""cross_entropy's bad input and target checks: clear errors for bad arguments, a bad class
reported with its value by the call (or, on a GPU, by a later one) and the record reset, and
NaN rather than a crash without validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashlite
from flashlite.ops.cross_entropy import checks as oce_checks


def test_bad_input() -> None:
    x = torch.randn(4, 10)
    t = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        flashlite.cross_entropy(x, torch.tensor([0, 1, 10, 3]))
    with pytest.raises(ValueError, match="outside"):
        flashlite.cross_entropy(x, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(TypeError, match="class indices"):
        flashlite.cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="target"):
        flashlite.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="label_smoothing"):
        flashlite.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        flashlite.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="weight"):
        flashlite.cross_entropy(x, t, torch.ones(9))
    with pytest.raises(TypeError, match="dtype"):
        flashlite.cross_entropy(x.double(), t)
    # without validation a bad target gives NaN (loss and its gradient row), never a crash
    leaf = x.clone().requires_grad_()
    loss = flashlite.cross_entropy(leaf, torch.tensor([0, 10, 2, 3]), reduction="none",
                                   validate=False)  # fmt: skip
    loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    assert torch.isnan(leaf.grad[1]).all() and torch.isfinite(leaf.grad[[0, 2, 3]]).all()


def test_target_check_reports_the_class_and_resets() -> None:
    # CPU tensors: the device-side check is reported by the call itself, with the class and V;
    # the record is cleared once reported, so the next good call runs
    x = torch.randn(5, 7)
    with pytest.raises(ValueError, match=r"class 9, outside \[0, 7\) and not ignore_index=-1"):
        flashlite.cross_entropy(x, torch.tensor([0, -1, 9, 3, 12]), ignore_index=-1)
    with pytest.raises(ValueError, match=r"class -5, outside"):  # a sum checks too
        flashlite.cross_entropy(x, torch.tensor([0, -5, 2, 3, 4]), reduction="sum",
                                validate="sync")  # fmt: skip
    got = flashlite.cross_entropy(x, torch.tensor([0, 6, 2, 3, 4], dtype=torch.int32))
    want = F.cross_entropy(x.double(), torch.tensor([0, 6, 2, 3, 4]))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # ignore_index may be any integer, a valid class or far outside int32
    for ii in (2, -(2**40)):
        t = torch.tensor([0, ii, 2, 3, 4])
        got = flashlite.cross_entropy(x, t, ignore_index=ii)
        torch.testing.assert_close(got.double(), F.cross_entropy(x.double(), t, ignore_index=ii),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="validate"):
            flashlite.cross_entropy(x, torch.tensor([0, 1, 2, 3, 4]), validate=bad)


def test_an_earlier_calls_bad_target_is_reported_as_earlier() -> None:
    # a record left by an earlier call (on a GPU: one whose check had not landed when it
    # returned) is reported as that call's, before this call's own targets are checked

    flag = oce_checks._bad_record(torch.device("cpu"))[0]
    flag.copy_(torch.tensor([1, 42, 7]))
    x, t = torch.randn(3, 7), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"an earlier .* class 42, outside \[0, 7\)"):
        flashlite.cross_entropy(x, t, validate="sync")
    assert flag.tolist() == [0, 0, 0]
    flag.copy_(torch.tensor([1, 42, 7]))
    with pytest.raises(ValueError, match=r"an earlier .* class 42"):
        flashlite.linear_cross_entropy(x, torch.randn(7, 7), t)
    assert torch.isfinite(flashlite.cross_entropy(x, t))  # reported once


@pytest.mark.gpu
def test_gpu_linear_bad_target_reported_without_a_sync() -> None:
    # linear cross-entropy checks its targets as cross_entropy does: on the device, in the launch
    # that computes the mean's divisor (no host sync), reported by a later call of either
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden = torch.randn(6, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 32, device="cuda", dtype=torch.bfloat16)
    good = torch.randint(0, 1000, (6,), device="cuda")
    bad = good.clone()
    bad[2] = 1005
    loss = flashlite.linear_cross_entropy(hidden, weight, bad, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[:2]).all()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"earlier .* class 1005, outside \[0, 1000\)"):
        flashlite.linear_cross_entropy(hidden, weight, good)
    assert torch.isfinite(flashlite.linear_cross_entropy(hidden, weight, good))  # reported once
    with pytest.raises(ValueError, match=r"class 1005, outside \[0, 1000\) and not"):
        flashlite.linear_cross_entropy(hidden, weight, bad, validate="sync")
    assert torch.isnan(flashlite.linear_cross_entropy(hidden, weight, bad, validate=False))
    torch.cuda.synchronize()
    assert torch.isfinite(flashlite.cross_entropy(hidden @ weight.t(), good))  # nothing recorded


@pytest.mark.gpu
def test_gpu_bad_target_reported_by_a_later_call() -> None:
    # validate=True on a GPU: no host sync; the bad target's row is NaN and the next call
    # that finds the device's check finished raises; validate="sync" raises at the call

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for v in (1000, 65536):  # the Triton kernel and, for 64k, the Gluon one
        x = torch.randn(6, v, device="cuda", dtype=torch.bfloat16)
        good = torch.randint(0, v, (6,), device="cuda")
        bad = good.clone()
        bad[4] = v + 3
        loss = flashlite.cross_entropy(x, bad, reduction="none")
        assert torch.isnan(loss[4]) and torch.isfinite(loss[:4]).all()
        torch.cuda.synchronize()
        # the kernel set the record's host flag itself (pinned memory, no copy launched)
        assert oce_checks._bad_record(x.device)[1].tolist() == [1]
        with pytest.raises(ValueError, match=rf"earlier .* class {v + 3}, outside \[0, {v}\)"):
            flashlite.cross_entropy(x, good)
        assert torch.isfinite(flashlite.cross_entropy(x, good))  # reported once
        with pytest.raises(ValueError, match=rf"class {v + 3}, outside \[0, {v}\) and not"):
            flashlite.cross_entropy(x, bad, validate="sync")
        loss = flashlite.cross_entropy(x, bad, validate=False)  # unchecked: NaN, no report
        torch.cuda.synchronize()
        assert torch.isnan(loss) and torch.isfinite(flashlite.cross_entropy(x, good))
