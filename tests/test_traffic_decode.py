"""HBM traffic of decoding: the decode kernel's and the shared-prefix step's byte models equal
the interpreter's counts, K and V are read once per KV head, the prefix once per row block, and
the CLI's --decode and --shared-prefix rows.

Counted bytes come from running the real code: Triton kernels in the interpreter (every executed
load/store, active lanes only) and torch ops through a dispatch mode. Shapes are tiny: the
interpreter is slow."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from flashlite import traffic
from flashlite.traffic import AttentionShape


@pytest.mark.parametrize(
    "b,h,hkv,nq,nk,d,splits",
    [
        (2, 4, 2, 1, 300, 32, 3),
        (1, 2, 1, 5, 130, 16, 2),
        (2, 2, 2, 70, 90, 16, 1),
        (1, 4, 1, 3, 1000, 24, 4),
        (1, 2, 2, 1, 17, 8, 5),
    ],  # fmt: skip
)
@pytest.mark.parametrize("tile", [(64, 64), (16, 16), (16, 64)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_decode_counted_equals_model(b, h, hkv, nq, nk, d, splits, tile) -> None:  # noqa: ANN001
    # the decode kernel's chunks and the combine kernel, byte for byte
    from flashlite.kernels.configs import DecodeConfig

    shape = AttentionShape(b, h, nq, d, seq_k=nk, kv_heads=hkv, dtype=torch.float16, causal=True)
    model = traffic.model_flashlite_decode(shape, *tile, splits)
    counted, _naive = traffic.count_decode(shape, DecodeConfig(*tile, 4, 2), splits)
    assert (counted.read, counted.write) == (model.read, model.write)


def test_decode_reads_each_kv_head_once() -> None:
    # GQA packing: one decode step reads K and V once per KV head, whatever the group size
    for hq in (8, 32):
        shape = AttentionShape(2, hq, 1, 64, seq_k=4096, kv_heads=8, causal=True)
        model = traffic.model_flashlite_decode(shape, 16, 128, 4)
        kv = sum(b for name, (b, _w) in model.parts.items() if name in ("k", "v"))
        assert kv == 2 * 2 * 8 * 4096 * 64 * 2


def test_decode_rows_and_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    argv = ["traffic", "--decode", "--seq", "100", "300", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--count", "--quiet", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["flashlite-decode", "naive-decode"] * 2
    for r in rows[::2]:
        assert r["model_bytes"] == r["counted_bytes"] and "splits" in r["config"]
    # the GPU's split count for a 128k-token decode: one chunk per SM of 132 (8 KV heads)
    shape = AttentionShape(1, 32, 1, 128, seq_k=131072, kv_heads=8, causal=True)
    assert traffic.decode_splits(shape, 16) == 16


def _shared_prefix_shape(dtype: torch.dtype, hkv: int = 2) -> AttentionShape:
    # B=3 requests of Hq=4 heads decode one token each against suffix caches of L=24 keys
    return AttentionShape(3, 4, 1, 16, seq_k=24, kv_heads=hkv, dtype=dtype, causal=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_shared_prefix_counted_equals_model(dtype: torch.dtype, splits: int) -> None:
    # both passes' decode kernels (+ combines), the copy of q, the merge, byte for byte; the
    # prefix read once (one row block: B·Nq·G = 6 rows), against B times over copies
    n_prefix = 40
    shape = _shared_prefix_shape(dtype)
    shared, copies = traffic.count_shared_prefix(shape, n_prefix, splits)
    suffix_tiles, prefix_tiles = traffic.shared_prefix_tiles(shape, interpreted=True)
    assert shared.info["suffix_tiles"] == tuple(suffix_tiles[:2])
    model = traffic.model_flashlite_shared_prefix(
        shape, n_prefix, suffix_tiles=shared.info["suffix_tiles"],
        prefix_tiles=shared.info["prefix_tiles"], suffix_splits=splits, prefix_splits=splits,
    )  # fmt: skip
    alt = traffic.model_kvcache_prefix_copies(shape, n_prefix, *suffix_tiles[:2], splits)
    assert (shared.read, shared.write) == (model.read, model.write)
    assert (copies.read, copies.write) == (alt.read, alt.write)
    assert model.info["prefix_splits"] == splits  # (40 keys: two chunks of 16-key tiles)
    once = n_prefix * shape.hkv * shape.head_dim * shape.itemsize  # (40 = 16 + 16 + 8 lanes)
    for x in ("k", "v"):
        assert shared.parts[f"@prefix_{x}"] == model.parts[f"prefix {x}"] == [once, 0]
        assert shared.parts[f"@{x}_cache"] == model.parts[f"suffix {x}"]
        assert alt.parts[f"prefix {x}"] == [shape.batch * once, 0]
    q_bytes = shape.batch * shape.heads * shape.head_dim * shape.itemsize
    assert shared.parts["torch ops"] == model.parts["q copy"] == [q_bytes, q_bytes]


@pytest.mark.interpreter
def test_shared_prefix_without_gqa_copies_no_q() -> None:
    # Hq = Hkv: q's (Hq, B, Nq, D) order is a view of (1, Hkv, B·Nq, D), so no copy is made
    shape = _shared_prefix_shape(torch.float16, hkv=4)
    shared, _ = traffic.count_shared_prefix(shape, 17, 1)
    model = traffic.model_flashlite_shared_prefix(shape, 17, suffix_tiles=(16, 16),
                                                  prefix_tiles=(16, 16), suffix_splits=1,
                                                  prefix_splits=1)  # fmt: skip
    assert (shared.read, shared.write) == (model.read, model.write)
    assert "torch ops" not in shared.parts and model.parts["q copy"] == [0, 0]


def test_shared_prefix_model_at_a_gpu_shape() -> None:
    # B=64, Np=32k, L=1k, Hq=32, Hkv=8, D=128, bf16 on the H200's tiles and split counts: the
    # prefix pass's 256 rows per KV head are 4 row blocks of 64, each reading the prefix once
    shape = AttentionShape(64, 32, 1, 128, seq_k=1024, kv_heads=8, causal=True)
    suffix, prefix = traffic.shared_prefix_tiles(shape)
    splits = traffic.shared_prefix_splits(shape, 32768, suffix.block_m)
    model = traffic.model_flashlite_shared_prefix(
        shape, 32768, suffix_tiles=suffix[:2], prefix_tiles=prefix[:2], suffix_splits=splits[0],
        prefix_splits=splits[1],
    )  # fmt: skip
    alt = traffic.model_kvcache_prefix_copies(shape, 32768, *suffix[:2], 1)
    once = 32768 * 8 * 128 * 2
    assert prefix.block_m == 64 and model.info["prefix_row_blocks"] == 4
    assert model.parts["prefix k"] == [4 * once, 0] and alt.parts["prefix k"] == [64 * once, 0]
    assert alt.total > 10 * model.total
    # causal Nq = 2 without new keys: the op's exact torch path, left out of the model
    two = AttentionShape(64, 32, 2, 128, seq_k=1024, kv_heads=8, causal=True)
    with pytest.raises(ValueError, match="exact torch path"):
        traffic.model_flashlite_shared_prefix(two, 32768, suffix_tiles=(16, 64),
                                              prefix_tiles=(64, 64), suffix_splits=1,
                                              prefix_splits=1)  # fmt: skip


@pytest.mark.interpreter
def test_shared_prefix_rows_and_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    argv = ["traffic", "--shared-prefix", "40", "--seq", "24", "--batch", "3", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--quiet"]  # fmt: skip
    assert cli.main([*argv, "--count", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["flashlite-shared-prefix", "kvcache-prefix-copies"]
    assert all(r["model_bytes"] == r["counted_bytes"] for r in rows)
    assert rows[1]["prefix_vs_shared"] == 3 and rows[1]["vs_shared"] > 1
    assert cli.main(argv) == 0  # (model only: the GPU's tiles)
    assert "prefix ratio" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # (causal queries the model leaves out)
        cli.main([*argv, "--decode-q", "2"])
    assert exc.value.code == 2
    assert "flashlite traffic: error: --decode-q=2 with --shared-prefix" in capsys.readouterr().err


def test_fp8_cache_decode_counted_equals_model() -> None:
    # an e4m3 cache read by bf16 queries: the cache at a byte an element, the descale reads
    from flashlite.kernels.configs import DecodeConfig

    shape = AttentionShape(2, 4, 1, 16, seq_k=300, kv_heads=2, dtype=torch.float8_e4m3fn,
                           causal=True)  # fmt: skip
    model = traffic.model_flashlite_decode(shape, 16, 64, 3)
    counted, _naive = traffic.count_decode(shape, DecodeConfig(16, 64, 4, 2), 3)
    assert (counted.read, counted.write) == (model.read, model.write)
    bf16 = traffic.model_flashlite_decode(replace(shape, dtype=torch.bfloat16), 16, 64, 3)
    assert model.parts["k"][0] * 2 == bf16.parts["k"][0]
    assert model.parts["q"] == bf16.parts["q"] and "descales" in model.parts


def test_fp8_traffic_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    argv = ["traffic", "--decode", "--seq", "300", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--dtype", "float8_e4m3fn", "--count", "--quiet",
            "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["model_bytes"] == rows[0]["counted_bytes"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["traffic", "--softmax", "--dtype", "float8_e4m3fn"])
    assert stop.value.code == 2 and "model FP8, not --softmax" in capsys.readouterr().err


@pytest.mark.parametrize("nq,nk,splits", [(1, 100, 1), (2, 300, 3), (3, 70, 2)])
@pytest.mark.parametrize("tiles", [(16, 16, 4), (32, 32, 8)], ids=["16x16", "32x32"])
def test_mla_counted_equals_model(nq: int, nk: int, splits: int, tiles: tuple) -> None:
    # absorbed MLA: one latent row per token read once per block of packed heads, the values
    # from the same bytes; the combine's partials when split
    shape = AttentionShape(2, 8, nq, 48, seq_k=nk, kv_heads=1, dtype=torch.bfloat16, causal=True)
    model = traffic.model_flashlite_mla(shape, 32, tiles[0], tiles[1], splits)
    counted = traffic.count_mla(shape, 32, tiles, splits)
    assert (counted.read, counted.write) == (model.read, model.write)


def test_mla_rows_and_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    # DeepSeek's step at 4k tokens: the latent row (576) against per-head K and V (192 + 128)
    # of 128 heads: 71x fewer cache bytes
    rows, _ = traffic.mla_rows(
        [AttentionShape(1, 128, 1, 576, seq_k=4096, kv_heads=1, causal=True)], show_progress=False
    )
    assert rows[0]["cache_saving"] == pytest.approx(128 * 320 / 576)
    argv = ["traffic", "--mla", "32", "--head-dim", "48", "--heads", "8", "--seq", "100",
            "--count", "--quiet", "--json", "--dtype", "bfloat16"]  # fmt: skip
    assert cli.main(argv) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["model_bytes"] == row["counted_bytes"] and row["method"] == "flashlite-mla"
    with pytest.raises(SystemExit):
        cli.main(["traffic", "--mla", "512", "--head-dim", "64"])
    assert "need a wider latent row" in capsys.readouterr().err
