"""Draw each gallery mask and the tiles each query block visits, on the CPU (attention-gym's
pictures, for flashlite's mask functions).

For every mask of :mod:`flashlite.masking.gallery` it builds the block tables with
:func:`flashlite.create_block_mask` and prints, one line per query row, ``#`` a seen pair in a
**full** tile (run without evaluating the mask), ``+`` a seen pair in a **partial** tile (the
mask is evaluated), ``.`` an unseen pair in a partial tile, and a blank for **empty** tiles
(never visited: their keys are not read). Then it runs :func:`flashlite.flex_attention` with the
mask (and ALiBi as a score function) and checks it against the fp64 reference.

    python examples/flex_masks.py                      # the gallery at N = 24, 8×8 tiles
    python examples/flex_masks.py --n 48 --block 16 --out gallery.png   # and a picture
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import flashlite
from flashlite.masking import EMPTY, FULL, MaskMod, gallery, torch_classify, torch_mask


def masks_for(n: int) -> dict[str, MaskMod]:
    """The gallery's masks for sequences of ``n`` (three documents, window n/4, prefix n/3)."""
    ids = gallery.random_documents(1, n, 3, seed=1)
    return {
        "causal": gallery.causal(),
        f"sliding_window({n // 4})": gallery.sliding_window(n // 4),
        f"prefix_lm({n // 3})": gallery.prefix_lm(n // 3),
        "document": gallery.document(ids),
        "document_causal": gallery.document_causal(ids),
    }


def draw(mod: MaskMod, n: int, block: int) -> str:
    """One mask's picture (see the module docstring)."""
    seen = torch_mask(mod, 1, 1, n, n)[0, 0]
    # (the CPU classifier; the kernels' tiles are at least 16 wide, the picture's any size)
    classes = torch_classify(mod, 1, 1, n, n, (block, block))[0, 0]
    lines = []
    for i in range(n):
        row = []
        for j in range(n):
            cls = int(classes[i // block, j // block])
            if cls == EMPTY:
                row.append(" ")
            elif cls == FULL:
                row.append("#")
            else:
                row.append("+" if seen[i, j] else ".")
        lines.append("".join(row).rstrip() or "")
        if (i + 1) % block == 0 and i + 1 < n:
            lines.append("")
    return "\n".join(lines)


def picture(mods: dict[str, MaskMod], n: int, block: int, out: Path) -> None:
    """A PNG: each mask's pairs, full tiles dark, partial tiles light, empty tiles white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(mods), figsize=(3.2 * len(mods), 3.4))
    for ax, (name, mod) in zip(axes, mods.items(), strict=True):
        seen = torch_mask(mod, 1, 1, n, n)[0, 0].float()
        classes = torch_classify(mod, 1, 1, n, n, (block, block))[0, 0]
        tiles = classes.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :n].float()
        ax.imshow(0.25 * tiles + 0.5 * seen, cmap="Blues", vmin=0, vmax=1.0)
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"mask (dark: seen) and tiles ({block}x{block}: full, partial, empty)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=24, help="sequence length (default 24)")
    parser.add_argument("--block", type=int, default=8, help="tile size drawn (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="also write a PNG here")
    args = parser.parse_args(argv)
    mods = masks_for(args.n)
    for name, mod in mods.items():
        bm = torch_classify(mod, 1, 1, args.n, args.n, (args.block, args.block))
        empty = float((bm == EMPTY).float().mean())
        print(f"{name}: {empty:.0%} of the tiles empty\n{draw(mod, args.n, args.block)}\n")

    # the kernels with one of them, and ALiBi as a score function, against fp64
    n = max(args.n, 40)
    mod = gallery.document_causal(gallery.random_documents(1, n, 3, seed=1))
    bm = flashlite.create_block_mask(mod, None, None, n, n, device="cpu", BLOCK_SIZE=16)
    alibi = gallery.alibi(gallery.alibi_slopes(2))
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    out = flashlite.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    ref = flashlite.reference.attention(q.double(), k.double(), v.double(), mask_mod=mod,
                                        score_mod=alibi)  # fmt: skip
    err = (out.double() - ref).abs().max().item()
    print(f"flex_attention(document_causal, alibi) at N={n}: max error against fp64 {err:.1e}")
    if args.out is not None:
        picture(mods, args.n, args.block, args.out)
        print(f"wrote {args.out}")
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
