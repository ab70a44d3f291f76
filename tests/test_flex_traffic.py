"""The HBM traffic of the flex kernels: the byte models equal the interpreter's counts (dense
and packed sequences), the CLI's --mask rows, measuring without a GPU or through a stand-in
ncu, and the DRAM estimate."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in jit functions' globals)
from flex_helpers import BLOCK, VARLEN_K, VARLEN_Q, D, N, _block_mask, _gallery, _ids, _varlen_case

import flashlite
from flashlite.masking import gallery, mods


@pytest.mark.parametrize("name", ["causal", "document_causal", "alibi", "relative_bias"])
def test_traffic_model_equals_count(name: str) -> None:
    """The tables' model of the forward's bytes equals the interpreter's count, mods' buffer
    reads included; empty tiles save K/V bytes against the dense tables."""
    from flashlite.ops.attention import dense_block_mask
    from flashlite.traffic import AttentionShape, count_flex_attention, model_flex_attention

    shape = AttentionShape(2, 4, N, D, kv_heads=2, dtype=torch.float16)
    mm, sm = _gallery(4, 2)[name]
    bm = _block_mask(mm, 2)
    model, counted = model_flex_attention(shape, bm, sm), count_flex_attention(shape, bm, sm)
    assert (model.read, model.write) == (counted.read, counted.write)
    assert model.info["mods_modelled"] and model.info["empty"] > 0
    dense_bm = dense_block_mask(N, N, (BLOCK, BLOCK), torch.device("cpu"))
    dense = model_flex_attention(shape, dense_bm)
    assert dense.parts["k"][0] > model.parts["k"][0]


@pytest.mark.parametrize("mask", ["document_causal", "document"])
def test_traffic_cli_mask_counts(mask: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The flex, varlen and dense rows: counted equals the model; the documents as varlen
    sequences issue less than the document mask over the packed sequence (whose tiles
    straddle documents) and than every tile, which issues less than the naive reference.
    (At this N, document's id reads outweigh the one empty tile it skips.)"""
    import json

    from flashlite.cli import main

    code = main(["traffic", "--mask", mask, "--seq", "200", "--count", "--json", "--quiet"])
    rows = json.loads(capsys.readouterr().out)
    varlen = "varlen-causal" if mask == "document_causal" else "varlen"
    assert code == 0 and [r["method"] for r in rows] == [f"flex-{mask}", varlen, "flex-dense",
                                                          "naive"]  # fmt: skip
    for r in rows[:3]:
        assert r["model_bytes"] == r["counted_bytes"]
    flex, varlen_b, dense, naive = (r["model_bytes"] for r in rows)
    assert varlen_b < min(flex, dense) and max(flex, dense) < naive
    if mask == "document_causal":
        assert flex < dense


def test_traffic_cli_mask_measure_without_a_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--measure with --mask on a machine without CUDA: the library gives the model's rows,
    nothing measured, a note saying why; the command refuses before it starts (exit 2)."""
    from flashlite.cli import main
    from flashlite.traffic import AttentionShape, block_sparse_rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = AttentionShape(1, 2, 256, 16)
    rows, notes = block_sparse_rows([shape], "causal", measure=True, show_progress=False)
    assert [r["method"] for r in rows] == ["flex-causal", "flex-dense", "naive"]
    assert all(r["measured_bytes"] is None for r in rows)
    assert any("no CUDA device" in n for n in notes)
    with pytest.raises(SystemExit) as exc:
        main(["traffic", "--mask", "causal", "--seq", "256", "--measure", "--json", "--quiet"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert "flashlite traffic: error: --measure needs a CUDA GPU" in out.err


@pytest.mark.parametrize("name", ["causal+alibi", "window+relative bias", "document per sequence"])
def test_varlen_traffic_model_equals_count(name: str) -> None:
    """attention_varlen with mods: the tables' model of the forward's bytes (offsets, tiles
    skipped past a shorter sequence, mods' buffer reads) equals the interpreter's count, with
    sequences of 0 and 1 rows and keys longer and shorter than queries; the DRAM estimate
    (every byte once) lies below it."""
    from flashlite.traffic import AttentionShape, count_flex_varlen, model_flex_varlen
    from flashlite.traffic.model import dram_flex_varlen

    hq, hkv, d = 4, 2, 16
    lq, lk = VARLEN_Q, VARLEN_K
    if name == "document per sequence":
        ids = torch.stack([_ids(1, max(*lq, *lk), 3)[0] for _ in lq])
        # (self-attention ids over the tables' longest positions: ids over the keys' only
        # had the tables' classifier read past them, which their limits now refuse)
        mm, sm, per_sequence = gallery.document_causal(ids), None, True
        lq = lk = [min(a, b) for a, b in zip(lq, lk, strict=True)]
    else:
        mm, sm, per_sequence = _varlen_case(name, hq, lq, lk)
    bm = flashlite.create_block_mask(mm, len(lq) if per_sequence else None, None, max(VARLEN_Q),
                                     max(VARLEN_K), device="cpu", BLOCK_SIZE=16)  # fmt: skip
    shape = AttentionShape(len(lq), hq, max(VARLEN_Q), d, seq_k=max(VARLEN_K), kv_heads=hkv,
                           dtype=torch.float16)  # fmt: skip
    model, counted = (
        model_flex_varlen(shape, lq, lk, bm, sm),
        count_flex_varlen(shape, lq, lk, bm, sm),
    )
    assert (model.read, model.write) == (counted.read, counted.write)
    assert model.info["mods_modelled"] and model.parts["offsets"][0] > 0
    assert dram_flex_varlen(shape, lq, lk, bm).total < model.total
    with pytest.raises(ValueError, match="lengths_q"):
        model_flex_varlen(shape, [*lq, 1], [*lk, 1], bm)
    with pytest.raises(ValueError, match="lengths_k must lie in"):
        model_flex_varlen(shape, lq, [max(VARLEN_K) + 1, *lk[1:]], bm)


def test_measure_flex_child_runs_every_row_and_ranges_are_attributed(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """The ncu child builds and runs each --mask row's call (here on the CPU, the ranges
    recorded instead of profiled), and measure_flex sums each range's kernels (a stand-in ncu
    printing a stored sample). Without CUDA it measures nothing and says why."""
    import json
    import stat
    import sys
    from pathlib import Path

    from flashlite.traffic import AttentionShape, measure

    ran: list[int] = []
    monkeypatch.setattr(measure, "_warm_up", lambda fn: fn())
    monkeypatch.setattr(measure, "_measure_once", lambda i, fn: ran.append(i) or fn())
    shape = AttentionShape(1, 2, 64, 16, dtype=torch.float16)
    calls = [[m, shape.to_json()] for m in ("flex-document_causal", "varlen-causal",
                                            "flex-dense")]  # fmt: skip
    report: dict = {"errors": {}, "configs": {}}
    measure._flex_child({"mask": "document_causal", "docs": 3, "block": [16, 16],
                         "calls": calls, "device": "cpu"}, report)  # fmt: skip
    assert report["errors"] == {} and ran == [0, 1, 2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got, message = measure.measure_flex([("flex-dense", shape)], "document_causal", 3)
    assert got == [None] and "CUDA" in message
    sample = Path(__file__).parent / "data" / "ncu_sample.csv"
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   "spec = json.load(open(sys.argv[-1]))\n"
                   "json.dump({'errors': {}, 'configs': {}}, open(spec['report'], 'w'))\n"
                   f"print(open({str(sample)!r}).read())\n")  # fmt: skip
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(ncu))
    got, message = measure.measure_flex([("flex-document_causal", shape), ("flex-dense", shape)],
                                        "document_causal", 3)  # fmt: skip
    assert message == "" and all(t is not None and t.total > 0 for t in got)
    assert json.dumps([t.read for t in got])  # (plain ints, as the JSON rows carry them)


@pytest.mark.gpu
def test_gpu_dram_estimate_of_document_masks_against_ncu() -> None:
    """ncu's DRAM bytes of the document-causal forward (the Hopper kernel) within 15% of the
    estimate at two points, through ``flashlite traffic --mask --measure``'s own path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flashlite.traffic import AttentionShape, block_sparse_rows, find_ncu

    if find_ncu() is None:
        pytest.skip("ncu not found")
    shapes = [AttentionShape(1, 16, n, 128, dtype=torch.bfloat16) for n in (16384, 32768)]
    rows, notes = block_sparse_rows(shapes, "document_causal", measure=True,
                                    show_progress=False)  # fmt: skip
    if any("permitted" in n for n in notes):
        pytest.skip("; ".join(notes))
    for r in rows:
        if r["method"] == "flex-document_causal":
            assert r["measured_bytes"] is not None, notes
            assert 0.85 <= r["measured_bytes"] / r["dram_bytes"] <= 1.15, r


def test_dram_estimate_reads_visited_keys_once() -> None:
    from flashlite.traffic import AttentionShape
    from flashlite.traffic.model import dram_flex_attention

    shape = AttentionShape(1, 2, 64, 16, dtype=torch.float16)
    ids = torch.tensor([0] * 32 + [1] * 32, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, 64, 64,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    t = dram_flex_attention(shape, bm)
    assert t.parts["k"][0] == t.parts["v"][0] == 2 * 64 * 16 * 2  # every key once per head

    @triton.jit
    def first_half_only(b, h, q_idx, kv_idx):
        return kv_idx < 32

    half = flashlite.create_block_mask(mods.mask_mod(first_half_only), None, None, 64, 64,
                                       device="cpu", BLOCK_SIZE=16)  # fmt: skip
    assert dram_flex_attention(shape, half).parts["k"][0] == 2 * 32 * 16 * 2  # never-seen keys
