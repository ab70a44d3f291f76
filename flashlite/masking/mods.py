"""Your own masks and score functions: FlexAttention's ``mask_mod`` and ``score_mod``, run inside
flashlite's kernels.

A **mask function** says whether query ``q_idx`` of head ``h`` of batch ``b`` sees key
``kv_idx``; a **score function** rewrites a scaled score ``q·k·scale`` (a bias, a cap)::

    mask_mod(b, h, q_idx, kv_idx, *buffers) -> bool
    score_mod(score, b, h, q_idx, kv_idx, *buffers) -> score

Each is a ``@triton.jit`` function, called by the kernels on whole tiles (``q_idx`` a column of
query positions, ``kv_idx`` a row of key positions, broadcast against each other), and has a
**torch twin** with the same arithmetic on broadcast torch index tensors, which the fp64
reference, the CPU tests and :func:`torch.nn.attention.flex_attention.create_block_mask` call.
A jit function whose body is plain operators (``q_idx >= kv_idx``) is its own twin: the twin
defaults to the undecorated Python function.

Extra inputs (document ids, bias tables, a window size) are ``buffers``: tensors (the jit function
gets a pointer and loads what it needs; the twin gets the tensor and indexes it) or Python
numbers, passed after the four (five) indices in the order given. A score function also brings
its **derivative** with respect to the score, a jit function with the same arguments, for the
backward (``1`` for a bias, ``1 − tanh²`` for a soft cap). Gradients to the buffers are not
computed (a learned bias table gets none). A mod whose buffers hold one entry per batch, head
or position (document ids, per-head slopes) may say how many with ``limits=(B, H, N)``: a call
with more batches, query heads or positions is refused before any kernel reads past them (the
gallery's mods do; a mod without limits is trusted).

:class:`MaskMod` and :class:`ScoreMod` hold the pieces; calling one runs its torch twin, so the
same object can be handed to torch's own ``create_block_mask`` and ``flex_attention``. Ops and
compiled graphs find a mod's functions by its name (:func:`registered`): a mod registers itself
when it is made.

The kernels call a mod through :func:`apply_mask` and :func:`apply_score` (a score function's
derivative too: it takes the same arguments), which pass up to :data:`MAX_BUFFERS` buffers; they
and the twins' callers live in :mod:`flashlite.masking.mod_calls` and are re-exported here.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from flashlite._caches import Versioned, register
from flashlite._launch import is_jit as _is_jit
from flashlite._launch import python_fn as _python_fn
from flashlite.masking.mod_calls import (
    MAX_BUFFERS,
    apply_mask,
    apply_score,
    kernel_buffers,
    torch_indices,
    torch_mask,
    torch_score,
)

__all__ = [
    "FAST_PATHS",
    "MAX_BUFFERS",
    "MaskMod",
    "ScoreMod",
    "mask_mod",
    "score_mod",
    "as_mask_mod",
    "as_score_mod",
    "registered",
    "apply_mask",
    "apply_score",
    "check_limits",
    "kernel_buffers",
    "torch_indices",
    "torch_mask",
    "torch_score",
]

#: Shortcuts a score function may declare (:func:`score_mod`'s ``fast_path``).
FAST_PATHS = ("head_linear_bias",)

Buffer = torch.Tensor | int | float
#: Bytes one call of a mod on a ``(bm, bn)`` tile loads from its buffers (for the traffic model)
TileReads = Callable[[int, int], int]
#: How many batches, heads and positions a mod's buffers hold (None: any): see :func:`mask_mod`
Limits = tuple[int | None, int | None, int | None]


def _arity(fn: Callable[..., Any]) -> int:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return -1
    return len(params)


def _check_buffers(buffers: tuple[Any, ...], what: str) -> tuple[Buffer, ...]:
    if len(buffers) > MAX_BUFFERS:
        raise ValueError(
            f"{what} reads {len(buffers)} buffers; at most {MAX_BUFFERS} are "
            "supported (pack tables into one tensor)"
        )
    for i, x in enumerate(buffers):
        ok = isinstance(x, (torch.Tensor, int, float)) and not isinstance(x, bool)
        if not ok:
            raise TypeError(
                f"{what}'s buffer {i} must be a tensor, int or float, got {type(x).__name__}"
            )
    return tuple(buffers)


def _check_limits_arg(limits: Any, what: str) -> Limits:
    if limits is None:
        return (None, None, None)

    def count(x: Any) -> bool:
        return x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)

    if not (isinstance(limits, tuple) and len(limits) == 3 and all(map(count, limits))):
        raise ValueError(
            f"{what}'s limits must be a tuple (B, H, N) of ints >= 1 or None, got {limits!r}"
        )
    return limits


def check_limits(
    mod: _Mod, what: str, batch: int | None, heads: int | None, positions: int | None
) -> None:
    """ValueError unless a call with ``batch`` batches (sequences), ``heads`` query heads and
    positions ``< positions`` stays within what ``mod``'s buffers hold (its ``limits``; a
    None here is not checked). ``what``: the argument, for the message. (Plain compares: it
    runs on every call's host path.)"""
    lb, lh, ln = mod.limits
    for got, limit, noun in (
        (batch, lb, "batches"),
        (heads, lh, "query heads"),
        (positions, ln, "positions"),
    ):
        if limit is not None and got is not None and got > limit:
            raise ValueError(
                f"{what} {mod.name} has buffer entries for {limit} {noun}, the "
                f"call has {got}: make its buffers for the call's {noun}"
            )


def _check_fn(fn: object, what: str, indices: int, n_buffers: int) -> None:
    """A jit function taking ``indices + n_buffers`` positional arguments."""
    if not _is_jit(fn):
        raise TypeError(
            f"{what} must be a @triton.jit function (it runs inside the kernels), got "
            f"{type(fn).__name__}; flashlite.mods.mask_mod / score_mod pair one with its torch "
            f"twin{_not_jit_hint(fn, indices)}"
        )
    want = indices + n_buffers
    got = _arity(_python_fn(fn))
    if got != want:
        names = "(b, h, q_idx, kv_idx" if indices == 4 else "(score, b, h, q_idx, kv_idx"
        raise TypeError(
            f"{what} {_python_fn(fn).__name__} takes {got} arguments; with {n_buffers} buffers "
            f"it must take {want}: {names}{', *buffers' if n_buffers else ''})"
        )


def _not_jit_hint(fn: object, indices: int) -> str:
    """What a plain function given as a mod was likely meant as: a maker not called (one with
    fewer required arguments than the indices, e.g. ``gallery.causal``), or a mod in Python."""
    if not inspect.isfunction(fn):
        return ""
    params = inspect.signature(fn).parameters.values()
    needed = [p.name for p in params if p.default is p.empty and p.kind <= p.POSITIONAL_OR_KEYWORD]
    if len(needed) >= indices:  # (a mod written in Python: plain operators jit as they are)
        return "; a body of plain operators (q_idx >= kv_idx) works as it is under @triton.jit"
    if not fn.__name__.isidentifier():  # (a lambda: no name to call it by)
        return ""
    owner = "gallery." if fn.__module__ == "flashlite.masking.gallery" else ""
    return f"; did you mean `{owner}{fn.__name__}({', '.join(needed)})`?"


#: name -> (fn, torch_fn) or (fn, torch_fn, grad_fn); a redefined function (a notebook cell
#: run again) replaces the old one under its name. ``_caches.clear()`` empties it: a name is
#: then registered again by the newest live mod made as it (``_made``: weak, it keeps nothing
#: alive), so a compiled graph, which finds its mods by name, runs on while they live.
_REGISTRY: Versioned = register("mods.registry", Versioned())
_made: weakref.WeakValueDictionary[int, _Mod] = weakref.WeakValueDictionary()


def _name_of(fn: Any) -> str:
    py = _python_fn(fn)
    return f"{py.__module__}.{py.__qualname__}"


def registered_as(name: str) -> tuple[Any, ...] | None:
    """:func:`registered`'s entry, or None (what a plan's key holds: a name registered again
    is another entry)."""
    entry = _REGISTRY.get(name)
    return entry if entry is not None else _register_again(name)


def registry_version() -> int:
    """How many times the registry changed: what a memo of its entries checks."""
    return _REGISTRY.version


def _register_again(name: str) -> tuple[Any, ...] | None:
    """The entry of the newest live mod made as ``name``, registered again (after a clear)."""
    mods = [m for m in list(_made.values()) if m.name == name]
    if not mods:
        return None
    m = mods[-1]
    entry = (m.fn, m.torch_fn, m.grad_fn) if isinstance(m, ScoreMod) else (m.fn, m.torch_fn)
    _REGISTRY[name] = entry
    return entry


def registered(name: str) -> tuple[Any, ...]:
    """The functions registered under ``name``: ``(fn, torch_fn)`` for a mask,
    ``(fn, torch_fn, grad_fn)`` for a score function (how a custom op finds a mod again).

    Raises:
        ValueError: nothing is registered under ``name``.
    """
    entry = registered_as(name)
    if entry is None:
        raise ValueError(
            f"no mask or score function is registered as {name!r}; make it with "
            "flashlite.mods.mask_mod / score_mod first"
        )
    return entry


class _Mod:
    """What mask and score functions share: the jit function, its twin, its buffers, the name
    ops find it by, and (for the traffic model) what one tile of it loads."""

    __slots__ = ("fn", "torch_fn", "buffers", "name", "tile_reads", "limits", "_op_args")

    def __init__(
        self,
        fn: Any,
        torch_fn: Callable[..., Any],
        buffers: tuple[Buffer, ...],
        name: str,
        tile_reads: TileReads | None = None,
        limits: Limits = (None, None, None),
    ) -> None:
        self.fn, self.torch_fn, self.buffers, self.name = fn, torch_fn, buffers, name
        self.tile_reads, self.limits = tile_reads, limits
        self._op_args: tuple[str, list[torch.Tensor], list[float]] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensor buffers, in order (a custom op's tensor list)."""
        return [x for x in self.buffers if isinstance(x, torch.Tensor)]

    def op_args(self) -> tuple[str, list[torch.Tensor], list[float]]:
        """The mod as a custom op's arguments: ``name:kinds`` (``t`` tensor, ``i`` int, ``f``
        float per buffer), its tensors and its numbers. Made once: a mod's buffers are fixed
        (callers must not modify the lists)."""
        if self._op_args is not None:
            return self._op_args
        kinds = "".join(
            "t" if isinstance(x, torch.Tensor) else "i" if isinstance(x, int) else "f"
            for x in self.buffers
        )
        nums = [float(x) for x in self.buffers if not isinstance(x, torch.Tensor)]
        fast = getattr(self, "fast_path", None)  # (declared by a score function)
        spec = f"{self.name}:{kinds}" + (f"|{fast}" if fast else "")
        made = (spec, self.tensors(), nums)
        if not torch.compiler.is_compiling():  # (kept by eager calls; a trace stays pure)
            self._op_args = made
        return made

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {len(self.buffers)} buffers)"


class MaskMod(_Mod):
    """A mask function: ``fn`` (``@triton.jit``), its torch twin ``torch_fn`` and its buffers.
    Calling it runs the twin with the buffers appended (what torch's ``create_block_mask``
    calls). Make one with :func:`mask_mod`."""

    __slots__ = ("__weakref__",)  # (registered weakly: see _made)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.torch_fn(b, h, q_idx, kv_idx, *self.buffers)


class ScoreMod(_Mod):
    """A score function: ``fn`` (``@triton.jit``), its derivative with respect to the score
    ``grad_fn`` (``@triton.jit``; None: forward only), its torch twin ``torch_fn`` and its
    buffers. Calling it runs the twin (what torch's ``flex_attention`` calls). Make one with
    :func:`score_mod`."""

    __slots__ = ("grad_fn", "fast_path", "__weakref__")

    def __init__(
        self,
        fn: Any,
        grad_fn: Any,
        torch_fn: Callable[..., Any],
        buffers: tuple[Buffer, ...],
        name: str,
        tile_reads: TileReads | None = None,
        limits: Limits = (None, None, None),
        fast_path: str | None = None,
    ) -> None:
        super().__init__(fn, torch_fn, buffers, name, tile_reads, limits)
        self.grad_fn = grad_fn
        #: a shortcut the kernels may take instead of calling ``fn`` (:data:`FAST_PATHS`)
        self.fast_path = fast_path

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.torch_fn(score, b, h, q_idx, kv_idx, *self.buffers)


def mask_mod(
    fn: Any,
    *buffers: Buffer,
    torch_fn: Callable[..., Any] | None = None,
    name: str | None = None,
    tile_reads: TileReads | None = None,
    limits: Limits | None = None,
) -> MaskMod:
    """A mask function with its twin and buffers.

    Args:
        fn: ``@triton.jit`` ``(b, h, q_idx, kv_idx, *buffers) -> bool``.
        *buffers: tensors or numbers ``fn`` reads, after the indices.
        torch_fn: the twin on torch tensors (default: ``fn``'s own Python body).
        name: the name ops find it by (default: ``module.qualname`` of ``fn``).
        tile_reads: bytes ``fn`` loads from its buffers per ``(bm, bn)`` tile, for
            ``flashlite traffic`` (None: not modelled).
        limits: ``(B, H, N)``: how many batches (sequences), query heads and positions the
            buffers hold entries for (None in a place, or no limits: any); calls with more
            are refused (:func:`check_limits`) instead of reading past them.

    Raises:
        TypeError: ``fn`` is not a jit function or takes the wrong number of arguments; a
            buffer is not a tensor or number; ``fn``'s twin returns something other than a
            bool tensor.
        ValueError: more than :data:`MAX_BUFFERS` buffers; bad ``limits``.
    """
    buffers = _check_buffers(buffers, "mask_mod")
    _check_fn(fn, "mask_mod", 4, len(buffers))
    twin = torch_fn if torch_fn is not None else _python_fn(fn)
    name = name or _name_of(fn)
    mod = MaskMod(fn, twin, buffers, name, tile_reads, _check_limits_arg(limits, "mask_mod"))
    if _REGISTRY.get(name) != (fn, twin):  # (checked once per function and name)
        _check_result(mod, "mask_mod")
    _REGISTRY[name] = (fn, twin)
    _made[id(mod)] = mod
    return mod


def score_mod(
    fn: Any,
    *buffers: Buffer,
    grad: Any = None,
    torch_fn: Callable[..., Any] | None = None,
    name: str | None = None,
    tile_reads: TileReads | None = None,
    limits: Limits | None = None,
    fast_path: str | None = None,
) -> ScoreMod:
    """A score function with its derivative, twin and buffers.

    Args:
        fn: ``@triton.jit`` ``(score, b, h, q_idx, kv_idx, *buffers) -> score`` (fp32 scaled
            scores in, fp32 out).
        *buffers: tensors or numbers ``fn`` reads, after the indices.
        grad: ``@triton.jit`` with ``fn``'s arguments giving ``d fn / d score`` (None: the
            backward refuses).
        torch_fn: the twin on torch tensors (default: ``fn``'s own Python body).
        name: the name ops find it by (default: ``module.qualname`` of ``fn``).
        tile_reads: as :func:`mask_mod`'s (per tile ``fn`` runs on).
        limits: as :func:`mask_mod`'s.
        fast_path: a shortcut ``fn`` declares it equals (:data:`FAST_PATHS`), which a kernel
            may compute instead of calling ``fn``: ``"head_linear_bias"``, ``score +
            buffers[0][h]·(kv_idx − q_idx)`` with an fp32 ``(H,)`` first buffer (ALiBi),
            which the Hopper forward applies as a column term per score and a row term per
            row. The declaration is a promise: the kernels do not check it.

    Raises:
        TypeError, ValueError: as :func:`mask_mod`, for ``fn`` and ``grad`` (the twin must
            return a floating-point score); a ``fast_path`` not in :data:`FAST_PATHS`.
    """
    if fast_path is not None and fast_path not in FAST_PATHS:
        raise ValueError(f"fast_path must be None or one of {FAST_PATHS}, got {fast_path!r}")
    buffers = _check_buffers(buffers, "score_mod")
    _check_fn(fn, "score_mod", 5, len(buffers))
    if grad is not None:
        _check_fn(grad, "score_mod's grad", 5, len(buffers))
    twin = torch_fn if torch_fn is not None else _python_fn(fn)
    name = name or _name_of(fn)
    mod = ScoreMod(
        fn, grad, twin, buffers, name, tile_reads, _check_limits_arg(limits, "score_mod"), fast_path
    )
    if _REGISTRY.get(name) != (fn, twin, grad):
        _check_result(mod, "score_mod")
    _REGISTRY[name] = (fn, twin, grad)
    _made[id(mod)] = mod
    return mod


def _check_result(mod: _Mod, what: str) -> None:
    """TypeError if the twin, called at the first position, returns a tensor of the wrong
    kind: a mask must give bools and a score function a floating-point score (the kernels
    combine a mask with ``&`` and a score in fp32; another kind fails to compile or means
    something else). A twin that cannot run on one position is left to the call; so is
    everything while torch.compile traces."""
    if torch.compiler.is_compiling():
        return
    is_score = isinstance(mod, ScoreMod)
    idx = torch.zeros((), dtype=torch.int64)
    device = next((x.device for x in mod.buffers if isinstance(x, torch.Tensor)), None)
    if device is not None:
        idx = idx.to(device)
    try:
        with torch.no_grad():
            if is_score:
                got = mod(
                    torch.zeros((), dtype=torch.float32, device=idx.device), idx, idx, idx, idx
                )
            else:
                got = mod(idx, idx, idx, idx)
    except Exception:  # noqa: BLE001 - the twin's own errors surface where it is called
        return
    if not isinstance(got, torch.Tensor):
        return  # (a Python number from a twin of constants: broadcast by the callers)
    if not is_score and got.dtype != torch.bool:
        raise TypeError(
            f"{what} {mod.name} must return a bool tensor (which keys each query "
            f"sees), its twin returned {got.dtype}"
        )
    if is_score and not got.is_floating_point():
        raise TypeError(
            f"{what} {mod.name} must return a floating-point score, its twin returned {got.dtype}"
        )


def as_mask_mod(mod: object) -> MaskMod:
    """``mod`` as a :class:`MaskMod`: one already, or a bare jit function (its own twin)."""
    if isinstance(mod, MaskMod):
        return mod
    return mask_mod(mod)


def as_score_mod(mod: object) -> ScoreMod:
    """``mod`` as a :class:`ScoreMod`: one already, or a bare jit function (its own twin, no
    derivative: forward only)."""
    if isinstance(mod, ScoreMod):
        return mod
    return score_mod(mod)
