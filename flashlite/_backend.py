"""Where kernels run, and the facts about this process's Triton that the kernels depend on.

This is the only module that knows about ``TRITON_INTERPRET`` and the interpreter's quirks; how a
kernel is launched is :mod:`flashlite._launch`'s job, and the traffic counter's interpreter
hooks live beside it (:mod:`flashlite.traffic.hooks`).

* **CUDA tensors** run compiled kernels.
* **A process without CUDA** interprets: before ``triton`` is first imported we set
  ``TRITON_INTERPRET=1``, so every ``@triton.jit`` function (our kernels, the ``stats``/``masks``
  helpers and Triton's own ``tl.*`` library) is created as an interpreted function. Triton
  decides this once per function, when it is decorated, so after a ``triton`` imported
  *before* flashlite without that variable, flashlite turns the interpreter on itself and makes
  Triton's own jit library again (:func:`flashlite._launch.interpret_from_now_on`, private
  Triton as everything there); only a ``TRITON_INTERPRET=0``
  set by the user is left as it is, and :func:`compute_device` then raises and says how to fix
  it.
* **CPU tensors on a CUDA machine** are moved to the GPU once per op call by the front-end
  (:func:`compute_device` says where to run, the op copies the results back).
* The interpreter computes ``tl.dot`` on bf16 operands wrongly and converts fp32 to bf16 by
  truncation (Triton 3.9): :func:`dot_upcast` asks kernels for fp32 dot operands, and
  :func:`round_bf16` for the round-to-nearest-even cast of ``kernels/common.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from flashlite._caches import memo, register

_HAS_CUDA = torch.cuda.is_available()
_TRITON_FIRST = "triton" in sys.modules
# (a variable set by the user, "0" included, is theirs: left alone)
_LATE_INTERPRETER = not _HAS_CUDA and _TRITON_FIRST and "TRITON_INTERPRET" not in os.environ
if not _HAS_CUDA and not _TRITON_FIRST:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402


def _interpret_from_now_on() -> str | None:
    """Turn Triton's interpreter on, after a late import of Triton: why that failed, or None.
    (Imported here, not above: :mod:`flashlite._launch` imports this module.)"""
    from flashlite._launch import interpret_from_now_on

    return interpret_from_now_on()


#: Why the interpreter could not be turned on after a late import of Triton (None: it was, or
#: nothing needed it).
LATE_INTERPRETER_FAILED = _interpret_from_now_on() if _LATE_INTERPRETER else None

#: The oldest Triton flashlite runs on: host ``TensorDescriptor`` (``triton.tools.
#: tensor_descriptor``) and ``tl.range(warp_specialize=)`` arrived in 3.4. CI tests it.
MIN_TRITON = (3, 4)
TRITON_VERSION: tuple[int, int] = tuple(int(p) for p in triton.__version__.split(".")[:2])  # type: ignore[assignment]
if TRITON_VERSION < MIN_TRITON:
    raise ImportError(
        f"flashlite needs triton >= {'.'.join(map(str, MIN_TRITON))}, found {triton.__version__}"
    )

#: Whether this process's ``@triton.jit`` functions are interpreted (read once: Triton decides
#: when each function is decorated, which for flashlite's kernels is at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run flashlite's kernels here, if it cannot."""
    import numpy

    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    # Before 3.7 the interpreter turns 1-element arrays into loop bounds with int(array), which
    # numpy 2.3 made an error (tl.range over runtime sizes fails in every kernel).
    if TRITON_VERSION < (3, 7) and numpy_version >= (2, 3):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run with numpy "
            f"{numpy.__version__}: install numpy<2.3, or triton>=3.7"
        )
    return None


INTERPRETER_PROBLEM = _interpreter_problem() if INTERPRETED else None

_CUDA0 = torch.device("cuda", torch.cuda.current_device()) if _HAS_CUDA else None


def kernels_interpreted() -> bool:
    """Whether kernels run in Triton's interpreter in this process (machines without CUDA, or
    ``TRITON_INTERPRET=1`` set before triton was imported)."""
    return INTERPRETED


def getenv(name: str) -> str | None:
    """``os.environ.get(name)`` for switches read on every call (a plan's key holds them):
    ``Mapping.get`` raises and catches a ``KeyError`` inside for an unset variable, the usual
    case, which costs more host time than the rest of a small call's key. Reads the encoded
    mapping ``os.environ`` keeps (CPython's), which ``os.environ``'s writes update too."""
    if _RAW_ENV is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)  # type: ignore[attr-defined]
    raw = _RAW_ENV.get(key)
    return None if raw is None else os.environ.decodevalue(raw)  # type: ignore[attr-defined]


_RAW_ENV: dict | None = getattr(os.environ, "_data", None)
if not (isinstance(_RAW_ENV, dict) and hasattr(os.environ, "encodekey")):
    _RAW_ENV = None
_ENV_KEYS: dict[str, object] = register("backend.env_keys", {})


def env_reader(*names: str) -> Callable[[], tuple]:
    """A function giving these variables' raw values (None where unset) as one tuple: a plan
    key's part for switches that choose kernels, cheaper per call than :func:`getenv` of each
    (two dict reads, nothing decoded)."""
    if _RAW_ENV is None:
        return lambda: tuple(os.environ.get(n) for n in names)
    get = _RAW_ENV.get
    keys = tuple(os.environ.encodekey(n) for n in names)  # type: ignore[attr-defined]
    if len(keys) == 2:
        a, b = keys
        return lambda: (get(a), get(b))
    return lambda: tuple(map(get, keys))


def check_device(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for tensors on devices flashlite cannot run on: ``cuda`` (compiled
    Triton) and ``cpu`` (the interpreter, or the GPU when there is one)."""
    if not (t.is_cuda or t.is_cpu):  # (without making a device object: host time)
        raise ValueError(
            f"{name} is on device {t.device}; flashlite runs on 'cuda' (compiled Triton) "
            "and 'cpu' (Triton interpreter, or the GPU when there is one) tensors"
        )


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a.device == b.device`` for the devices flashlite runs on (CUDA, CPU), compared by kind
    and index without making device objects (host time on every call's checks)."""
    return a.is_cuda == b.is_cuda and a.is_cpu == b.is_cpu and a.get_device() == b.get_device()


def compute_device(device: torch.device) -> torch.device:
    """Where kernels for tensors on ``device`` run: the device itself, except CPU tensors in a
    process that compiles its kernels, which run on the current CUDA device (the front-end
    moves them there once per call and the results back)."""
    if INTERPRETER_PROBLEM is not None:
        raise RuntimeError(f"flashlite cannot run kernels in this process: {INTERPRETER_PROBLEM}")
    if device.type == "cuda" or INTERPRETED:
        return device
    if _CUDA0 is not None:
        return _CUDA0
    why = (
        f" (turning the interpreter on afterwards failed: {LATE_INTERPRETER_FAILED})"
        if LATE_INTERPRETER_FAILED
        else ""
    )
    raise RuntimeError(
        "flashlite cannot run kernels in this process: there is no CUDA device, and `triton` "
        "was imported before flashlite with TRITON_INTERPRET unset or 0, so its functions were "
        f"created for compilation, not for the interpreter{why}. Import flashlite before "
        "triton, or set TRITON_INTERPRET=1 in the environment before starting Python."
    )


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 (bf16 in the interpreter is wrong)."""
    return dtype == torch.bfloat16 and INTERPRETED


def round_bf16(dtype: torch.dtype) -> bool:
    """Whether kernels must round fp32 → bf16 themselves (the interpreter truncates)."""
    return dtype == torch.bfloat16 and INTERPRETED


@memo("backend.capability")
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_capability(index)


@memo("backend.num_sms")
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def private_api_error(what: str, err: Exception) -> RuntimeError:
    """The error for a private Triton API that this Triton does not provide as expected."""
    return RuntimeError(
        f"flashlite uses Triton's {what}, which triton {triton.__version__} does not provide "
        f"as expected ({type(err).__name__}: {err}); flashlite is tested with triton "
        f"{'.'.join(map(str, MIN_TRITON))} to 3.9"
    )
