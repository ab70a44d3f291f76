"""HBM traffic: the byte models against what the code really moves.

Counted bytes come from running the real code: Triton kernels in the interpreter (every executed
load/store, active lanes only) and torch ops through a dispatch mode. The flashlite models must
match the counts exactly; the naive model within 1%. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
import torch

from flashlite import reference, traffic
from flashlite.kernels import softmax as softmax_kernels
from flashlite.traffic import AttentionShape, measure, ncu

DATA = Path(__file__).parent / "data"


def _shape(
    b: int, h: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype, causal: bool
) -> AttentionShape:
    return AttentionShape(b, h, nq, d, seq_k=nk, kv_heads=hkv, dtype=dtype, causal=causal)


# (B, H, Hkv, Nq, Nk, D): the code path each one exercises in the kernel's loop bounds
ATTENTION_SHAPES = [
    (1, 2, 2, 16, 16, 16),  # whole tiles only: no masked tile when not causal
    (1, 2, 2, 33, 17, 8),  # partial query and key tiles; causal: Nq > Nk, top rows see nothing
    (2, 4, 2, 17, 40, 24),  # GQA, Nk > Nq (diagonal shifted right), D not a power of two
    (1, 3, 1, 5, 7, 8),  # MQA, a single partial tile each way
]


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", ATTENTION_SHAPES, ids=lambda d: "x".join(map(str, d)))
def test_flashlite_attention_counted_equals_model(dims: tuple[int, ...], causal: bool) -> None:
    shape = _shape(*dims[:3], *dims[3:], torch.float32, causal)  # type: ignore[misc]
    counted = traffic.count_attention("flashlite", shape)
    model = traffic.model_flashlite_attention(shape)
    assert counted is not None
    assert (counted.read, counted.write) == (model.read, model.write)
    # attributed by address: Q read once, K and V read as often as the model says
    for name in ("q", "k", "v"):
        assert counted.parts["@" + name][0] == model.parts[name][0]
    assert "torch ops" not in counted.parts  # contiguous b h n d: the front-end copies nothing


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flashlite_attention_descriptor_loads_counted(dtype: torch.dtype) -> None:
    # tensor-descriptor loads/stores count in-bounds elements only, like masked pointer loads
    # (D = 16: Triton 3.4's interpreter wants descriptor strides in multiples of 16 elements)
    shape = _shape(1, 2, 1, 21, 35, 16, dtype, True)
    counted = traffic.count_attention("flashlite", shape, use_desc=True)
    model = traffic.model_flashlite_attention(shape)
    assert counted is not None
    assert (counted.read, counted.write) == (model.read, model.write)


def test_flashlite_model_blocks_change_traffic() -> None:
    # K/V bytes scale with the number of query blocks: halving BLOCK_M doubles them
    shape = AttentionShape(1, 1, 256, 64)
    big = traffic.model_flashlite_attention(shape, 128, 64)
    small = traffic.model_flashlite_attention(shape, 64, 64)
    assert small.parts["k"][0] == 2 * big.parts["k"][0]
    assert small.parts["q"] == big.parts["q"]


def test_flashlite_causal_skips_tiles() -> None:
    full = traffic.model_flashlite_attention(AttentionShape(1, 1, 1024, 64), 128, 128)
    causal = traffic.model_flashlite_attention(
        AttentionShape(1, 1, 1024, 64, causal=True), 128, 128
    )
    # blocks see 1..8 tiles of 8: (1 + ... + 8) / (8 · 8) of the K/V reads
    assert causal.parts["k"][0] * 64 == full.parts["k"][0] * 36


@pytest.mark.parametrize("return_lse", [False, True], ids=["o", "o+lse"])
@pytest.mark.parametrize(
    "dims",
    [(1, 2, 2, 33, 17, 8), (2, 4, 2, 9, 12, 8), (1, 2, 1, 16, 16, 8), (2, 3, 1, 7, 5, 16)],
    ids=["mha-odd", "gqa-copy", "gqa-view", "mqa"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_naive_model_matches_dispatch_counter(
    dims: tuple[int, ...], causal: bool, dtype: torch.dtype, return_lse: bool
) -> None:
    shape = _shape(*dims[:3], *dims[3:], dtype, causal)  # type: ignore[misc]
    q, k, v = traffic.make_inputs(shape)
    with traffic.count_torch_ops() as ops:
        reference.attention(q, k, v, causal=causal, return_lse=return_lse)
    model = traffic.model_naive_attention(shape, return_lse=return_lse)
    assert ops.traffic.read == pytest.approx(model.read, rel=0.01)
    assert ops.traffic.write == pytest.approx(model.write, rel=0.01)


def test_count_attention_naive_and_sdpa() -> None:
    shape = AttentionShape(1, 2, 12, 8, causal=True)
    counted = traffic.count_attention("naive", shape)
    assert counted is not None
    assert counted.total == pytest.approx(traffic.model_naive_attention(shape).total, rel=0.01)
    assert traffic.count_attention("sdpa-flash", shape) is None
    with pytest.raises(ValueError, match="method"):
        traffic.count_attention("nope", shape)


@pytest.mark.interpreter
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize(
    ("algorithm", "rows", "n"),
    [
        ("three_pass", 3, 100),
        ("three_pass", 2, 4100),  # two tiles, the second partial
        ("online", 3, 37),
        ("online", 2, 4100),
        ("single_read", 5, 37),  # several rows per program, the last program partial
        ("single_read", 2, 1000),
        ("auto", 3, 513),
        ("split", 2, 9000),  # two chunks per row, the workspace read C times per row
        ("split", 3, 17000),
    ],
)
def test_softmax_counted_equals_model(algorithm: str, rows: int, n: int, log: bool) -> None:
    dtype = torch.float16
    counted = traffic.count_softmax(rows, n, dtype, algorithm, log=log)
    model = traffic.model_softmax(rows, n, dtype, algorithm)
    assert (counted.read, counted.write) == (model.read, model.write)


def test_softmax_model_ratios() -> None:
    # the byte table of flashlite.kernels.softmax: 4b, 3b, 2b per element
    comp = traffic.compulsory_softmax(64, 1024, torch.bfloat16).total
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "three_pass").total == 2 * comp
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "online").total * 2 == 3 * comp
    assert traffic.model_softmax(64, 1024, torch.bfloat16, "single_read").total == comp
    with pytest.raises(ValueError, match="algorithm"):
        traffic.model_softmax(1, 8, torch.float32, "fast")


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


def test_compulsory_and_l2_note() -> None:
    shape = AttentionShape(1, 8, 1024, 64, kv_heads=2, dtype=torch.bfloat16)
    comp = traffic.compulsory_attention(shape)
    q = 8 * 1024 * 64 * 2
    assert (comp.read, comp.write) == (q + 2 * q // 4, q)
    assert "L2" in (traffic.l2_note(shape, l2_bytes=60 * 2**20) or "")
    assert traffic.l2_note(AttentionShape(1, 16, 16384, 128), l2_bytes=60 * 2**20) is None


# ------------------------------------------------------------------------------- ncu parsing
def test_parse_ncu_csv_units_and_separators() -> None:
    kernels = traffic.parse_ncu_csv((DATA / "ncu_sample.csv").read_text())
    assert [k.id for k in kernels] == [0, 1, 2]
    assert kernels[0].name == "flt_0000_"
    assert kernels[0].read == pytest.approx(8.42e6)
    assert kernels[0].write == pytest.approx(1234.56e3)  # "1,234.56" Kbyte
    assert (kernels[1].read, kernels[1].write) == (2048, 512)
    assert kernels[2].read == pytest.approx(1.07e9)
    assert kernels[2].write == pytest.approx(268.44e6)


def test_parse_ncu_csv_quoted_kernel_names() -> None:
    kernels = traffic.parse_ncu_csv((DATA / "ncu_sample_kernels.csv").read_text())
    assert len(kernels) == 2
    assert kernels[0].name.startswith("void at::native::") and "BFloat16, float" in kernels[0].name
    assert kernels[1].read == pytest.approx(3145.73e3)


def test_parse_ncu_csv_without_table() -> None:
    assert traffic.parse_ncu_csv("==PROF== No kernels were profiled.\n") == []
    with pytest.raises(ValueError, match="unit"):
        ncu._ncu_value("1", "furlong")


def _fake_ncu(tmp_path: Path) -> Path:
    """A stand-in ncu: writes the child's report and prints the stored sample CSV."""
    script = tmp_path / "ncu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "spec = json.load(open(sys.argv[-1]))\n"
        "json.dump({'errors': {}, 'configs': {}}, open(spec['report'], 'w'))\n"
        f"print(open({str(DATA / 'ncu_sample.csv')!r}).read())\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_measure_attributes_kernels_to_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(_fake_ncu(tmp_path)))
    shapes = [AttentionShape(1, 1, 64, 16), AttentionShape(1, 1, 128, 16)]
    m = traffic.measure_attention("naive", shapes)
    assert m.message == ""
    assert m.traffic[0] is not None and m.traffic[1] is not None
    assert m.traffic[0].read == round(8.42e6) + 2048  # two kernels in range 0
    assert m.traffic[1].write == round(268.44e6)


def test_measure_child_runs_compiled_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # TRITON_INTERPRET=1 (set for counting) must not reach the measured child
    seen = tmp_path / "interpret.txt"
    script = _fake_ncu(tmp_path)
    script.write_text(
        script.read_text()
        + f"open({str(seen)!r}, 'w').write(__import__('os').environ.get('TRITON_INTERPRET', '-'))\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(script))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shapes = [AttentionShape(1, 1, 64, 16), AttentionShape(1, 1, 128, 16)]  # as the sample
    m = traffic.measure_attention("naive", shapes)
    assert m.message == ""
    assert seen.read_text() == "-"


def test_measure_without_gpu_or_ncu(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = AttentionShape(1, 1, 64, 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m = traffic.measure_attention("flashlite", [shape])
    assert m.traffic == [None] and "CUDA" in m.message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "find_ncu", lambda: None)
    m = traffic.measure_attention("flashlite", [shape])
    assert m.traffic == [None] and "ncu" in m.message


def test_shape_json_round_trip() -> None:
    shape = AttentionShape(2, 8, 100, 64, seq_k=50, kv_heads=2, dtype=torch.float16, causal=True)
    assert AttentionShape.from_json(json.loads(json.dumps(shape.to_json()))) == shape
    with pytest.raises(ValueError, match="kv_heads"):
        AttentionShape(1, 3, 8, 8, kv_heads=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_one_config_on_gpu() -> None:
    if traffic.find_ncu() is None:
        pytest.skip("ncu not found")
    shape = AttentionShape(1, 8, 2048, 64, dtype=torch.bfloat16)
    m = traffic.measure_attention("flashlite", [shape], timeout=300)
    if m.traffic[0] is None and "permitted" in m.message:
        pytest.skip(m.message)
    assert m.traffic[0] is not None, m.message
    comp = traffic.compulsory_attention(shape)
    # caches are flushed before the kernel: Q, K, V must come from DRAM at least once
    assert m.traffic[0].read >= 0.9 * comp.read
    assert os.environ.get("FLASHLITE_ATTENTION_CONFIG") or m.configs.get(0)
    # the backward alone: its kernels read Q, K, V, O, dO (and the statistics) at least once,
    # and naive autograd's N x N tensors make it move more
    bwd = {meth: traffic.measure_attention(meth, [shape], timeout=300, backward=True)
           for meth in ("flashlite", "naive")}  # fmt: skip
    flash, naive = bwd["flashlite"].traffic[0], bwd["naive"].traffic[0]
    assert flash is not None, bwd["flashlite"].message
    assert naive is not None, bwd["naive"].message
    assert flash.read >= 0.9 * 5 * comp.read / 3 and naive.total > flash.total


def test_team_softmax_model_reads_once() -> None:
    # GPU-only kernel (model only): one read and one write of x plus the (m, s) workspace
    rows, n = 8, 262144
    t = traffic.model_softmax(rows, n, torch.bfloat16, "team")
    e = rows * n * 2
    chunks = -(-n // (softmax_kernels.TEAM_CHUNK_BYTES[2] // 2))  # chunks of bf16
    assert t.parts["x"] == [e, 0] and t.parts["y"] == [0, e]
    assert t.parts["workspace"] == [8 * rows * chunks**2, 8 * rows * chunks]
    assert t.parts["counters"] == [0, 4 * rows]


def test_prefetch_softmax_model_reads_once() -> None:
    # GPU-only Gluon kernel (model only): one read and one write of x plus one word per chunk
    from flashlite.kernels import softmax_gluon

    rows, n = 8, 262144
    t = traffic.model_softmax(rows, n, torch.bfloat16, "prefetch")
    e = rows * n * 2
    chunks = -(-n // (softmax_gluon.CHUNK_BYTES // 2))
    assert t.parts["x"] == [e, 0] and t.parts["y"] == [0, e]
    assert t.parts["workspace"] == [8 * rows * chunks**2, 2 * 8 * rows * chunks]
    d = traffic.dram_softmax(rows, n, torch.bfloat16, "prefetch")
    assert d.parts["x"] == [e, 0]


# --------------------------------------------------------------------------- the GPU's tiles
@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [16, 64, 128])
def test_default_tiles_count_no_more_than_naive(d: int, dtype: torch.dtype, causal: bool) -> None:
    # counted with the config the H200 table runs: at N >= 64 flashlite moves fewer bytes than
    # naive (the interpreter's old 16x16 tile re-read K/V once per 16 queries and did not)
    for n in (64, 200):
        shape = AttentionShape(1, 2, n, d, dtype=dtype, causal=causal)
        counted = traffic.count_attention("flashlite", shape)
        naive = traffic.count_attention("naive", shape)
        model = traffic.model_flashlite_attention(shape)
        assert counted is not None and naive is not None
        assert (counted.read, counted.write) == (model.read, model.write)
        assert counted.total <= naive.total, (n, counted.total, naive.total)
        assert counted.info["config"] == traffic.flashlite_config(shape)["config"]
        assert counted.info["gpu"] == "h200"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gpu", ["h200", "generic"])
def test_default_tiles_model_no_more_than_naive(gpu: str, dtype: torch.dtype, causal: bool) -> None:
    # the issued-bytes model (equal to the count, above) at lengths too long to interpret
    for d in (16, 32, 64, 96, 128):
        for n in (64, 100, 1024, 4096, 16384):
            shape = AttentionShape(1, 16, n, d, dtype=dtype, causal=causal)
            cfg = traffic.flashlite_config(shape, gpu=gpu)
            flash = traffic.model_flashlite_attention(shape, cfg["BLOCK_M"], cfg["BLOCK_N"])
            naive = traffic.model_naive_attention(shape)
            assert flash.total <= naive.total, (d, n, cfg["config"], flash.total, naive.total)


def test_gpu_tables_and_named_configs() -> None:
    big = AttentionShape(1, 16, 4096, 128, dtype=torch.bfloat16, causal=True)
    # the H200 runs the Gluon kernel here (128-row blocks, 128-key tiles, 3 slots)
    assert traffic.flashlite_config(big, gpu="h200")["config"] == "128x128x4x3+warp"
    mid = AttentionShape(1, 16, 2048, 64, dtype=torch.bfloat16, causal=True)  # D=64 below 4k keys
    assert traffic.flashlite_config(mid, gpu="h200")["config"] == "64x64x4x3"
    assert traffic.flashlite_config(big, gpu="generic")["config"] == "128x128x8x3+lazy"
    small = AttentionShape(1, 2, 128, 64, dtype=torch.bfloat16)
    assert traffic.flashlite_config(small, gpu="generic")["config"] == "64x64x4x2"
    pinned = traffic.parse_config("32x16", 64, torch.float16)
    assert traffic.flashlite_config(small, config=pinned)["config"] == "32x16x4x2"
    with pytest.raises(ValueError, match="gpu="):
        traffic.flashlite_config(small, gpu="a100")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("48x64", "powers of two"),
        ("64", "BMxBN"),
        ("64x64x3x2", "warps"),
        ("abc", "BMxBN"),
        ("256x256x1x4", "does not fit head dim 128"),
    ],  # fmt: skip
)
def test_bad_config(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        traffic.parse_config(text, 128, torch.float32)


# --------------------------------------------------------------------------- DRAM estimate
MEASURED = Path(__file__).parents[1] / "benchmarks" / "results" / "traffic-nvidia-h200.json"


def test_dram_estimate_against_the_h200_measurements() -> None:
    # ncu's DRAM bytes (cold L2 per kernel) from the committed H200 run: the estimate must stay
    # within 15% for flashlite and naive, every measured N, D, causal or not
    data = json.loads(MEASURED.read_text())
    l2_bytes = data["meta"]["l2_bytes"]
    assert l2_bytes == 60 * 2**20
    checked = 0
    for r in data["rows"]:
        if r["method"] not in ("naive", "flashlite") or not r.get("measured_bytes"):
            continue
        shape = AttentionShape(r["batch"], r["heads"], r["seq_len"], r["head_dim"],
                               dtype=getattr(torch, r["dtype"]), causal=r["causal"])  # fmt: skip
        tiles = {k: v for k, v in (r.get("config") or {}).items() if k.isupper() or "num" in k}
        est = traffic.dram_attention(r["method"], shape, l2_bytes=l2_bytes, **tiles)
        assert est is not None
        ratio = est.total / r["measured_bytes"]
        assert 0.85 <= ratio <= 1.15, (r["method"], r["seq_len"], r["head_dim"], ratio)
        checked += 1
    assert checked >= 24


def test_dram_estimate_levels() -> None:
    shape = AttentionShape(1, 16, 16384, 128, dtype=torch.bfloat16, causal=True)
    issued = traffic.model_flashlite_attention(shape)
    dram = traffic.dram_flashlite_attention(shape)
    comp = traffic.compulsory_attention(shape)
    # K/V re-reads hit L2: DRAM reads are the compulsory reads, far below the issued ones (the
    # H200's Gluon kernel: 128-row blocks, so K and V are issued 64 times per head at N = 16k)
    assert dram.read == comp.read and issued.read > 40 * dram.read
    # a head whose query blocks take two waves (N = 32k: 256 blocks, 132 programs in flight)
    # re-reads its K/V from DRAM in the second one when they do not fit in L2
    long = AttentionShape(1, 16, 32768, 128, dtype=torch.bfloat16, causal=True)
    fits = traffic.dram_flashlite_attention(long)
    small = traffic.dram_flashlite_attention(long, l2_bytes=2**20)
    assert fits.info["kv_reads_per_head"] == 1 and small.info["kv_reads_per_head"] == 2
    assert fits.read < small.read <= traffic.model_flashlite_attention(long).read
    naive = traffic.dram_naive_attention(shape)
    assert naive.read == traffic.model_naive_attention(shape).read  # cold L2 per kernel
    assert naive.write < traffic.model_naive_attention(shape).write
    with pytest.raises(ValueError, match="positive"):
        traffic.dram_naive_attention(shape, l2_bytes=0)


# --------------------------------------------------------------------------- softmax traffic
@pytest.mark.interpreter
def test_softmax_rows_issued_counted_and_dram() -> None:
    rows, notes = traffic.softmax_rows(8, 3000, torch.float16, count=True)
    by = {r["method"]: r for r in rows}
    e = 8 * 3000 * 2
    # the lesson in bytes: three passes read x three times, the online form twice, single-read once
    assert by["flashlite-three_pass"]["model_read"] == 3 * e
    assert by["flashlite-online"]["model_read"] == 2 * e
    assert by["flashlite-single_read"]["model_read"] == e
    for name in ("flashlite-three_pass", "flashlite-online", "flashlite-single_read"):
        assert by[name]["counted_bytes"] == by[name]["model_bytes"]
        assert by[name]["dram_read"] == e  # small rows stay in L2 between the passes
    assert by["flashlite-team"]["counted_bytes"] is None  # GPU-only: modelled
    assert by["flashlite-prefetch"]["counted_bytes"] is None
    assert not notes


def test_softmax_dram_rereads_when_rows_outgrow_l2() -> None:
    for algorithm, passes in (("three_pass", 3), ("online", 2), ("single_read", 1)):
        fits = traffic.dram_softmax(1024, 4096, torch.float32, algorithm)
        tight = traffic.dram_softmax(1024, 4096, torch.float32, algorithm, l2_bytes=2**20)
        assert fits.info["x_reads"] == 1 and tight.info["x_reads"] == passes
    split = traffic.dram_softmax(64, 262144, torch.float32, "split")
    assert split.info["x_reads"] == 2  # two kernels, each from a cold L2


# --------------------------------------------------------------------------- backward
@pytest.mark.interpreter
@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["dO", "dO+dlse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", ATTENTION_SHAPES, ids=lambda d: "x".join(map(str, d)))
def test_backward_counted_equals_model(
    dims: tuple[int, ...], causal: bool, with_lse_grad: bool
) -> None:
    b, h, hkv, nq, nk, d = dims
    shape = AttentionShape(b, h, nq, d, seq_k=nk, kv_heads=hkv, dtype=torch.float16,
                           causal=causal)  # fmt: skip
    flash, naive = traffic.count_attention_bwd(shape, with_lse_grad=with_lse_grad)
    model = traffic.model_flashlite_attention_bwd(shape, with_lse_grad=with_lse_grad)
    assert (flash.read, flash.write) == (model.read, model.write)
    assert naive.total > 0


@pytest.mark.interpreter
def test_backward_rows_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from flashlite import cli

    argv = ["traffic", "--backward", "--seq", "64", "--heads", "2", "--head-dim", "32",
            "--count", "--quiet", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {r["method"]: r for r in rows}
    assert by["flashlite-bwd"]["counted_bytes"] == by["flashlite-bwd"]["model_bytes"]
    assert by["flashlite-bwd"]["counted_bytes"] < by["naive-bwd"]["counted_bytes"]


@pytest.mark.interpreter
def test_ncu_child_runs_one_range_per_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # what runs inside ncu, on CPU: warm-up outside the ranges, one range per shape/algorithm
    from flashlite.traffic import measure

    ranges: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", ranges.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    shapes = [_shape(1, 1, 1, 16, 16, 16, torch.float32, False).to_json()] * 2
    for spec in (
        {"method": "naive", "shapes": shapes},
        {"kind": "softmax", "rows": 2, "n": 40, "dtype": "float32",
         "algorithms": ["online", "torch"]},
        {"kind": "attention_bwd", "method": "flashlite", "shapes": shapes},
        {"kind": "attention_bwd", "method": "naive", "shapes": shapes},
    ):  # fmt: skip
        report_path = tmp_path / "report.json"
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({**spec, "device": "cpu", "report": str(report_path)}))
        ranges.clear()
        measure._child_main(str(spec_path))
        assert ranges == ["flt_0000_", "flt_0001_"]
        assert json.loads(report_path.read_text())["errors"] == {}


def test_backward_measure_without_a_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashlite import cli

    with pytest.raises(ValueError, match="method='sdpa-flash'"):
        traffic.measure_attention("sdpa-flash", [], backward=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the library: the model's rows, nothing measured, a note saying why
    shape = AttentionShape(1, 1, 32, 16)
    rows, notes = traffic.backward_rows([shape], measure=True, show_progress=False)
    assert all(r["measured_bytes"] is None for r in rows)
    assert any("no CUDA device" in n for n in notes)
    # the command refuses before it starts, with or without --count
    argv = ["traffic", "--backward", "--seq", "32", "--heads", "1", "--head-dim", "16",
            "--measure", "--quiet", "--json"]  # fmt: skip
    for extra in ([], ["--count"]):
        with pytest.raises(SystemExit) as exc:
            cli.main([*argv, *extra])
        assert exc.value.code == 2
        assert "flashlite traffic: error: --measure needs a CUDA GPU" in capsys.readouterr().err


BWD_MEASURED = MEASURED.with_name("traffic-bwd-nvidia-h200.json")


def test_backward_dram_estimate_against_the_h200_measurements() -> None:
    # ncu's DRAM bytes of flashlite's three backward kernels (committed H200 run): within 15%
    data = json.loads(BWD_MEASURED.read_text())
    checked = 0
    for r in data["rows"]:
        if r["method"] != "flashlite-bwd" or not r.get("measured_bytes"):
            continue
        shape = AttentionShape.from_json(r["shape"])
        est = traffic.dram_flashlite_attention_bwd(shape, l2_bytes=data["meta"]["l2_bytes"])
        ratio = est.total / r["measured_bytes"]
        assert 0.85 <= ratio <= 1.15, (r["seq_len"], shape.head_dim, shape.causal, ratio)
        # and far below the issued bytes, which count every L2 hit
        assert r["measured_bytes"] < r["model_bytes"] / 4
        checked += 1
    assert checked == 8


# --------------------------------------------------------------------------- decode (issue 11)
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


# ---------------------------------------------------------------------- cross-entropy (issue 12)
@pytest.mark.parametrize("weight", [False, True], ids=["plain", "weight"])
@pytest.mark.parametrize("path", ["single", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_counted_equals_model(dtype, path, weight, monkeypatch) -> None:  # noqa: ANN001
    # the fused kernel reads each row once (twice on the loop path) and writes its gradient;
    # the backward's scaling kernel reads and writes the gradient again
    from flashlite.kernels import cross_entropy as kce

    if path == "loop":
        monkeypatch.setattr(kce, "SINGLE_READ_MAX", 8)
        monkeypatch.setattr(kce, "LOOP_TILE", 256)
    model = traffic.model_cross_entropy(5, 1000, dtype, weight_bytes=4 if weight else 0)
    counted, torch_ops = traffic.count_cross_entropy(5, 1000, dtype, weight=weight)
    assert (counted.read, counted.write) == (model.read, model.write)
    assert model.info["passes"] == (2 if path == "loop" else 1)
    if not weight:  # (each row re-reads the class weights: more issued bytes at this tiny size)
        assert torch_ops.total > counted.total


@pytest.mark.parametrize("smoothing", [False, True])
def test_cross_entropy_prefetch_model_reads_logits_once(smoothing: bool) -> None:
    # GPU-only Gluon kernel (model only): the Triton loop reads a 128k row twice, the team once,
    # plus the targets and words each of a row's programs reads
    from flashlite.kernels import softmax_gluon

    rows, n = 4, 131072
    loop = traffic.model_cross_entropy(rows, n, torch.bfloat16, backward=False)
    team = traffic.model_cross_entropy(rows, n, torch.bfloat16, backward=False, prefetch=True,
                                       smoothing=smoothing)  # fmt: skip
    chunks = -(-n // (softmax_gluon.CHUNK_BYTES // 2))
    words = chunks * (2 if smoothing else 1)
    assert loop.parts["logits"] == [2 * rows * n * 2, 0] and team.parts["logits"] == [
        rows * n * 2,
        0,
    ]
    assert team.parts["words"] == [8 * rows * chunks * words, 16 * rows * words + 16]
    assert team.parts["target, gradient scale"] == [rows * chunks * 8, 0]
    # the mean's count, the check and the loss sum happen inside the team kernel
    assert (
        team.parts["count, check: targets"] == [rows * 8, 0] and "scale: targets" not in team.parts
    )
    assert team.parts["loss sum"] == [rows * 4, 4]
    assert team.parts["gradient"] == loop.parts["gradient"]
    with pytest.raises(ValueError, match="class weights"):
        traffic.model_cross_entropy(rows, n, torch.bfloat16, weight_bytes=4, prefetch=True)


def test_cross_entropy_traffic_cli(capsys: pytest.CaptureFixture) -> None:
    from flashlite import cli

    assert cli.main(["traffic", "--ce", "--rows", "3", "--n", "500", "--count", "--quiet",
                     "--json"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["flashlite-ce", "torch-ce"]
    assert rows[0]["model_bytes"] == rows[0]["counted_bytes"]


# --------------------------------------------------------------------------- shared prefix
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
