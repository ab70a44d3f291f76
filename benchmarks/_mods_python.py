"""bench_mods' plain Python mask points (``--only python``): the document-causal mask written as
FlexAttention users write it, ``(ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)``.

    python mask   8 random-length documents per sequence, N ∈ {8k, 32k}: flashlite with the
                  plain Python function against the same mask as the gallery's jit function
                  (``gallery.document_causal(ids)``), forward and forward + backward. The
                  figure is python ÷ jit (time).
    document 1k   fixed-length documents, forward + backward: 1k-token documents at N 8k and
    document 2k   2k-token documents at N 8k and 32k. flashlite with the plain Python function
                  (and with the jit one beside it) against ``torch.compile(flex_attention)``
                  with torch's block mask of the same Python function (what a Flex user has).
                  The figure is Flex ÷ flashlite (time).

Every engine's output is checked first against Flex and against an fp64 reference on the last
128 query rows; gradients against Flex (fixed-length documents) or against the jit mask's
(random-length ones). Writes ``mods-python-<device>.{json,png}`` and prints a table last.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _common import (
    RESULTS,
    Setup,
    device_name,
    device_slug,
    max_rel_err,
    metadata,
    rows_reference,
    timed_kinds,
    useful_pairs,
    write_results,
)

import flashlite
from flashlite.masking import gallery
from flashlite.plotting import Bars, Figure, Panel

DOCS = 8  # random-length documents per sequence (as bench_mods' document points)
ERR_BAR, GRAD_BAR = 2e-2, 5e-2  # a wrong mask gives errors of order 1


def sizes(quick: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The GPU run's lengths of the python mask points and (document length, N) of the
    fixed-length ones; ``quick`` keeps N 8k."""
    if quick:
        return [8192], [(1024, 8192), (2048, 8192)]
    return [8192, 32768], [(1024, 8192), (2048, 8192), (2048, 32768)]


def document_causal_fn(ids: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The plain Python document-causal mask over ``ids`` ``(B, N)``."""

    def doc(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    return doc


def _compiled_flex() -> Callable[..., torch.Tensor]:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    # every point brings a new mask function: let Dynamo compile each (past the default limit of
    # recompilations it would fall back to the eager flex_attention, dense in N²)
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 64))
    return torch.compile(torch_flex)


def _engines(ids: torch.Tensor, setup: Setup, flex: Callable) -> tuple[dict, Callable, object]:
    """flashlite with the plain Python mask and with the gallery's jit mask, and Flex with
    torch's block mask of the same Python function (built as bench_mods' document points
    build theirs): the calls by name, the Python mask, flashlite's jit block mask."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    n, dev = ids.shape[1], setup.device
    fn = document_causal_fn(ids)
    py = flashlite.create_block_mask(fn, 1, None, n, n, device=dev)
    jit = flashlite.create_block_mask(gallery.document_causal(ids), 1, None, n, n, device=dev)
    tbm = torch_create(fn, 1, None, n, n, device=dev)
    calls = {
        "python": lambda a, b, c: flashlite.flex_attention(a, b, c, block_mask=py),
        "jit": lambda a, b, c: flashlite.flex_attention(a, b, c, block_mask=jit),
        "flex": lambda a, b, c: flex(a, b, c, block_mask=tbm),
    }
    return calls, fn, jit


def _checks(calls: dict, fn: Callable, q, k, v, do, grads_vs: str) -> dict:  # noqa: ANN001
    """Outputs of both flashlite masks against Flex and fp64 (last 128 rows), their gradients
    against ``grads_vs``'s, and whether the two masks' outputs agree bit for bit."""
    out = {name: c(q, k, v) for name, c in calls.items()}
    ref = rows_reference(q, k, v, fn, None)
    errs = {}
    for m in ("python", "jit"):
        errs[f"{m} vs flex"] = max_rel_err(out[m], out["flex"])
        errs[f"{m} vs fp64"] = max_rel_err(out[m][:, :, -128:], ref)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = {
        m: torch.autograd.grad(calls[m](*leaves), leaves, do)
        for m in dict.fromkeys(("python", "jit", grads_vs))
    }
    grad_errs = {
        f"{m} vs {grads_vs}": max(map(max_rel_err, grads[m], grads[grads_vs]))
        for m in ("python", "jit")
        if m != grads_vs
    }
    return {
        "max_rel_err": errs,
        "grad_rel_err": grad_errs,
        "bitwise": bool(torch.equal(out["python"], out["jit"])),
    }


def _k(x: int) -> str:
    return f"{x // 1024}k" if x % 1024 == 0 else str(x)


def python_mask_points(rows: list[dict], rounds: int, lengths: list[int], setup: Setup) -> None:
    flex = _compiled_flex()
    for n in lengths:
        q, k, v, do = setup.inputs(n, seed=n)
        ids = gallery.random_documents(1, n, DOCS, seed=n).to(setup.device)
        calls, fn, _ = _engines(ids, setup, flex)
        checked = _checks(calls, fn, q, k, v, do, grads_vs="jit")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        timed_calls = {m: calls[m] for m in ("python", "jit")}  # (Flex: checked, not timed)
        for kind, ms in timed_kinds(timed_calls, q, k, v, leaves, do, rounds):
            row = {
                "group": "python mask",
                "point": f"python/jit doc-causal N{_k(n)} {kind}",
                "n": n,
                "kind": kind,
                "documents": DOCS,
                "ms": ms,
                "python_over_jit": ms["python"] / ms["jit"],
                **checked,
            }
            rows.append(row)
            print(
                f"{row['point']:36s} python {ms['python']:.3f} ms, jit {ms['jit']:.3f} ms: "
                f"{row['python_over_jit']:.3f}x; err {max(checked['max_rel_err'].values()):.1e}",
                flush=True,
            )


def fixed_document_points(
    rows: list[dict], rounds: int, points: list[tuple[int, int]], setup: Setup
) -> None:
    flex = _compiled_flex()
    for doc_len, n in points:
        q, k, v, do = setup.inputs(n, seed=n + doc_len)
        ids = (torch.arange(n, device=setup.device, dtype=torch.int32) // doc_len)[None]
        calls, fn, jit_bm = _engines(ids, setup, flex)
        checked = _checks(calls, fn, q, k, v, do, grads_vs="flex")
        pairs = useful_pairs(jit_bm, setup.device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for kind, ms in timed_kinds(calls, q, k, v, leaves, do, rounds, ("fwd+bwd",)):
            flops = 4 * setup.head_dim * setup.heads * 3.5 * pairs
            row = {
                "group": f"document {_k(doc_len)}",
                "point": f"{_k(doc_len)}-token docs N{_k(n)} {kind}",
                "n": n,
                "kind": kind,
                "doc_len": doc_len,
                "documents": -(-n // doc_len),
                "ms": ms,
                "tflops": {m: flops / t / 1e9 for m, t in ms.items()},
                "useful_pairs": pairs,
                "vs_flex": ms["flex"] / ms["python"],
                "jit_vs_flex": ms["flex"] / ms["jit"],
                **checked,
            }
            rows.append(row)
            print(
                f"{row['point']:36s} python {ms['python']:.3f} ms, jit {ms['jit']:.3f}, flex "
                f"{ms['flex']:.3f}; x flex {row['vs_flex']:.2f}; "
                f"err {max(checked['max_rel_err'].values()):.1e}",
                flush=True,
            )


def python_figure(rows: list[dict], device: str) -> Figure:
    """python ÷ jit time (random-length documents) and Flex ÷ flashlite time (fixed-length
    documents, forward + backward)."""
    py = [r for r in rows if r["group"] == "python mask"]
    docs = [r for r in rows if r["group"].startswith("document ")]
    kind = {"fwd": "f", "fwd+bwd": "f+b"}
    panels = [
        Panel(
            bars=[Bars([r["python_over_jit"] for r in py], "python ÷ jit")],
            categories=[f"{_k(r['n'])} {kind[r['kind']]}" for r in py],
            hlines=[(1.0, "")],
            ylabel="time ratio",
            title=f"{DOCS} random-length documents: Python mask ÷ jit mask (f+b: + backward)",
        ),
        Panel(
            bars=[
                Bars([r["vs_flex"] for r in docs], "flashlite, Python mask"),
                Bars([r["jit_vs_flex"] for r in docs], "flashlite, jit mask"),
            ],
            categories=[f"{_k(r['doc_len'])}-token docs, N {_k(r['n'])}" for r in docs],
            hlines=[(1.0, "")],
            ylabel="Flex time ÷ flashlite time",
            title="fixed-length documents, forward + backward",
        ),
    ]
    return Figure([panels], title=f"plain Python masks on {device}", panel_size=(8, 4.5))


def _table(rows: list[dict]) -> None:
    print(f"\n{'point':36s} result")
    for r in rows:
        ms = r["ms"]
        if r["group"] == "python mask":
            print(
                f"{r['point']:36s} python {ms['python']:.3f} ms / jit {ms['jit']:.3f} ms = "
                f"{r['python_over_jit']:.3f}x, bitwise {r['bitwise']}"
            )
        else:
            print(
                f"{r['point']:36s} flashlite x Flex {r['vs_flex']:.2f} (python mask), "
                f"{r['jit_vs_flex']:.2f} (jit mask); Flex {ms['flex']:.3f} ms"
            )


def run_python(
    rounds: int,
    setup: Setup,
    lengths: list[int],
    points: list[tuple[int, int]],
    out_dir: Path = RESULTS,
) -> int:
    """The python mask points at ``lengths``, the fixed-length document ones at ``points``
    ``(document length, N)``, their results file and table; 1 if a result was wrong."""
    rows: list[dict] = []
    python_mask_points(rows, rounds, lengths, setup)
    fixed_document_points(rows, rounds, points, setup)
    meta = metadata(dtype=str(setup.dtype).removeprefix("torch."), heads=setup.heads,
                    head_dim=setup.head_dim, command=" ".join(sys.argv))  # fmt: skip
    paths = write_results(f"mods-python-{device_slug()}", rows, meta, out_dir=out_dir,
                          figure=python_figure(rows, device_name()))  # fmt: skip
    _table(rows)
    print("wrote", paths["json"])
    bad = [
        r["point"]
        for r in rows
        if max(r["max_rel_err"].values()) > ERR_BAR or max(r["grad_rel_err"].values()) > GRAD_BAR
    ]
    if bad:
        print("WRONG RESULTS:", bad)
    return 1 if bad else 0
