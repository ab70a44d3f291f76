"""Draw each attention mask and the key tiles a query block visits, on the CPU.

For every option (none, causal, sliding windows) it prints the (Nq, Nk) mask from
``flashlite.masking.masks.torch_visible`` and, for each block of query rows, how
``masks.torch_key_range`` splits the key axis for the ``masks.Mask`` that ``masks.describe``
makes of ``causal`` and ``window``: ``#`` a seen pair in a tile the kernel runs without mask
arithmetic, ``+`` a seen pair in a masked tile, ``.`` an unseen pair in a masked tile, and a
blank for tiles the kernel skips (never loaded).

    python examples/masks.py                          # the default gallery
    python examples/masks.py --nq 12 --nk 20 --window 4 0 --block-m 4 --block-n 4
"""

from __future__ import annotations

import argparse

from flashlite.masking import masks


def draw(
    nq: int,
    nk: int,
    causal: bool,
    window: tuple[int, int] | None,
    block_m: int,
    block_n: int,
) -> str:
    """The picture of one mask: one line per query row (see the module docstring)."""
    seen = masks.torch_visible(nq, nk, causal, window=window)
    mask = masks.describe(causal, window)
    lines = []
    for start in range(0, nq, block_m):
        lo, full_lo, full_hi, hi = masks.torch_key_range(start, block_m, block_n, nq, nk, mask)
        for i in range(start, min(start + block_m, nq)):
            row = []
            for j in range(nk):
                tile = (j // block_n) * block_n
                if tile < lo or tile >= hi:
                    row.append(" ")
                elif full_lo <= tile < full_hi:
                    row.append("#")
                else:
                    row.append("+" if seen[i, j] else ".")
            lines.append(f"{i:3d} |{''.join(row)}|")
        lines.append("    " + "-" * (nk + 2))
    return "\n".join(lines[:-1])


GALLERY: list[tuple[str, bool, tuple[int, int] | None]] = [
    ("no mask", False, None),
    ("causal (bottom-right)", True, None),
    ("window (4, 0): Mistral's sliding window", False, (4, 0)),
    ("window (3, 3): local, both sides", False, (3, 3)),
    ("window (-1, 2): causal plus two keys ahead", False, (-1, 2)),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nq", type=int, default=12)
    p.add_argument("--nk", type=int, default=16)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"))
    p.add_argument("--block-m", type=int, default=4)
    p.add_argument("--block-n", type=int, default=4)
    args = p.parse_args(argv)
    if args.causal or args.window is not None:
        gallery = [(f"causal={args.causal} window={args.window}", args.causal, args.window)]
    else:
        gallery = GALLERY
    for title, causal, window in gallery:
        window = tuple(window) if window is not None else None
        print(f"{title}: Nq={args.nq}, Nk={args.nk}, tiles {args.block_m}x{args.block_n}")
        print(draw(args.nq, args.nk, causal, window, args.block_m, args.block_n))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
