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
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
    "Setup",
    "bench",
    "device_name",
    "device_slug",
    "flex_attention",
    "fwd_bwd",
    "metadata",
    "rows_reference",
    "timed",
    "timed_kinds",
    "useful_pairs",
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


def timed(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Interleaved rounds of :func:`bench` medians; the median per name."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: statistics.median(t) for name, t in times.items()}


# =============================================================================== masked attention
@dataclass(frozen=True)
class Setup:
    """The attention shape of bench_mods and its siblings' points (and where they run): the
    defaults are the GPU's; a dry run on the CPU passes tiny ones."""

    heads: int = 16
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"

    def inputs(self, n: int, seed: int, packed: bool = False) -> list[torch.Tensor]:
        """q, k, v and an output gradient: ``(1, H, N, D)``, or ``(N, H, D)`` when ``packed``."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        shape = (n, self.heads, self.head_dim) if packed else (1, self.heads, n, self.head_dim)
        return [
            torch.randn(shape, device=self.device, dtype=self.dtype, generator=gen)
            for _ in range(4)
        ]


def useful_pairs(bm: flashlite.BlockMask, device: str = "cuda") -> int:
    """Visible (query, key) pairs of a mask, from its twin over bands of rows."""
    mod, (nq, nk) = bm.mask_mod, bm.seq_lengths
    total, band = 0, 2048
    for r0 in range(0, nq, band):
        b, h, q_idx, kv = _indices()(1, 1, min(band, nq - r0), nk, device)
        total += int(mod(b, h, q_idx + r0, kv).sum())
    return total


def rows_reference(q, k, v, mm, sm, rows: int = 128):  # noqa: ANN001, ANN201
    """fp64 attention of the last ``rows`` queries of ``(B, H, N, D)`` inputs under the mask
    function ``mm`` and score function ``sm`` (either None; twins, dense over their keys)."""
    q0 = q.shape[2] - rows
    s = q[:, :, q0:].double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    b, h, q_idx, kv = _indices()(1, q.shape[1], rows, k.shape[2], q.device)
    q_idx = q_idx + q0
    if sm is not None:
        s = sm(s, b, h, q_idx, kv)
    if mm is not None:
        s = torch.where(mm(b, h, q_idx, kv), s, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.double()


def fwd_bwd(call, leaves, do, into_grad: bool = False):  # noqa: ANN001, ANN201
    """One forward + backward: ``torch.autograd.grad`` of the three inputs (what the attention
    computes), or (``into_grad``) ``.backward()``, which also adds the gradients into the
    leaves' ``.grad``, three elementwise additions of Q's size each, the same for every
    engine."""

    def run() -> None:
        if into_grad:
            call(*leaves).backward(do)
        else:
            torch.autograd.grad(call(*leaves), leaves, do)

    return run


def timed_kinds(
    calls: dict[str, Callable[..., torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    leaves: list[torch.Tensor],
    do: torch.Tensor,
    rounds: int,
    kinds: tuple[str, ...] = ("fwd", "fwd+bwd"),
) -> Iterator[tuple[str, dict]]:
    """``(kind, median ms per call name)`` for each of ``kinds``: the forward, forward +
    backward, and forward + backward into ``.grad`` (:func:`fwd_bwd`)."""
    for kind in kinds:
        if kind == "fwd":
            fns = {name: (lambda c=c: c(q, k, v)) for name, c in calls.items()}
        else:
            into = kind == "fwd+bwd into .grad"
            fns = {name: fwd_bwd(c, leaves, do, into) for name, c in calls.items()}
        yield kind, timed(fns, rounds)


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


def _indices() -> Any:
    """flashlite's index tensors of a mask function (imported on use: bench_ab runs scripts of
    this folder on older trees, which lack ``flashlite.masking``)."""
    from flashlite.masking import torch_indices

    return torch_indices
