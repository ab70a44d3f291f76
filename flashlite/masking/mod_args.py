"""Mask and score functions as custom ops carry them: a name and the kinds of its buffers as one
string, its tensors and its numbers (:func:`spec_mod`), and back (:func:`unspec_mod`). A
registered name (:func:`flashlite.masking.mods.registered`) is what lets ``torch.compile`` trace a
call with a mod: the op's arguments are a string, a tensor list and a float list."""

from __future__ import annotations

from typing import Any

import torch

from flashlite.masking import mods as M

__all__ = [
    "declared_fast_path",
    "ModArgs",
    "spec_mod",
    "split_spec",
    "spec_entry",
    "unspec_mod",
    "Slots",
    "check_mod",
]

#: A mod as the ops carry it: ``(spec, tensors, numbers)`` (:func:`spec_mod`).
ModArgs = tuple[str, list[torch.Tensor], list[float]]


def spec_mod(mod: M.MaskMod | M.ScoreMod | None) -> tuple[str, list[torch.Tensor], list[float]]:
    """A mod as an op's arguments: ``name:kinds`` (``t`` tensor, ``i`` int, ``f`` float per
    buffer), its tensors and its numbers (``("", [], [])`` for None)."""
    return ("", [], []) if mod is None else mod.op_args()


def split_spec(spec: str) -> tuple[str, str]:
    """A spec's ``(name, kinds)``: the name may hold colons, the kinds never do (a declared
    fast path follows them after ``|``: :func:`declared_fast_path`)."""
    name, _, kinds = spec.rpartition(":")
    return name, kinds.partition("|")[0]


def declared_fast_path(spec: str) -> str | None:
    """The shortcut a spec's score function declares (:data:`flashlite.masking.mods.FAST_PATHS`),
    or None."""
    return spec.rpartition(":")[2].partition("|")[2] or None


def spec_entry(spec: str) -> tuple[Any, ...] | None:
    """The registry entry a spec names (None for an empty spec or an unknown name)."""
    return M.registered_as(split_spec(spec)[0]) if spec else None


def unspec_mod(
    spec: str, tensors: list[torch.Tensor], nums: list[float]
) -> tuple[Any, list[Any], int]:
    """``(registered functions, the kernels' four buffer slots, how many)`` of a spec
    (``None`` functions for an empty spec)."""
    if not spec:
        return None, *M.kernel_buffers(())
    name, kinds = split_spec(spec)
    it_t, it_n = iter(tensors), iter(nums)
    bufs: list[Any] = []
    for kind in kinds:
        if kind == "t":
            bufs.append(next(it_t))
        else:
            x = next(it_n)
            bufs.append(int(x) if kind == "i" else x)
    return M.registered(name), *M.kernel_buffers(bufs)


class Slots:
    """The eight buffer slots of one kind of call (a mask's four, then a score function's, as
    :func:`unspec_mod` lays each): its numbers fixed (the plan's key pins them), and the
    places each call's tensors go, mask's first."""

    def __init__(self, bufs: list[Any]) -> None:
        self.template = [None if isinstance(x, torch.Tensor) else x for x in bufs]
        self.places = [i for i, x in enumerate(bufs) if isinstance(x, torch.Tensor)]

    def __call__(self, tensors: list[torch.Tensor]) -> list[Any]:
        bufs = self.template.copy()
        for i, t in zip(self.places, tensors):  # noqa: B905  (the key pins the count)
            bufs[i] = t
        return bufs


def check_mod(
    mod: M.MaskMod | M.ScoreMod,
    what: str,
    device: torch.device,
    batch: int | None,
    heads: int | None,
    positions: int | None,
) -> None:
    """ValueError unless each tensor buffer of ``mod`` (the argument ``what``) is on ``device``
    and a call of ``batch`` batches, ``heads`` query heads and ``positions`` positions stays
    within what its buffers hold (:func:`flashlite.masking.mods.check_limits`)."""
    for i, t in enumerate(mod.buffers):
        if isinstance(t, torch.Tensor) and not _on(t, device):
            raise ValueError(f"{what}'s buffer {i} is on {t.device}, the call on {device}")
    M.check_limits(mod, what, batch, heads, positions)


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and device.index in (None, t.device.index)
