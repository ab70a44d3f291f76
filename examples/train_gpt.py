"""Train a small GPT on Python's own standard library, with flashlite's attention or SDPA.

The model is a plain torch.nn decoder (pre-norm blocks, causal self-attention, GELU MLP, tied
embeddings) over byte tokens; the data are the ``.py`` files of this interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded. ``--attention both``
trains twice from the same seed and the same initial weights, once per attention, and reports
both loss curves, their final difference and tokens/s. ``--loss flashlite`` takes the loss from
``flashlite.cross_entropy`` (fused, on the logits in the training dtype) instead of torch's
cross-entropy on fp32 logits; ``--loss both`` trains once with each, for each attention.

    python examples/train_gpt.py --attention both --steps 500 --plot gpt.png   # GPU
    python examples/train_gpt.py --attention sdpa --loss both --steps 500      # GPU: the losses
    python examples/train_gpt.py --layers 2 --context 64 --width 64 --heads 2 --steps 5  # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import flashlite


def load_corpus(limit_bytes: int) -> torch.Tensor:
    """The stdlib's ``.py`` files as one byte tensor (sorted paths: the same on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP, each residual."""

    def __init__(self, width: int, heads: int, attention: str) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        hidden = 4 * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(B, N, width)``."""
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        if self.attention == "flashlite":  # reads the packed projection in place
            y = flashlite.attention(q, k, v, causal=True, layout="b n h d")
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            ).transpose(1, 2)
        x = x + self.proj(y.reshape(b, n, w))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level decoder: ``(B, N)`` token ids → ``(B, N, 256)`` logits."""

    def __init__(self, layers: int, width: int, heads: int, context: int, attention: str) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for module in self.modules():  # GPT-2's init: small weights, so the first loss is ~ln 256
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # tied output layer


class HFLlama(nn.Module):
    """``--model llama``: a transformers Llama of the same size, on flashlite's attention
    (``flashlite.integrations.transformers``) or SDPA: ``(B, N)`` ids → ``(B, N, 256)`` logits."""

    def __init__(self, layers: int, width: int, heads: int, context: int, attention: str) -> None:
        super().__init__()
        import transformers

        from flashlite.integrations.transformers import register

        impl = register() if attention == "flashlite" else "sdpa"
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=width, intermediate_size=4 * width,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=context, initializer_range=0.02, tie_word_embeddings=True,
        )  # fmt: skip
        self.model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def train(args: argparse.Namespace, attention: str, corpus: torch.Tensor, loss_fn: str) -> dict:
    """One run; the model's weights come from ``args.seed`` alone, so runs start identically."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    make = HFLlama if args.model == "llama" else GPT
    model = make(args.layers, args.width, args.heads, args.context, attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    batches = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every run
    losses, tokens, elapsed = [], 0, 0.0
    name = _label({"attention": attention, "loss": loss_fn})
    for step in range(args.steps):
        starts = torch.randint(0, corpus.numel() - args.context - 1, (args.batch,),
                               generator=batches)  # fmt: skip
        seq = torch.stack([corpus[s : s + args.context + 1] for s in starts.tolist()]).long()
        seq = seq.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(seq[:, :-1])
            if loss_fn == "flashlite":  # fused, fp32 loss from the logits as they are
                loss = flashlite.cross_entropy(logits.reshape(-1, 256), seq[:, 1:].reshape(-1))
            else:
                loss = F.cross_entropy(logits.float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:  # the first step compiles kernels
            elapsed += time.perf_counter() - t0
            tokens += args.batch * args.context
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{name}: loss is {losses[-1]} at step {step}")
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"{name:>24} step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return {"attention": attention, "loss": loss_fn, "losses": losses,
            "tokens_per_s": tokens / elapsed if elapsed else None}  # fmt: skip


def _label(run: dict) -> str:
    """A run's name: its attention, and its loss when that is not torch's."""
    return run["attention"] + ("" if run["loss"] == "torch" else " + flashlite CE")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", choices=["flashlite", "sdpa", "both"], default="both")
    p.add_argument("--loss", choices=["torch", "flashlite", "both"], default="torch")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                   help="gpt: the plain torch.nn decoder; llama: transformers' Llama (needs "
                   "flashlite-attn[hf]) on flashlite's attention through its "
                   "integration")  # fmt: skip
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--corpus-mib", type=float, default=32.0, help="stdlib bytes to read")
    p.add_argument(
        "--log-every",
        type=int,
        default=None,
        help="print the loss every this many steps (default: ten lines a run)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the loss curves here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the loss curves here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.log_every is None:  # (a CPU run of a few steps still says how it goes)
        args.log_every = max(1, args.steps // 10)
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    corpus = load_corpus(int(args.corpus_mib * 2**20))
    attentions = ["flashlite", "sdpa"] if args.attention == "both" else [args.attention]
    loss_fns = ["torch", "flashlite"] if args.loss == "both" else [args.loss]
    results = [train(args, a, corpus, f) for a in attentions for f in loss_fns]
    summary = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": results}
    if len(results) == 2:
        tail = max(1, min(20, args.steps // 10))  # final loss: mean of the last steps
        finals = [sum(r["losses"][-tail:]) / tail for r in results]
        summary["final_loss_difference"] = abs(finals[0] - finals[1])
    if torch.device(args.device).type == "cpu" and "flashlite" in attentions + loss_fns:
        print("note: on a CPU flashlite's kernels run in Triton's interpreter: its tokens/s "
              "measure the interpreter, not speed, and are not comparable with SDPA's")  # fmt: skip
    for r in results:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        print(f"{_label(r):>19}: first loss {r['losses'][0]:.4f}, last {r['losses'][-1]:.4f},"
              f" tokens/s {tps}")  # fmt: skip
    if "final_loss_difference" in summary:
        print(f"final-loss difference: {summary['final_loss_difference']:.4f} nats")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json.resolve()}")
    if args.plot:
        from flashlite.plotting import Figure, Line, Panel, save

        lines = [Line(range(len(r["losses"])), r["losses"], _label(r)) for r in results]
        title = f"GPT {args.layers}x{args.width}, context {args.context}, {args.dtype}"
        panel = Panel(lines, title=title, xlabel="step", ylabel="training loss (nats)")
        save(Figure([[panel]]), args.plot)
        print(f"wrote {args.plot.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
