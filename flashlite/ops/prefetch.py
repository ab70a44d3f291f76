"""The host side of the Gluon prefetching team kernels (:mod:`flashlite.kernels.softmax_gluon`,
:mod:`flashlite.kernels.cross_entropy_gluon`), shared by the softmax and cross-entropy front-ends:
whether a row layout can take them, their launch options and programs per row, and the
workspace of int64 words through which a row's programs publish their statistics."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashlite import _backend, _teams
from flashlite.kernels import softmax_gluon as KG

Launch = Callable[..., None]


def prefetch_applies(x2: torch.Tensor, y2: torch.Tensor) -> bool:
    """Whether the Gluon prefetching team kernel can run on the ``(rows, n)`` views: a CUDA
    device of compute capability 8.0+ with Gluon, columns contiguous, rows and pointers
    aligned to 16 bytes (every copy moves 16), and teams that fit."""
    if x2.device.type != "cuda" or not KG.available():
        return False
    if _backend.capability(x2.device.index or 0)[0] < 8:
        return False
    n_rows, n_cols = x2.shape
    vec = 16 // x2.element_size()
    for t in (x2, y2):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (n_rows > 1 and t.stride(0) % vec):
            return False
    cfg = KG.prefetch_config(n_cols, x2.element_size())
    return (
        n_cols % vec == 0
        and cfg["n_chunks"] <= KG.MAX_CHUNKS
        and _teams.teams_fit(cfg["n_chunks"], x2.device)
    )


def prefetch_chunks(n_cols: int, elem_bytes: int) -> int:
    """Programs per row of the prefetching team kernels for rows of ``n_cols`` values of
    ``elem_bytes`` bytes (their default config)."""
    return int(KG.prefetch_config(n_cols, elem_bytes)["n_chunks"])


def prefetch_plan(
    x2: torch.Tensor,
    words_per_chunk: int = 1,
    cfg: KG.PrefetchConfig | None = None,
    control: int = 0,
) -> tuple[dict, int, int]:
    """What every launch of a prefetching team kernel on the ``(rows, n)`` view ``x2`` needs:
    its launch options, the programs per row, and how many int64 words its workspace holds
    (:func:`prefetch_words`): ``words_per_chunk`` per (row, chunk), row-major, then
    ``control`` more."""
    opts = KG.prefetch_config(x2.shape[1], x2.element_size(), cfg)
    n_chunks = opts.pop("n_chunks")
    return opts, n_chunks, x2.shape[0] * n_chunks * words_per_chunk + control


def prefetch_words(size: int, device: torch.device) -> torch.Tensor:
    """A team kernel's workspace of ``size`` int64 words, all −1: nothing published yet."""
    return torch.full((size,), -1, device=device, dtype=torch.int64)


def plan_prefetch(
    x2: torch.Tensor, y2: torch.Tensor, log: bool, cfg: KG.PrefetchConfig | None = None
) -> Launch:
    """``launch(x2, y2)`` of the Gluon team kernel that prefetches each program's next row into
    shared memory (:mod:`flashlite.kernels.softmax_gluon`), planned for these views."""
    n_rows, n_cols = x2.shape
    dev = x2.device
    opts, n_chunks, size = prefetch_plan(x2, 1, cfg)
    vec = opts["VEC"]  # lengths and strides in 16-byte vectors (prefetch_applies checked)
    rest = (n_rows, n_cols // vec, x2.stride(0) // vec, y2.stride(0) // vec, n_chunks)
    bound = _teams.bind_teams(
        KG._softmax_prefetch_team_kernel,
        [x2, y2, prefetch_words(size, dev), *rest],
        {"LOG": log, **opts},
        n_chunks,
        n_rows,
        dev,
    )
    return lambda x, y: bound(x, y, prefetch_words(size, dev), *rest)


def prefetch_fwd(
    x2: torch.Tensor, y2: torch.Tensor, log: bool, cfg: KG.PrefetchConfig | None = None
) -> None:
    """Launch the Gluon prefetching team kernel on the views (:func:`plan_prefetch`)."""
    plan_prefetch(x2, y2, log, cfg)(x2, y2)
