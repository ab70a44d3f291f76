"""What the front-ends share: where their bodies run, the checks every one of them makes (soft
caps, boolean flags, overlapping memory), and the records through which kernels report bad index
values without a host sync. When a call skips the dispatcher is :mod:`flashlite.ops._dispatch`'s
business."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from flashlite import _backend
from flashlite._caches import Cache
from flashlite.masking import masks

F = TypeVar("F", bound=Callable[..., Any])


def moved(x: Any, device: torch.device) -> Any:
    """``x`` on ``device`` when it is a tensor (``Tensor.to``: differentiable), each element of a
    tuple so, anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):  # (a named tuple, a Mask say, keeps its type)
        items = [moved(v, device) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    return x


def moved_call_device(device: torch.device) -> torch.device | None:
    """Where the kernels for tensors on ``device`` run when that is elsewhere (CPU tensors in a
    process that compiles its kernels: the current GPU); None when they run where the tensors
    are. Raises as :func:`flashlite._backend.compute_device` does when nothing can run them.

    :func:`on_compute_device` moves one body's tensors per call and brings back what it returns,
    not what it wrote into its arguments: a front-end whose kernels write a gradient in place
    (cross-entropy) moves its whole call instead, with differentiable copies."""
    if device.type == "cuda" and _backend.INTERPRETER_PROBLEM is None:
        return None  # (where its kernels run: the common case, no lookup)
    dev = _backend.compute_device(device)
    return None if dev == device else dev


def on_compute_device(fn: F) -> F:
    """Run a front-end body where kernels run (:func:`flashlite._backend.compute_device`): CPU
    tensors in a process that compiles its kernels go to the GPU once per call, every tensor
    argument (keyword arguments and tuples of tensors too), and the tensors it returns come back
    (also inside a returned tuple)."""

    @functools.wraps(fn)  # custom_op reads the schema from fn's annotations
    def run(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            first = next(a for a in args if isinstance(a, torch.Tensor))
        dev = moved_call_device(first.device)
        if dev is None:
            return fn(*args, **kwargs)
        kwargs = {name: moved(a, dev) for name, a in kwargs.items()}  # (varlen's offsets: a tuple)
        return moved(fn(*(moved(a, dev) for a in args), **kwargs), first.device)

    return run  # type: ignore[return-value]


def check_softcap(softcap: object) -> float:
    """A soft cap as cross-entropy's kernels take it: 0.0 for None, else the finite positive
    float :func:`flashlite.masks.check_softcap` checked."""
    return masks.check_softcap(softcap) or 0.0


def check_flags(**flags: object) -> None:
    """Boolean options (``causal=causal, return_lse=return_lse, ...``) checked as SDPA checks
    ``is_causal``: each a ``bool``, else ``TypeError`` naming it (``bool("no")`` is True, so a
    string must not pass)."""
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def overlapping(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory, decided from sizes and strides alone (no
    data read): False when, with the dimensions of size > 1 ordered by stride, each stride is at
    least the span of the smaller ones, ``Σ (size − 1)·stride + 1`` (then every element has an
    address of its own). That catches expanded (stride-0) dimensions and ``as_strided`` rows that
    share elements; a few layouts whose dimensions interleave without sharing an element fail it
    too and count as overlapping (a kernel that would write ``t`` in place refuses them)."""
    if t.is_contiguous() or t.numel() <= 1:  # the usual case, in one test
        return False
    dims = [(st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1]
    # the dimensions "inside" dimension i: smaller strides, ties broken by position (a stable
    # sort's order, written as comparisons: Dynamo traces those, not sorted() on symbolic strides)
    for i, (stride, _) in enumerate(dims):
        span = 1
        for j, (other, size) in enumerate(dims):
            if other < stride or (other == stride and j < i):
                span += (size - 1) * other
        if stride < span:
            return True
    return False


#: Per check (``"cross_entropy"``, ``"kvcache"``, ``"offsets"``) and compute device, where a
#: kernel records a bad index value: int64 words ``(flag, ...)`` in the device's memory, kept
#: until reported, and a host flag the recording kernel also sets (pinned host memory on a GPU,
#: which a kernel writes directly and the host reads without waiting; the record itself on the
#: CPU).
_records = Cache("ops.value_records", 64)


def value_record(
    what: str, device: torch.device, words: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(record, host flag, the host flag as a numpy array)`` of check ``what`` on ``device``
    (numpy: reading the flag costs no torch op), made on first use."""
    found = _records.get((what, device))
    if found is None:
        record = torch.zeros(words, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        host = torch.zeros(1, dtype=torch.int64, pin_memory=True) if cuda else record
        found = _records.put((what, device), (record, host, host.numpy()))
    return found


def host_flag(what: str, record: torch.Tensor) -> torch.Tensor:
    """What a kernel that records into ``record`` sets to 1 as well: the host flag when it is
    check ``what``'s record on its device, else ``record`` itself (its own flag)."""
    found = _records.get((what, record.device))
    return found[1] if found is not None and found[0] is record else record


def take_record(what: str, device: torch.device, wait: bool) -> list[int] | None:
    """The words of check ``what``'s record on ``device`` if it holds a problem (then cleared):
    with ``wait`` once the device has finished, else only when the host flag already shows one
    (no sync unless there is something)."""
    found = _records.get((what, device))
    if found is None:
        return None
    record, host, host_view = found
    if not wait and not host_view[0]:
        return None
    words = record.tolist()  # the whole record, once the device is done (a sync on a GPU)
    if not words[0]:
        return None
    record.zero_()
    host.zero_()
    return words
