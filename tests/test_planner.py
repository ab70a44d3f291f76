"""The planner's plans as data: what each backend's plan holds (tile, grid, splits, workspaces,
what the launch reports), that a plan is made once per kind of call and kept, and that a Gluon
plan whose kernel does not build becomes its Triton plan."""

from __future__ import annotations

import pytest
import torch

from flashlite import _caches
from flashlite.kernels import configs as C
from flashlite.ops.attention import Plan, Request, attention_fwd, planner
from flashlite.ops.attention.backends.common import empty_output
from flashlite.reference import attention as ref_attention


def _views(b: int, hq: int, hkv: int, nq: int, nk: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, nq, d, generator=g)
    return q, torch.randn(b, hkv, nk, d, generator=g), torch.randn(b, hkv, nk, d, generator=g)


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_output(q), torch.empty(q.shape[:3])


def test_a_triton_forward_plan_holds_its_tile_grid_and_launch() -> None:
    _caches.clear()
    q, k, v = _views(2, 4, 2, 40, 40)
    request = Request.make(True, 0.25)
    plan = planner.forward(q, k, v, *_outputs(q), request)
    assert plan.backend == "triton" and plan.config == C.CPU_CONFIG and not plan.use_desc
    assert plan.grid == (C.cdiv(40, C.CPU_CONFIG.block_m), 2 * 4, 1)
    assert plan.splits == 1 and plan.workspaces == ()
    assert plan.info is not None and plan.info.config == plan.config
    # kept: the next call of its kind gets the same plan, and its launch gives the answer
    o, lse = _outputs(q)
    assert planner.forward(q, k, v, o, lse, request) is plan
    plan.launch(q, k, v, o, lse, request)
    torch.testing.assert_close(o, ref_attention(q, k, v, True, 0.25), atol=2e-5, rtol=1e-5)
    # another kind (a longer sequence) is planned anew; a pinned call's plan is not kept
    q2, k2, v2 = _views(2, 4, 2, 41, 41)
    assert planner.forward(q2, k2, v2, *_outputs(q2), request) is not plan
    pinned = planner.forward(q, k, v, *_outputs(q), request, config=C.Config(32, 32, 4, 1))
    assert pinned.config == C.Config(32, 32, 4, 1) and pinned is not plan
    assert planner.forward(q, k, v, *_outputs(q), request) is plan


def test_a_split_kv_plan_holds_its_splits_and_partials() -> None:
    _caches.clear()
    q, k, v = _views(2, 8, 2, 1, 300)
    request = Request.make(False, 0.25, num_splits=3)
    plan = planner.forward(q, k, v, *_outputs(q), request)
    assert plan.backend == "split_kv" and plan.splits == 3 and plan.grid[2] == 3
    (parts,) = plan.workspaces
    # the partial outputs (splits × B × Hq × Nq × D) and LSEs, one fp32 buffer
    assert parts.name == "partials" and parts.dtype == torch.float32
    assert parts.nbytes >= 4 * 3 * 2 * 8 * 1 * (16 + 1)
    o, lse = attention_fwd(q, k, v, request)[:2]
    torch.testing.assert_close(o, ref_attention(q, k, v, False, 0.25), atol=2e-5, rtol=1e-5)
    assert planner.forward(q, k, v, *_outputs(q), request) is plan


@pytest.mark.parametrize("nq, nk", [(0, 8), (8, 0)])
def test_nothing_to_compute_is_the_empty_plan(nq: int, nk: int) -> None:
    q, k, v = _views(1, 2, 2, nq, nk)
    plan = planner.forward(q, k, v, *_outputs(q), Request.make(True, 0.25))
    assert plan.backend == "empty" and plan.info is None
    do = torch.ones_like(q)
    o, lse = _outputs(q)
    bwd = planner.backward(do, q, k, v, o, lse, None, Request.make(True, 0.25))
    assert bwd.backend == "empty"


def test_backward_plans_name_their_scratch_and_are_kept_when_plain() -> None:
    _caches.clear()
    q, k, v = _views(1, 4, 2, 40, 40)
    request = Request.make(True, 0.25)
    o, lse, _ = attention_fwd(q, k, v, request)
    do = torch.randn_like(o)
    plain = planner.backward(do, q, k, v, o, lse, None, request)
    assert plain.backend == "triton" and plain.config == C.CPU_BWD_CONFIG
    assert [w.name for w in plain.workspaces] == ["delta"]
    assert plain.workspaces[0].shape == (1, 4, 40)
    assert planner.backward(do, q, k, v, o, lse, None, request) is plain
    capped = Request.make(True, 0.25, softcap=5.0)
    masked = planner.backward(do, q, k, v, o, lse, None, capped)
    assert masked.backend == "triton" and masked is not plain
    assert planner.backward(do, q, k, v, o, lse, None, capped) is not masked  # (per call)


def test_a_gluon_plan_that_does_not_build_becomes_its_triton_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan the planner keeps says what really runs: a Hopper plan whose first launch
    fails to build (forced here) takes its Triton plan's backend, tile, grid and launch."""
    from flashlite.kernels.attention import hopper as KH

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("a Gluon this Triton does not have")

    _caches.clear()
    monkeypatch.setattr(planner, "hopper_config", lambda q, n: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(planner.hopper, "plan_fwd_hopper", broken)
    monkeypatch.setattr(planner.hopper, "fwd_failed", set())
    q, k, v = _views(1, 2, 2, 40, 40)
    request = Request.make(True, 0.25)
    with pytest.warns(RuntimeWarning, match="failed to build"):
        # (use_desc forces the dense tree's Gluon branch; a pinned plan is not kept)
        o, lse = _outputs(q)
        plan = planner.forward(q, k, v, o, lse, request, use_desc=False)
        assert plan.backend == "triton"  # (pointer loads: the Gluon kernel is never asked)
        monkeypatch.setattr(planner, "small_problem", lambda q, k: False)
        monkeypatch.setattr(planner, "descriptor_ok", lambda *t: True)
        plan = planner.forward(q, k, v, o, lse, request)
        assert plan.backend == "hopper" and plan.fallback is not None
        plan.launch(q, k, v, o, lse, request)
    assert isinstance(plan, Plan) and plan.backend == "triton" and plan.fallback is None
    assert plan.config is not None and not plan.config.warp_specialize
    torch.testing.assert_close(o, ref_attention(q, k, v, True, 0.25), atol=2e-5, rtol=1e-5)
    assert planner.forward(q, k, v, *_outputs(q), request) is plan  # the kept plan, become
