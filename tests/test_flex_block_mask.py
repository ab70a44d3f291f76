"""BlockMask: the tile classifier against its twin, the tables it lists, torch's BlockMask
handed over or converted, its summary, the kernels' table strides and bad block masks."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in jit functions' globals)
from flex_helpers import BLOCK, D, N, _gallery, _ids

import flashlite
from flashlite.masking import block_mask as BM
from flashlite.masking import gallery
from flashlite.masking.classify import torch_classify


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document",
                                  "document_causal"])  # fmt: skip
@pytest.mark.parametrize("block", [(16, 16), (32, 16), (16, 64)])
def test_classifier_matches_its_twin(name: str, block: tuple[int, int]) -> None:
    mm = _gallery(2, 2)[name][0]
    b = 2 if name.startswith("document") else 1
    got = flashlite.create_block_mask(mm, b, 3, N, N - 5, device="cpu", BLOCK_SIZE=block)
    want = torch_classify(mm, b, 3, N, N - 5, block)
    assert torch.equal(got.classes(), want)
    assert got.shape == (b, 3, N, N - 5) and block == got.BLOCK_SIZE


def test_tables_list_each_class_in_order() -> None:
    classes = torch.tensor([[[[2, 0, 1, 2], [0, 0, 0, 0], [1, 1, 2, 0]]]], dtype=torch.int8)
    bm = BM.BlockMask.from_classes(classes, (48, 64), (16, 16), gallery.causal())
    assert bm.full_kv_num_blocks.tolist() == [[[2, 0, 1]]]
    assert bm.full_kv_indices[0, 0, 0, :2].tolist() == [0, 3]
    assert bm.kv_num_blocks.tolist() == [[[1, 0, 2]]]
    assert bm.kv_indices[0, 0, 2, :2].tolist() == [0, 1]
    assert bm.q_num_blocks.tolist() == [[[1, 1, 1, 0]]]
    assert bm.full_q_indices[0, 0, 3, :1].tolist() == [0]
    assert torch.equal(bm.classes(), classes)
    assert bm.sparsity() == pytest.approx(6 / 12)


@pytest.mark.parametrize("torch_block", [16, 32, 64])
def test_torch_block_mask_gives_identical_results(torch_block: int) -> None:
    """torch's own create_block_mask on the same mod (it calls the twin), re-tiled to
    flashlite's 32: the same output, bit for bit."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    b, h = 2, 2
    mm = gallery.document_causal(_ids(b, N))
    ours = flashlite.create_block_mask(mm, b, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    theirs = torch_create(mm, b, None, N, N, device="cpu", BLOCK_SIZE=torch_block)
    converted = BM.BlockMask.from_torch(theirs, block_size=(BLOCK, BLOCK))
    assert converted.mask_mod is mm
    # converted tables may call more tiles partial (torch never calls a tile with ragged rows
    # full; a coarser torch block's pieces stay partial), never fewer
    assert ((converted.classes() == ours.classes()) | (converted.classes() == BM.PARTIAL)).all()
    q, k, v = (torch.randn(b, h, N, D) for _ in range(3))
    a = flashlite.flex_attention(q, k, v, block_mask=ours)
    assert torch.equal(a, flashlite.flex_attention(q, k, v, block_mask=converted))
    if torch_block == BLOCK:  # handed over as it is
        assert torch.equal(a, flashlite.flex_attention(q, k, v, block_mask=theirs))


def _py_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return q_idx >= kv_idx


_jit_causal = triton.jit(_py_causal)


def test_torch_block_mask_of_a_python_mask_and_the_jit_routes_agree() -> None:
    """torch's BlockMask of a plain Python mask runs (its mask kept as bits), and so does each
    route to a jit mask."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    n = 40
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    theirs = torch_create(_py_causal, None, None, n, n, device="cpu", BLOCK_SIZE=16)
    want = flashlite.attention(q, k, v, causal=True)
    routes = (
        flashlite.create_block_mask(_jit_causal, None, None, n, n, device="cpu", BLOCK_SIZE=16),
        torch_create(flashlite.mods.mask_mod(_jit_causal), None, None, n, n, device="cpu",
                     BLOCK_SIZE=16),
        flashlite.BlockMask.from_torch(theirs, mask_mod=_jit_causal),
    )  # fmt: skip
    for bm in (theirs, *routes):
        got = flashlite.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_block_mask_repr_is_a_short_summary() -> None:
    bm = flashlite.create_block_mask(gallery.causal(), 2, None, 256, 256, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip
    text = repr(bm)
    assert len(text) < 400, text
    assert text == ("BlockMask(shape=(2, 1, 256, 256), BLOCK_SIZE=(16, 16), sparsity=46.88%, "
                    "mask_mod=flashlite.gallery.causal)")  # fmt: skip
    assert bm.classes().shape == (2, 1, 16, 16)  # (the detailed view)


def test_bad_block_masks_raise_clear_errors() -> None:
    q = torch.randn(2, 2, 40, 16)
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 48, 48, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(48, 48\)"):
        flashlite.flex_attention(q, q, q, block_mask=bm)
    bm3 = flashlite.create_block_mask(gallery.causal(), 3, None, 40, 40, device="cpu",
                                      BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match="built for B=3"):
        flashlite.flex_attention(q, q, q, block_mask=bm3)
    cls = bm3.classes()[:1]
    wrong = BM.BlockMask.from_classes(cls, (40, 40), (32, 32), gallery.causal())  # 16's tables
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks is \(1, 1, 3\)"):
        flashlite.flex_attention(q, q, q, block_mask=wrong)
    with pytest.raises(TypeError, match="block_mask must be a flashlite or torch BlockMask"):
        flashlite.flex_attention(q, q, q, block_mask=torch.ones(1))
    for bad in (24, 8, (16, 48), "128"):
        with pytest.raises(ValueError, match="BLOCK_SIZE must be a power of two"):
            flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, BLOCK_SIZE=bad)
    with pytest.raises(ValueError, match="Q_LEN must be an int >= 1"):
        flashlite.create_block_mask(gallery.causal(), None, None, 0, 40)
    with pytest.raises(ValueError, match="must divide one another"):
        from torch.nn.attention.flex_attention import create_block_mask as torch_create

        theirs = torch_create(gallery.causal(), None, None, 40, 40, device="cpu", BLOCK_SIZE=48)
        BM.BlockMask.from_torch(theirs, block_size=(32, 32))
    with pytest.raises(ValueError, match="ids must be"):
        gallery.document(torch.zeros(2, 3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="window must be an int"):
        gallery.sliding_window(-1)


@pytest.mark.parametrize("lead", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_table_strides_are_the_broadcast_views(lead: tuple[int, int]) -> None:
    """The kernels' table strides are those of the tables expanded to the call's (B, H): 0 along
    a dimension the mask ignores."""
    from flashlite.ops.attention.backends.tables.args import table_args

    num = torch.zeros(*lead, 5, dtype=torch.int32)
    idx = torch.zeros(*lead, 5, 7, dtype=torch.int32)
    want = (*num.expand(2, 4, 5).stride(), *idx.expand(2, 4, 5, 7).stride()[:3])
    assert table_args(num, idx) == want
