"""flashlite.masking holds everything that says which keys a query sees and what a mod adds, with
one public face (its ``__all__``); the older module paths are faces that give the same objects."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import torch

import flashlite
from flashlite import masking

#: the package's modules (the gallery is a namespace of its own: ``masking.gallery.causal()``)
MODULES = sorted(m.name for m in pkgutil.iter_modules(masking.__path__))

#: an older path -> the masking module whose names it re-exports (block_mask: and the twin of
#: the classifier, which moved to ``classify``)
FACES = {
    "flashlite.masks": "masks",
    "flashlite.mods": "mods",
    "flashlite.block_mask": "block_mask",
    "flashlite.gallery": "gallery",
}


def _public(module: types.ModuleType) -> set[str]:
    names = vars(module).items()
    return {n for n, x in names if not n.startswith("_") and not isinstance(x, types.ModuleType)}


def test_the_face_lists_every_public_name_of_the_package() -> None:
    expected = (
        "band block_mask classify create gallery masks mod_args mod_calls mods python_masks softcap"
    )
    assert expected.split() == MODULES
    listed = set(masking.__all__)
    assert len(listed) == len(masking.__all__), "a name listed twice"
    for name in MODULES:
        module = importlib.import_module(f"flashlite.masking.{name}")
        if name == "gallery":
            assert masking.gallery is module and "gallery" in listed
            continue
        missing = set(module.__all__) - listed
        assert not missing, f"flashlite.masking.{name} exports {missing}, the face does not"
        for n in module.__all__:
            assert getattr(masking, n) is getattr(module, n), n
    # the face only re-exports: every name it lists comes from one of its modules
    homes = {n for m in MODULES for n in getattr(masking, m).__all__ if m != "gallery"}
    homes |= {"registered_as"}  # (public in mods, outside its __all__: the registry's lookup)
    assert listed - {"gallery"} <= homes
    assert _public(masking) <= listed


@pytest.mark.parametrize("path", sorted(FACES))
def test_older_paths_give_the_same_objects(path: str) -> None:
    face = importlib.import_module(path)
    want = set(importlib.import_module(f"flashlite.masking.{FACES[path]}").__all__)
    assert want <= set(face.__all__), f"{path} lost {want - set(face.__all__)}"
    assert _public(face) == set(face.__all__), "a face holds no code of its own"
    where = masking.gallery if path == "flashlite.gallery" else masking
    for name in face.__all__:
        assert getattr(face, name) is getattr(where, name), f"{path}.{name}"
    assert getattr(flashlite, path.rpartition(".")[2]) is face


def test_the_names_users_import_are_the_package_s() -> None:
    from flashlite import gallery
    from flashlite.block_mask import torch_classify
    from flashlite.kernels.common import tanh
    from flashlite.mods import MaskMod, mask_mod, score_mod

    assert (mask_mod, score_mod, MaskMod) == (masking.mask_mod, masking.score_mod, masking.MaskMod)
    assert isinstance(gallery.causal(), masking.MaskMod)
    assert flashlite.BlockMask is masking.BlockMask
    assert flashlite.create_block_mask is masking.create_block_mask
    assert flashlite.ops.attention.create_block_mask is masking.create_block_mask
    assert flashlite.ops.attention.dense_block_mask is masking.dense_block_mask
    assert torch_classify is masking.torch_classify and tanh is masking.tanh
    assert flashlite.masking is masking and "masking" in flashlite.__all__


MOVED = ["ops.attention.block_mask", "ops.attention.mod_args", "kernels.attention.block_mask"]


@pytest.mark.parametrize("old", MOVED)
def test_moved_modules_left_no_copy(old: str) -> None:
    # (internal paths: their code lives in flashlite.masking only)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"flashlite.{old}")


def test_a_score_function_declares_its_fast_path() -> None:
    # the Hopper forward's row and column terms are a property the mod declares, not a name
    # the plan looks up: a mod of any name that declares it gets it, one that does not, not
    from flashlite.masking import gallery
    from flashlite.masking.mods import score_mod
    from flashlite.ops.attention.backends.tables.args import head_linear_bias

    slopes = gallery.alibi_slopes(4)
    assert head_linear_bias(gallery.alibi(slopes).op_args())
    mine = score_mod(
        gallery._alibi,
        slopes,
        grad=gallery._alibi_grad,
        torch_fn=gallery._alibi_t,
        name="tests.my_alibi",
        fast_path="head_linear_bias",
    )
    plain = score_mod(
        gallery._alibi,
        slopes,
        grad=gallery._alibi_grad,
        torch_fn=gallery._alibi_t,
        name="tests.plain_alibi",
    )
    assert head_linear_bias(mine.op_args()) and not head_linear_bias(plain.op_args())
    assert masking.split_spec(mine.op_args()[0]) == ("tests.my_alibi", "t")
    with pytest.raises(ValueError, match="fast_path"):
        score_mod(gallery._alibi, slopes, fast_path="alibi")
    # (the Triton kernels call the function either way: the same result on CPU)
    q, k, v = (torch.randn(1, 4, 20, 16) for _ in range(3))
    outs = [flashlite.flex_attention(q, k, v, score_mod=m) for m in (mine, plain)]
    torch.testing.assert_close(outs[0], outs[1])
