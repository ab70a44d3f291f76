"""Plain Python mask functions, as FlexAttention users write them: evaluated once per block mask,
kept as bits on the partial tiles, read by the flex kernels. Forward and backward against the
fp64 reference on the dense mask; the bits against the dense mask; the tables against the
gallery's jit masks; only partial tiles stored; torch's BlockMask of a Python mask."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
from conftest import TOL
from flex_helpers import assert_fp32_against_fp64

import flashlite
from flashlite import reference
from flashlite.masking import block_mask as BM
from flashlite.masking import gallery, mods
from flashlite.masking.classify import torch_classify
from flashlite.masking.mod_calls import torch_indices, torch_mask
from flashlite.masking.python_masks import BITS_NAME, EMPTY_SLOT, FULL_SLOT

N, D, BLOCK = 72, 16, 32  # a ragged last tile both ways
B, HQ, HKV = 2, 4, 2
Fn = Callable[..., torch.Tensor]


def _masks(n: int = N, device: str = "cpu") -> dict[str, tuple[Fn, bool, bool]]:
    """name -> (mask, depends on b, depends on h), for length ``n``; closures over tensors on
    ``device``."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randint(0, 4, (B, n), generator=gen), dim=1).values.to(device)
    rand = (torch.rand(B, HQ, n, n, generator=gen) < 0.3).to(device)
    side = 8  # N = 72 tokens: a 9 x 8 image, row-major

    def neighbourhood(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        dr = (q_idx // side - kv_idx // side).abs()
        dc = (q_idx % side - kv_idx % side).abs()
        return (dr <= 1) & (dc <= 1)

    return {
        "causal": (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, False, False),
        "sliding_window": (lambda b, h, q, k: (q >= k) & (q - k <= 20), False, False),
        "prefix_lm": (lambda b, h, q, k: (k < 10) | (q >= k), False, False),
        "document_causal": (lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (q >= k), True, False),
        "dilated": (lambda b, h, q, k: (q >= k) & ((q - k) % 3 == 0), False, False),
        "neighbourhood_2d": (neighbourhood, False, False),
        # (the diagonal kept: every row sees a key)
        "random": (lambda b, h, q, k: rand[b, h, q, k] | (q == k), True, True),
    }


NAMES = list(_masks())


def _dense(fn: Fn, b: int, h: int, nq: int = N, nk: int = N, device: str = "cpu") -> torch.Tensor:
    return torch.as_tensor(fn(*torch_indices(b, h, nq, nk, device))).expand(b, h, nq, nk)


@triton.jit
def _unused(b, h, q_idx, kv_idx, dense):
    return q_idx >= 0


def _dense_mod(dense: torch.Tensor) -> mods.MaskMod:
    """The dense bools as a mod whose twin the reference applies (its jit side never runs)."""
    return mods.mask_mod(_unused, dense, torch_fn=lambda b, h, q, k, m: m[b, h, q, k],
                         name="tests.python_masks.dense")  # fmt: skip


def _check_against_fp64(bm: object, dense: torch.Tensor, nk: int = N) -> None:
    """flex_attention with ``bm`` (GQA, fp32), output, LSE and gradients against fp64."""
    q = torch.randn(B, HQ, N, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, nk, D, requires_grad=True) for _ in range(2))
    out = flashlite.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert_fp32_against_fp64(out, [q, k, v], mask_mod=_dense_mod(dense))


@pytest.mark.parametrize("name", NAMES)
def test_python_mask_forward_backward_fp32(name: str) -> None:
    fn, by_b, by_h = _masks()[name]
    bm = flashlite.create_block_mask(fn, B if by_b else None, HQ if by_h else None, N, N,
                                     device="cpu", BLOCK_SIZE=BLOCK)  # fmt: skip
    assert bm.mask_mod.name == BITS_NAME
    _check_against_fp64(bm, _dense(fn, B, HQ).expand(B, HQ, N, N))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block", [(16, 16), (32, 16), (16, 64)])
def test_bits_reproduce_the_dense_mask(name: str, block: tuple[int, int]) -> None:
    """The bits mod's twin gives the dense mask exactly, on every pair (partial tiles from the
    bits, the others from their slot); the classes are the classifier's of the same bools."""
    fn, by_b, by_h = _masks()[name]
    b, h = (B if by_b else 1), (HQ if by_h else 1)
    bm = flashlite.create_block_mask(fn, b if by_b else None, h if by_h else None, N, N,
                                     device="cpu", BLOCK_SIZE=block)  # fmt: skip
    dense = _dense(fn, b, h)
    assert torch.equal(torch_mask(bm.mask_mod, b, h, N, N), dense)
    twin = torch_classify(_dense_mod(dense), b, h, N, N, block)
    assert torch.equal(bm.classes(), twin)


def test_bits_kernel_side_reads_the_same_bits() -> None:
    """The jit bits mask, run by the tile classifier's kernel, classifies as the twin does."""
    from flashlite.masking.classify import _classify_tiles_kernel  # noqa: PLC2701

    fn, _, _ = _masks()["random"]
    bm = flashlite.create_block_mask(fn, B, HQ, N, N, device="cpu", BLOCK_SIZE=16)
    mod = bm.mask_mod
    got = torch.empty(B, HQ, 5, 5, dtype=torch.int8)
    bufs, n_buf = mods.kernel_buffers(mod.buffers)
    _classify_tiles_kernel[(5, B * HQ)](got, HQ, N, N, 5, *bufs, MASK_MOD=mod.fn, N_BUF=n_buf,
                                        BLOCK_M=16, BLOCK_N=16)  # fmt: skip
    assert torch.equal(got, bm.classes())


@pytest.mark.parametrize(
    ("name", "jit"),
    [
        ("causal", lambda ids: gallery.causal()),
        ("sliding_window", lambda ids: gallery.sliding_window(20)),
        ("prefix_lm", lambda ids: gallery.prefix_lm(10)),
    ],
)
def test_python_mask_and_gallery_mask_give_the_same_tables(name: str, jit: Callable) -> None:
    fn, _, _ = _masks()[name]
    ours = flashlite.create_block_mask(fn, None, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    theirs = flashlite.create_block_mask(jit(None), None, None, N, N, device="cpu",
                                         BLOCK_SIZE=BLOCK)  # fmt: skip
    for name_ in BM._TABLES:  # noqa: SLF001
        assert torch.equal(getattr(ours, name_), getattr(theirs, name_)), name_


def test_document_causal_python_and_gallery_tables_agree() -> None:
    ids = torch.sort(torch.randint(0, 4, (B, N)), dim=1).values.to(torch.int32)
    long_ids = ids.long()
    ours = flashlite.create_block_mask(
        lambda b, h, q, k: (long_ids[b, q] == long_ids[b, k]) & (q >= k),
        B, None, N, N, device="cpu", BLOCK_SIZE=16,
    )  # fmt: skip
    theirs = flashlite.create_block_mask(gallery.document_causal(ids), B, None, N, N,
                                         device="cpu", BLOCK_SIZE=16)  # fmt: skip
    assert torch.equal(ours.classes(), theirs.classes())


def test_only_mixed_tiles_keep_bits() -> None:
    """Causal at N = 72, tile 32: the three diagonal tiles are mixed, so three tiles of bits
    (32 rows of one int32 word each); every other tile has a slot of empty or full."""
    fn, _, _ = _masks()["causal"]
    bm = flashlite.create_block_mask(fn, None, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    slot, bits, _ = bm.mask_mod.buffers
    classes = bm.classes()
    assert bits.shape == (3, 32, 1) and bits.dtype == torch.int32
    assert torch.equal(slot[0, 0].diagonal(), torch.arange(3, dtype=torch.int32))
    assert bool((slot[classes == BM.EMPTY] == EMPTY_SLOT).all())
    assert bool((slot[classes == BM.FULL] == FULL_SLOT).all())
    # a bigger sparse mask stores far less than its dense bools
    n = 512
    big = flashlite.create_block_mask(fn, None, None, n, n, device="cpu", BLOCK_SIZE=64)
    stored = sum(t.numel() * t.element_size() for t in big.mask_mod.tensors())
    assert int((big.classes() == BM.PARTIAL).sum()) == big.mask_mod.buffers[1].shape[0] == 8
    assert stored < n * n / 8 / 4


def test_scalar_style_mask_is_vmapped_and_non_bool_is_refused() -> None:
    """A mask that only works on scalars (a Python ``if``) is vmapped as torch does."""

    def odd_rows_see_all(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.where(q_idx % 2 == 1, True, q_idx >= kv_idx)

    def with_if(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        if q_idx.dim() > 0:
            raise RuntimeError("scalars only")
        return odd_rows_see_all(b, h, q_idx, kv_idx)

    bm = flashlite.create_block_mask(with_if, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(
        torch_mask(bm.mask_mod, 1, 1, 40, 40), _dense(odd_rows_see_all, 1, 1, 40, 40)
    )
    with pytest.raises(TypeError, match="must return a bool tensor"):
        flashlite.create_block_mask(lambda b, h, q, k: q - k, None, None, 40, 40, device="cpu")
    with pytest.raises(TypeError, match=r"did you mean `gallery\.causal\(\)`\?"):
        flashlite.create_block_mask(gallery.causal, None, None, 8, 8, device="cpu")


def test_torch_block_mask_of_a_python_mask_is_accepted() -> None:
    """torch's BlockMask of a plain Python mask runs as flashlite's own of the same function;
    converted once per BlockMask; held to torch's tables (a hand-made one's empty blocks)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    fn, _, _ = _masks()["document_causal"]
    theirs = torch_create(fn, B, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    ours = flashlite.create_block_mask(fn, B, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = torch.randn(B, HQ, N, D), torch.randn(B, HKV, N, D), torch.randn(B, HKV, N, D)
    a = flashlite.flex_attention(q, k, v, block_mask=ours)
    assert torch.equal(a, flashlite.flex_attention(q, k, v, block_mask=theirs))
    from flashlite.masking.create import _CONVERTED  # noqa: PLC2701

    assert theirs in _CONVERTED
    _check_against_fp64(theirs, _dense(fn, B, 1).expand(B, HQ, N, N))
    # a hand-made BlockMask: key block 0 only, partial, with the mask doing nothing
    nb = BM.cdiv(N, BLOCK)
    hand = TorchBlockMask.from_kv_blocks(
        torch.ones(1, 1, nb, dtype=torch.int32),
        torch.zeros(1, 1, nb, nb, dtype=torch.int32),
        BLOCK_SIZE=BLOCK,
        mask_mod=lambda b, h, q, k: q >= 0,
        seq_lengths=(N, N),
    )
    dense = (torch.arange(N) < BLOCK).expand(B, HQ, N, N)
    _check_against_fp64(hand, dense)


@pytest.mark.parametrize("takes", [True, False], ids=["gluon", "switched-off"])
def test_the_gluon_kernels_take_the_bits(takes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Hopper flex kernels run (forced here on the CPU, their plans stubbed to fail,
    so the Triton flex kernels compute), a plain Python mask's call plans them forward and
    backward, unless ``GLUON_TAKES_BITS`` is off."""
    from flashlite import _caches
    from flashlite.kernels.attention.hopper import HopperConfig
    from flashlite.ops.attention.backends.tables import args as TA
    from flashlite.ops.attention.backends.tables import bwd as TB
    from flashlite.ops.attention.backends.tables import fwd as TF

    called: list[str] = []
    monkeypatch.setattr(TA, "GLUON_TAKES_BITS", takes)
    _caches.clear()
    monkeypatch.setattr(TF, "hopper_config", lambda *a: HopperConfig(128, 128, 3))
    monkeypatch.setattr(TF, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TF, "plan_flex_fwd", lambda *a, **k: called.append("fwd"))
    monkeypatch.setattr(TB, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(TB, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TB, "plan_flex_bwd", lambda *a, **k: called.append("bwd"))
    n = 130  # (a ragged second tile of the 128 x 128 tables the Hopper kernels take)
    bm = flashlite.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n)
    assert bm.mask_mod.name == BITS_NAME
    q, k, v = (torch.randn(1, 2, n, D, requires_grad=True) for _ in range(3))
    out = flashlite.flex_attention(q, k, v, block_mask=bm)
    out.sum().backward()
    ref = reference.attention(*(t.detach().double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert called == (["fwd", "bwd"] if takes else [])


def test_compiled_matches_eager_and_passes_opcheck() -> None:
    """A plain Python mask's bits travel as the op's tensors: a fullgraph compile agrees with
    eager bit for bit over two masks and lengths, and opcheck passes."""
    from torch.library import opcheck

    from flashlite.ops.attention.flex import FLEX_FWD, table_request

    def step(q, k, v, bm):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, block_mask=bm)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(5)
    for n, window in ((40, 7), (56, 11)):
        ids = torch.sort(torch.randint(0, 3, (1, n), generator=gen), dim=1).values

        def mask(b, h, q_idx, kv_idx, ids=ids, window=window):  # noqa: ANN001, ANN202
            near = (q_idx - kv_idx).abs() <= window
            return near & (ids[b, q_idx] == ids[b, kv_idx])

        bm = flashlite.create_block_mask(mask, 1, None, n, n, BLOCK_SIZE=16)
        q, k, v = (torch.randn(1, 2, n, D, generator=gen, requires_grad=True) for _ in range(3))
        o = compiled(q, k, v, bm)
        o.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        e = step(q, k, v, bm)
        e.sum().backward()
        assert torch.equal(o, e)
        assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v), strict=True))
    fields, named = FLEX_FWD.fields.flat(table_request(bm, 0.25))
    args = (q.detach(), k.detach(), v.detach(), *fields)
    opcheck(torch.ops.flashlite.flex_attention_fwd.default, args, named)


def test_traffic_model_equals_count() -> None:
    """The tables' model of the forward's bytes, the bits' reads included (a slot and a word
    per pair on partial tiles, as issued), equals the interpreter's count."""
    from flashlite.traffic import AttentionShape, count_flex_attention, model_flex_attention

    shape = AttentionShape(B, HQ, N, D, kv_heads=HKV, dtype=torch.float16)
    fn = _masks()["document_causal"][0]
    bm = flashlite.create_block_mask(fn, B, None, N, N, BLOCK_SIZE=BLOCK)
    model, counted = model_flex_attention(shape, bm), count_flex_attention(shape, bm)
    assert (model.read, model.write) == (counted.read, counted.write)
    assert model.info["mods_modelled"] and model.info["empty"] > 0


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_python_mask_against_fp64(
    name: str, dtype: torch.dtype, gluon: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention-gym set as plain Python on the GPU, GQA, a ragged last tile, forward and
    backward: the error against fp64 is within 2x that of torch's SDPA on the same dense mask.
    ``gluon``: the Hopper flex kernels may read the bits (D 128; taken on sm_90), else the
    Triton flex kernels (D 64)."""
    import torch.nn.functional as F

    from flashlite import _caches
    from flashlite.ops.attention.backends.tables import args as TA
    from flashlite.ops.attention.backends.tables import fwd as TF

    n, d = 1000, (128 if gluon else 64)
    monkeypatch.setattr(TA, "GLUON_TAKES_BITS", gluon)
    _caches.clear()
    gluon_fwd: list[int] = []
    plan = TF.plan_flex_fwd
    monkeypatch.setattr(TF, "plan_flex_fwd", lambda *a, **k: gluon_fwd.append(1) or plan(*a, **k))
    fn, by_b, by_h = _masks(n, "cuda")[name]
    bm = flashlite.create_block_mask(fn, B if by_b else None, HQ if by_h else None, n, n)
    assert bm.mask_mod.name == BITS_NAME
    dense = _dense(fn, B, HQ, n, n, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(B, HQ, n, d), (B, HKV, n, d), (B, HKV, n, d)]
    base = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) for s in shapes]
    do = torch.randn_like(base[0])
    ours = [t.clone().requires_grad_() for t in base]
    sdpa = [t.clone().requires_grad_() for t in base]
    exact = [t.double().requires_grad_() for t in base]
    o = flashlite.flex_attention(*ours, block_mask=bm)
    t_o = F.scaled_dot_product_attention(*sdpa, attn_mask=dense, enable_gqa=True)
    e_o = reference.attention(*exact, mask_mod=_dense_mod(dense))
    for out in (o, t_o, e_o):
        out.backward(do.to(out.dtype))
    floor = TOL[dtype].floor
    assert (o.double() - e_o).abs().max() <= 2 * (t_o.double() - e_o).abs().max() + floor
    for a, t, e in zip(ours, sdpa, exact, strict=True):
        err = (a.grad.double() - e.grad).abs().max()
        assert err <= 2 * (t.grad.double() - e.grad).abs().max() + 4 * floor
    if torch.cuda.get_device_capability() == (9, 0):  # (the Gluon flex kernels are sm_90's)
        assert bool(gluon_fwd) == gluon


@pytest.mark.gpu
def test_gpu_torch_block_mask_of_a_python_mask() -> None:
    """torch's BlockMask of a plain Python mask, made on the GPU, runs as flashlite's own."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    n, d = 1000, 64
    fn, _, _ = _masks(n, "cuda")["document_causal"]
    theirs = torch_create(fn, B, None, n, n, device="cuda")
    ours = flashlite.create_block_mask(fn, B, None, n, n)
    q = torch.randn(B, HQ, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a = flashlite.flex_attention(q, k, v, block_mask=ours)
    tol = TOL[torch.bfloat16]
    b = flashlite.flex_attention(q, k, v, block_mask=theirs)
    torch.testing.assert_close(b, a, atol=tol.atol, rtol=tol.rtol)
