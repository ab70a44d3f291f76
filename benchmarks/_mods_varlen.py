"""bench_mods' varlen points (``--only varlen``): 8 random-length documents packed into one
sequence, ``attention_varlen`` with a causal mask function (and with ALiBi too) against
``attention_varlen(causal=True)`` and ``flex_attention``'s document-causal tables over the packed
sequence. Writes ``mods-varlen-<device>.{json,png}``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _common import (
    RESULTS,
    Setup,
    device_name,
    device_slug,
    max_rel_err,
    metadata,
    timed_kinds,
    write_results,
)

import flashlite
from flashlite.masking import gallery
from flashlite.plotting import Bars, Figure, Panel


def varlen_points(rows: list[dict], rounds: int, lengths: list[int], setup: Setup) -> None:
    dev = setup.device
    for n in lengths:
        ids = gallery.random_documents(1, n, 8, seed=n)[0]
        lens = torch.bincount(ids.long()).tolist()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        cu, longest = cu.to(dev), max(lens)
        q, k, v, do = setup.inputs(n, seed=n, packed=True)
        causal = flashlite.create_block_mask(gallery.causal(), None, None, longest, longest,
                                             device=dev)  # fmt: skip
        docs = flashlite.create_block_mask(gallery.document_causal(ids[None].to(dev)), 1, None, n,
                                           n, device=dev)  # fmt: skip
        alibi = gallery.alibi(gallery.alibi_slopes(setup.heads).to(dev))

        def packed(fn):  # noqa: ANN001, ANN202  (flex over the (1, H, N, D) view)
            return lambda a, b, c: fn(*(t.transpose(0, 1)[None] for t in (a, b, c)))[0].transpose(
                0, 1
            )

        calls = {
            "varlen, causal mod": lambda a, b, c: flashlite.attention_varlen(
                a, b, c, cu, cu, longest, longest, block_mask=causal
            ),
            "varlen, causal mod + ALiBi": lambda a, b, c: flashlite.attention_varlen(
                a, b, c, cu, cu, longest, longest, block_mask=causal, score_mod=alibi
            ),
            "varlen causal=True": lambda a, b, c: flashlite.attention_varlen(
                a, b, c, cu, cu, longest, longest, causal=True
            ),
            "flex, document-causal": packed(
                lambda a, b, c: flashlite.flex_attention(a, b, c, block_mask=docs)
            ),
        }
        ref = calls["varlen causal=True"](q, k, v)
        errs = {name: max_rel_err(fn(q, k, v), ref) for name, fn in calls.items()}
        errs.pop("varlen, causal mod + ALiBi")  # (another function)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for kind, ms in timed_kinds(calls, q, k, v, leaves, do, rounds):
            row = {
                "group": "varlen",
                "point": f"varlen N{n // 1024}k {kind}",
                "n": n,
                "kind": kind,
                "lengths": lens,
                "ms": ms,
                "vs_builtin": {m: ms[m] / ms["varlen causal=True"] for m in ms},
                "max_rel_err": errs,
            }
            rows.append(row)
            print(
                f"{row['point']:22s} "
                + ", ".join(f"{m} {t:.3f} ms" for m, t in ms.items())
                + f"; err vs built-in {max(errs.values()):.1e}",
                flush=True,
            )


def varlen_figure(rows: list[dict], device: str) -> Figure:
    """Milliseconds per engine for the packed documents."""
    pts = [r for r in rows if r["group"] == "varlen"]
    names = list(pts[0]["ms"])
    panel = Panel(
        bars=[Bars([r["ms"][m] for r in pts], m) for m in names],
        categories=[r["point"].replace("varlen ", "") for r in pts],
        ylabel="ms",
        title="8 documents packed, bf16, H 16, D 128",
    )
    return Figure([[panel]], title=f"varlen with mask functions on {device}", panel_size=(9, 4.5))


def run_varlen(rounds: int, lengths: list[int], setup: Setup, out_dir: Path = RESULTS) -> int:
    """The varlen points, their results file and table; 1 if a result was wrong."""
    rows: list[dict] = []
    varlen_points(rows, rounds, lengths, setup)
    meta = metadata(dtype=str(setup.dtype).removeprefix("torch."), heads=setup.heads,
                    head_dim=setup.head_dim, command=" ".join(sys.argv))  # fmt: skip
    paths = write_results(f"mods-varlen-{device_slug()}", rows, meta, out_dir=out_dir,
                          figure=varlen_figure(rows, device_name()))  # fmt: skip
    for r in rows:
        print(f"{r['point']:22s} " + ", ".join(f"{m} {x:.2f}x" for m, x in
                                                r["vs_builtin"].items()))  # fmt: skip
    print("wrote", paths["json"])
    bad = [r["point"] for r in rows if max(r["max_rel_err"].values()) > 2e-2]
    if bad:
        print("WRONG RESULTS:", bad)
    return 1 if bad else 0
