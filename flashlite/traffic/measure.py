"""Measured DRAM bytes of one attention call on a GPU, from Nsight Compute.

``ncu`` runs a child process (:func:`_child_main`) that calls the method once per shape inside
its own NVTX range, and reads ``dram__bytes_read.sum`` / ``dram__bytes_write.sum`` of the
kernels in those ranges. Measured differs from the model and the count (L2 reuse of K/V across
query blocks, caches, ECC, prefetch): ``docs/how-it-works/hbm-traffic.md`` explains.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashlite.ops import softmax as softmax_ops
from flashlite.traffic.count import BACKWARD_METHODS, attention_bwd_fn, attention_fn
from flashlite.traffic.model import flashlite_config
from flashlite.traffic.ncu import KernelMetrics, find_ncu, ncu_command, parse_ncu_csv
from flashlite.traffic.shapes import ATTENTION_METHODS, AttentionShape, Traffic, make_inputs


def _range_name(i: int) -> str:
    # fixed width so no range name is a prefix of another
    return f"flt_{i:04d}_"


_RANGE_RE = re.compile(r"flt_(\d{4})_")


def _warm_up(fn: Callable[[], Any]) -> None:
    for _ in range(2):  # compile and autotune outside the measured range
        fn()
    torch.cuda.synchronize()


def _measure_once(i: int, fn: Callable[[], Any]) -> None:
    """One call of ``fn`` inside the NVTX range ncu profiles as number ``i``."""
    torch.cuda.nvtx.range_push(_range_name(i))
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def _softmax_child(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """The softmax half of :func:`_child_main`: one range per algorithm (``torch`` too)."""
    dtype = getattr(torch, spec["dtype"])
    for i, algorithm in enumerate(spec["algorithms"]):
        try:
            x = torch.randn(spec["rows"], spec["n"], device=spec.get("device", "cuda")).to(dtype)
            y = torch.empty_like(x)
            if algorithm == "torch":
                fn: Callable[[], Any] = lambda x=x: torch.softmax(x, -1)  # noqa: E731
            else:
                fn = lambda x=x, y=y, a=algorithm: softmax_ops.softmax_fwd(x, y, False, a)  # noqa: E731
            _warm_up(fn)
            _measure_once(i, fn)
            del x, y
        except Exception as e:  # e.g. the team kernel without cooperative launches
            report["errors"][i] = f"{type(e).__name__}: {e}"


def _attention_child(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """The attention half of :func:`_child_main`: one range per shape."""
    for i, d in enumerate(spec["shapes"]):
        shape = AttentionShape.from_json(d)
        try:
            q, k, v = make_inputs(shape, spec.get("device", "cuda"))
            call = attention_fn(spec["method"], shape)
            fn: Callable[[], Any] = lambda call=call, q=q, k=k, v=v: call(q, k, v)  # noqa: E731
            _warm_up(fn)
            if spec["method"] == "flashlite":
                with contextlib.suppress(Exception):
                    report["configs"][i] = flashlite_config(shape, "cuda")
            _measure_once(i, fn)
            del q, k, v
        except Exception as e:  # unsupported by this backend: recorded, the others go on
            report["errors"][i] = f"{type(e).__name__}: {e}"


def _attention_bwd_child(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """The backward's half of :func:`_child_main`: one range per shape, holding only the
    backward (its forward runs before the range, in :func:`attention_bwd_fn`)."""
    for i, d in enumerate(spec["shapes"]):
        shape = AttentionShape.from_json(d)
        try:
            fn = attention_bwd_fn(spec["method"], shape, spec.get("device", "cuda"))
            _warm_up(fn)
            _measure_once(i, fn)
            del fn
        except Exception as e:  # e.g. naive's N x N intermediates out of memory
            report["errors"][i] = f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache()


def _decode_call(method: str, shape: AttentionShape, device: str) -> Callable[[], Any]:
    """One decode call of ``method`` against full caches of ``Nk`` keys."""
    from flashlite import reference
    from flashlite.masking import masks
    from flashlite.ops.attention import attention_decode_fwd
    from flashlite.ops.attention.backends.split_kv.decode import descale_args
    from flashlite.ops.attention.fp8 import factor_views

    q, k, v = make_inputs(shape, device)
    descales = None
    if shape.fp8:  # an e4m3 cache read by bf16 queries (as count_decode runs it)
        q = q.to(torch.bfloat16)
        ones = dict.fromkeys(("q_descale", "k_descale", "v_descale"))  # (all 1)
        descales = descale_args(*factor_views(ones, shape.batch, shape.hkv, q))
        if method == "naive":  # (widened to bf16 first)
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    if method == "naive":
        return lambda: reference.attention(q, k, v, causal=True)
    lengths = torch.full((shape.batch,), shape.nk, dtype=torch.int32, device=q.device)
    scale = shape.head_dim**-0.5
    return lambda: attention_decode_fwd(q, k, v, lengths, masks.CAUSAL, scale, descales=descales)


def _each_range(report: dict[str, Any], makers: Sequence[Callable[[], Callable[[], Any]]]) -> None:
    """Range ``i`` holds one call of what ``makers[i]()`` returns (made, then warmed up, outside
    the range); a failure is recorded in ``report["errors"]`` and the others go on."""
    for i, make in enumerate(makers):
        try:
            fn = make()
            _warm_up(fn)
            _measure_once(i, fn)
            del fn
        except Exception as e:  # e.g. the reference's N x N intermediates out of memory
            report["errors"][i] = f"{type(e).__name__}: {e}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _decode_child(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """Decoding's half of :func:`_child_main`: one range per shape, holding one call of the
    decode kernel (and its combine) against full caches, or of the materialising reference."""
    device = spec.get("device", "cuda")
    _each_range(
        report,
        [
            lambda d=d: _decode_call(spec["method"], AttentionShape.from_json(d), device)
            for d in spec["shapes"]
        ],
    )


def _flex_child(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """Block-sparse attention's half of :func:`_child_main`: one range per (method, shape) call
    of ``spec["calls"]`` (:func:`~flashlite.traffic.sparse_calls.sparse_call`), its tables built
    before the range."""
    from flashlite.traffic.sparse_calls import sparse_call

    mask, docs, block = spec["mask"], spec["docs"], tuple(spec["block"])
    device = spec.get("device", "cuda")
    _each_range(
        report,
        [
            lambda m=m, d=d: sparse_call(m, AttentionShape.from_json(d), mask, docs, block, device)
            for m, d in spec["calls"]
        ],
    )


_CHILDREN = {
    "attention": _attention_child,
    "attention_bwd": _attention_bwd_child,
    "decode": _decode_child,
    "flex": _flex_child,
    "softmax": _softmax_child,
}


def _child_main(spec_path: str) -> None:
    """Run inside ncu: warm up (autotune) every config, then one measured call per NVTX range."""
    with open(spec_path) as f:
        spec = json.load(f)
    report: dict[str, Any] = {"errors": {}, "configs": {}}
    _CHILDREN[spec.get("kind", "attention")](spec, report)
    with open(spec["report"], "w") as f:
        json.dump(report, f)


@dataclass
class Measurement:
    """Measured DRAM traffic per shape (None where unavailable) and why any is missing."""

    traffic: list[Traffic | None]
    message: str = ""
    configs: dict[int, dict[str, int]] = field(default_factory=dict)
    kernels: list[list[KernelMetrics]] = field(default_factory=list)


def _run_ncu(
    ncu: str,
    method: str,
    shapes: Sequence[AttentionShape],
    rename: bool,
    timeout: float,
    kind: str = "attention",
) -> tuple[list[KernelMetrics], dict[str, Any], str]:
    """One ncu process over a child that runs every shape; returns (kernels, report, error)."""
    spec = {"kind": kind, "method": method, "shapes": [s.to_json() for s in shapes]}
    return _run_ncu_spec(ncu, spec, len(shapes), rename, timeout)


def _run_ncu_spec(
    ncu: str, spec: dict[str, Any], n_ranges: int, rename: bool, timeout: float
) -> tuple[list[KernelMetrics], dict[str, Any], str]:
    """One ncu process over a child that runs ``spec``'s ``n_ranges`` calls."""
    with tempfile.TemporaryDirectory(prefix="flashlite-ncu-") as tmp:
        spec_path, report_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "report.json")
        with open(spec_path, "w") as f:
            json.dump({**spec, "report": report_path}, f)
        child = [
            sys.executable,
            "-c",
            "import sys; from flashlite.traffic.measure import _child_main; "
            "_child_main(sys.argv[1])",
            spec_path,
        ]
        cmd = ncu_command(ncu, [_range_name(i) for i in range(n_ranges)], rename) + child
        try:
            # the child runs compiled kernels even where this process interprets them (counting)
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return [], {}, f"ncu timed out after {timeout:.0f} s"
        except OSError as e:
            return [], {}, f"could not start ncu: {e}"
        out = proc.stdout + "\n" + proc.stderr
        if "ERR_NVGPUCTRPERM" in out:
            why = "ncu is not permitted to read GPU performance counters (ERR_NVGPUCTRPERM)"
            return [], {}, why + ": run as root or enable profiling for all users"
        report: dict[str, Any] = {}
        if os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)
        kernels = parse_ncu_csv(proc.stdout)
        if proc.returncode != 0 and not kernels:
            tail = "\n".join(out.strip().splitlines()[-8:])
            return [], report, f"ncu exited with status {proc.returncode}:\n{tail}"
        return kernels, report, ""


def measure_attention(
    method: str,
    shapes: Sequence[AttentionShape],
    *,
    timeout: float = 600.0,
    progress: Callable[[str], None] | None = None,
    backward: bool = False,
    decode: bool = False,
) -> Measurement:
    """Measured DRAM bytes of one call of ``method`` for each shape, with Nsight Compute; with
    ``backward``, of one backward alone (``method`` naive or flashlite; the forward runs outside
    the measured range); with ``decode``, of one decode-kernel call (naive: the materialising
    reference) against full caches of ``Nk`` keys.

    One child process runs every shape (warm-up and autotune first, then the measured call inside
    its own NVTX range); ncu profiles only the kernels inside those ranges, flushing caches
    before each (``--cache-control all``), and the per-kernel bytes are summed per range.

    Never raises for a missing GPU or profiler: the result is None per shape and ``message`` says
    why (no CUDA, ncu missing, counters not permitted, backend unsupported for a shape).
    """
    allowed = BACKWARD_METHODS if backward or decode else ATTENTION_METHODS
    if method not in allowed:
        raise ValueError(f"method={method!r} is not one of {', '.join(allowed)}")
    kind = "attention_bwd" if backward else "decode" if decode else "attention"
    none = [None] * len(shapes)
    if not torch.cuda.is_available():
        return Measurement(list(none), "measured: no CUDA device, DRAM bytes need a GPU")
    ncu = find_ncu()
    if ncu is None:
        return Measurement(
            list(none),
            "measured: ncu (Nsight Compute CLI) not found; set $NCU "
            "or install it under /usr/local/cuda/bin",
        )
    if progress:
        progress(f"{method}: ncu over {len(shapes)} shape(s)")
    kernels, report, error = _run_ncu(ncu, method, shapes, True, timeout, kind)
    groups: list[list[KernelMetrics]] = [[] for _ in shapes]
    fatal = ("not permitted", "timed out", "could not start")
    if error and any(f in error for f in fatal):
        return Measurement(list(none), f"measured ({method}): {error}")
    if not error and all(_RANGE_RE.search(k.name) for k in kernels):
        for k in kernels:
            groups[int(_RANGE_RE.search(k.name).group(1))].append(k)  # type: ignore[union-attr]
    elif not error and len(shapes) == 1:
        groups[0] = kernels
    else:  # this ncu did not rename kernels after their ranges (or refused the option)
        report, error = _ncu_per_shape(ncu, method, shapes, timeout, kind, groups, progress)
    if error:
        return Measurement(list(none), f"measured ({method}): {error}")
    errors = {int(i): e for i, e in report.get("errors", {}).items()}
    for i, group in enumerate(groups):
        if not group and i not in errors:
            # e.g. naive's backward: autograd launches it from its own thread, and the range
            # that selects the kernels was pushed on the child's main thread
            errors[i] = "ncu saw no kernel inside the measured range"
    traffic: list[Traffic | None] = []
    for i, group in enumerate(groups):
        if i in errors or not group or any(math.isnan(k.read + k.write) for k in group):
            traffic.append(None)
            continue
        t = Traffic()
        for k in group:
            t.add(k.name, round(k.read), round(k.write))
        traffic.append(t)
    message = "; ".join(f"{method} shape {i}: {e}" for i, e in sorted(errors.items()))
    configs = {int(i): c for i, c in report.get("configs", {}).items()}
    return Measurement(traffic, message, configs, groups)


def _ncu_per_shape(
    ncu: str,
    method: str,
    shapes: Sequence[AttentionShape],
    timeout: float,
    kind: str,
    groups: list[list[KernelMetrics]],
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, Any], str]:
    """:func:`measure_attention`'s fallback, one ncu process per shape (slower but unambiguous):
    fills ``groups`` and returns the shapes' report and the first error ("" if none)."""
    report: dict[str, Any] = {}
    error = ""
    for i, shape in enumerate(shapes):
        if progress:
            progress(f"{method}: shape {i + 1}/{len(shapes)} (one ncu each)")
        ks, rep, error = _run_ncu(ncu, method, [shape], False, timeout, kind)
        if error:
            break
        groups[i] = ks
        # the child numbered its only shape 0; renumber to this shape's index
        for key in ("errors", "configs"):
            if "0" in rep.get(key, {}):
                report.setdefault(key, {})[str(i)] = rep[key]["0"]
    return report, error


def _ranges(
    spec: dict[str, Any], n_ranges: int, timeout: float, what: str
) -> tuple[list[Traffic | None], dict[str, str], str]:
    """One ncu run over ``spec``'s ``n_ranges`` calls, its kernels summed per range: ``(traffic
    per range, the child's errors by range, why nothing was measured or "")``."""
    out: list[Traffic | None] = [None] * n_ranges
    if not torch.cuda.is_available():
        return out, {}, "measured: no CUDA device, DRAM bytes need a GPU"
    ncu = find_ncu()
    if ncu is None:
        return out, {}, "measured: ncu (Nsight Compute CLI) not found; set $NCU"
    kernels, report, error = _run_ncu_spec(ncu, spec, n_ranges, True, timeout)
    if error:
        return out, {}, f"measured ({what}): {error}"
    for k in kernels:
        found = _RANGE_RE.search(k.name)
        if found is None or math.isnan(k.read + k.write):
            continue
        i = int(found.group(1))
        t = out[i] or Traffic()
        t.add(k.name, round(k.read), round(k.write))
        out[i] = t
    return out, report.get("errors", {}), ""


def measure_softmax(
    rows: int, n: int, dtype: torch.dtype, algorithms: Sequence[str], *, timeout: float = 600.0
) -> tuple[dict[str, Traffic | None], str]:
    """Measured DRAM bytes of one softmax forward per algorithm (``"torch"`` for
    ``torch.softmax``), with Nsight Compute; ``(traffic per algorithm, message)``, never raising
    for a missing GPU or profiler (the message says why)."""
    none: dict[str, Traffic | None] = dict.fromkeys(algorithms)
    spec = {
        "kind": "softmax",
        "rows": rows,
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "algorithms": list(algorithms),
    }
    per_range, errors, failed = _ranges(spec, len(algorithms), timeout, "softmax")
    if failed:
        return none, failed
    out = dict(zip(algorithms, per_range, strict=True))
    message = "; ".join(f"softmax {algorithms[int(i)]}: {e}" for i, e in sorted(errors.items()))
    return out, message


def measure_flex(
    calls: Sequence[tuple[str, AttentionShape]],
    mask: str,
    docs: int,
    block: tuple[int, int] = (128, 128),
    *,
    timeout: float = 600.0,
) -> tuple[list[Traffic | None], str]:
    """Measured DRAM bytes of one forward per ``(method, shape)`` call of ``flashlite traffic
    --mask`` (``flex-<mask>``, ``flex-dense``, the document masks' varlen row), with Nsight
    Compute: ``(traffic per call, message)``, never raising for a missing GPU or profiler (the
    message says why, and a call that failed is None with its error in the message)."""
    spec = {
        "kind": "flex",
        "mask": mask,
        "docs": docs,
        "block": list(block),
        "calls": [[m, s.to_json()] for m, s in calls],
    }
    out, errors, failed = _ranges(spec, len(calls), timeout, mask)
    if failed:
        return out, failed
    for i in errors:
        out[int(i)] = None
    message = "; ".join(
        f"{calls[int(i)][0]} N={calls[int(i)][1].seq_q}: {e}" for i, e in sorted(errors.items())
    )
    return out, message
