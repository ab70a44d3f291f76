"""What every benchmark script shares: device slug, metadata, timing, peers, the results writer.

The scripts run as ``python benchmarks/bench_x.py`` (Python puts this folder on ``sys.path``) and
import from here with ``from _common import ...``. Result files are named
``benchmarks/results/<bench>-<device slug>.{json,png,log}``; the JSON is always
``{"meta": metadata(...), "rows": [...]}``.

The SDPA runner lives in :func:`flashlite.reference.sdpa` (the traffic tool uses it too); optional
peers that need another package or a torch feature (FlexAttention) live here and raise
:class:`PeerUnavailableError` when they cannot run, so a script reports and skips them.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import flashlite
from flashlite import plotting

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent

__all__ = [
    "RESULTS",
    "PeerUnavailableError",
    "bench",
    "device_name",
    "device_slug",
    "flex_attention",
    "metadata",
    "write_results",
]


# =============================================================================== device
def device_name(device: torch.device | str | None = None) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device (default: the current one when CUDA is
    available), ``"cpu"`` otherwise."""
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    if device is None or device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device)


def device_slug(device: torch.device | str | None = None) -> str:
    """The file-name form of :func:`device_name`: ``"NVIDIA H200"`` → ``"nvidia-h200"``;
    ``"cpu"`` without CUDA (or for a CPU ``device``)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "unknown"


# =============================================================================== metadata
def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001  (not installed or broken: the field is null)
        return None


def _command() -> str:
    """``python <script> <arguments>`` as this process was started, the script relative to the
    repository where it lies inside it."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is None:
        return "python"
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def metadata(device: torch.device | str | None = None, **extra: Any) -> dict[str, Any]:
    """One dict describing the run: device, library versions, date (UTC) and the command that
    ran (from ``sys.argv`` unless ``extra`` names it); ``extra`` keys (a script's own settings)
    are appended."""
    dev = torch.device(device) if device is not None else None
    cuda = dev is None or dev.type == "cuda"
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda if cuda and torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "flashlite": flashlite.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
        **extra,
    }


# =============================================================================== timing
def bench(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds per call of ``fn`` from ``triton.testing.do_bench`` (CUDA events,
    L2 flushed between calls; ``warmup``/``rep`` are milliseconds of calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


# =============================================================================== peers
class PeerUnavailableError(RuntimeError):
    """An optional peer cannot run here (package missing, torch too old, no GPU)."""


def flex_attention(causal: bool, nq: int, nk: int) -> Callable[..., torch.Tensor]:
    """Compiled FlexAttention ``f(q, k, v)`` for ``(B, H, N, D)`` CUDA tensors; with ``causal``,
    a bottom-right aligned block mask for ``nq`` queries and ``nk`` keys (compiled per shape).

    Raises:
        PeerUnavailableError: this torch has no FlexAttention.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        from torch.nn.attention.flex_attention import flex_attention as flex
    except ImportError as exc:
        raise PeerUnavailableError(f"FlexAttention not importable ({exc})") from exc
    compiled = torch.compile(flex)
    if not causal:
        return lambda q, k, v: compiled(q, k, v)
    diag = nk - nq
    mask = create_block_mask(
        lambda b, h, qi, ki: ki <= qi + diag, None, None, nq, nk, device="cuda"
    )
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


# =============================================================================== writing
def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b| / max(max |b|, 1)`` in fp64: a checked variant's error against its
    reference (``b``)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1)).item()


def replot(path: str | Path, figure: Callable[[list[dict[str, Any]], str], Any]) -> Path:
    """Redraw the PNG beside a results JSON (``figure(rows, device)``), running nothing: what a
    bench's ``--replot`` does."""
    path = Path(path)
    data = json.loads(path.read_text())
    return plotting.save(figure(data["rows"], data["meta"]["device"]), path.with_suffix(".png"))


def start(
    argv: list[str] | None, doc: str | None, figure: Callable[..., Any], name: str
) -> int | None:
    """The usual start of a bench's ``main``: ``--replot JSON`` redraws that file's PNG and
    gives 0; without a CUDA GPU it says so and gives 2; otherwise None (run the bench)."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or name).splitlines()[0])
    parser.add_argument("--replot", metavar="JSON", help="redraw the PNG of a results JSON")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot, figure)
        return 0
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU")
        return 2
    return None


def write_results(
    stem: str,
    rows: Sequence[dict[str, Any]],
    meta: dict[str, Any],
    *,
    out_dir: Path = RESULTS,
    figure: plotting.Figure | None = None,
    log: str | None = None,
) -> dict[str, Path]:
    """Write ``<out_dir>/<stem>.json`` (``{"meta": meta, "rows": rows}``), and ``.png`` from
    ``figure`` through :mod:`flashlite.plotting` and ``.log`` from ``log`` when given.

    ``stem`` is the file name without suffix, e.g. ``f"softmax-{device_slug()}"``. A missing
    matplotlib skips the PNG with a note. Returns the written paths by suffix (``"json"``, ...).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1) + "\n")
    if figure is not None:
        try:
            paths["png"] = plotting.save(figure, out_dir / f"{stem}.png")
        except ImportError:
            print("matplotlib not installed: no plot")
    if log is not None:
        paths["log"] = out_dir / f"{stem}.log"
        paths["log"].write_text(log if log.endswith("\n") else log + "\n")
    return paths
