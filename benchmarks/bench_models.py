"""Hugging Face Llama on flashlite's attention against SDPA: training step and generation.

* Training step (forward + backward) of a Llama-style model of about 1B parameters (random init,
  bf16, sequence 4096), step time with ``"flite"`` (flashlite), ``"sdpa"`` and
  ``"flash_attention_2"`` where flash-attn is installed.
* Greedy generation throughput (new tokens per second) at batch 1 and 16, prompts of 4k and 32k
  tokens, against ``"sdpa"``.

Every pair of runs uses the same weights; the first step or generation of each is a warm-up.

    python benchmarks/bench_models.py            # a GPU and transformers (flashlite-attn[hf])
    python benchmarks/bench_models.py --smoke    # a tiny model on CPU: the script's logic only

The training batch is the largest from ``--batch`` (halving) whose step fits in memory; each
generation row also gives the prefill time and the decode-only tokens/s.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
from typing import Any

import torch


def _llama(impl: str, smoke: bool, context: int) -> torch.nn.Module:
    import transformers

    if smoke:
        size = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
    else:  # about 1.1B parameters
        size = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 18,
                "num_attention_heads": 16, "num_key_value_heads": 8,
                "vocab_size": 32000}  # fmt: skip
    cfg = transformers.LlamaConfig(max_position_embeddings=context, pad_token_id=0, **size)
    torch.manual_seed(0)  # the same weights for every implementation
    # built on the device in its dtype (a CPU init of 1.1B parameters takes a minute)
    with torch.device("cpu" if smoke else "cuda"):
        return transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=impl, dtype=torch.float32 if smoke else torch.bfloat16
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step_ms(model: torch.nn.Module, batch: int, seq: int, steps: int) -> float:
    """Median milliseconds of forward + backward (loss from the model's own head) over ``steps``
    steps after a warm-up one (NaN for ``steps=0``: the warm-up only)."""
    device = next(model.parameters()).device
    ids = torch.randint(1, model.config.vocab_size, (batch, seq), device=device)
    times = []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        _sync(device)
        if i:  # the first step compiles kernels
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) if times else float("nan")


def generate_tps(model: torch.nn.Module, batch: int, prompt: int, new: int) -> dict[str, float]:
    """Greedy generation of ``new`` tokens after a ``prompt``, all rows, after one warm-up:
    ``tokens_per_s`` end to end (the prefill included), ``prefill_s`` (a one-token generation)
    and ``decode_tokens_per_s`` (the other ``new − 1`` steps alone)."""
    device = next(model.parameters()).device
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    kw = {"do_sample": False, "pad_token_id": 0}

    def seconds(n: int, x: torch.Tensor) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        return time.perf_counter() - t0

    with torch.no_grad():
        seconds(2, ids[:, : min(prompt, 64)])  # warm-up: kernels compile
        prefill = seconds(1, ids)
        total = seconds(new, ids)
    return {"tokens_per_s": batch * new / total, "prefill_s": prefill,
            "decode_tokens_per_s": batch * (new - 1) / max(total - prefill, 1e-9)}  # fmt: skip


def _train_batch(model: torch.nn.Module, seq: int, start: int) -> int:
    """The largest batch from ``start``, halving, whose training step fits in memory."""
    batch = start
    while batch > 1:
        try:
            train_step_ms(model, batch, seq, 0)
            return batch
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch //= 2
    return batch


def _figure(rows: list[dict[str, Any]], ours: str) -> Any:
    """Bars of ours ÷ sdpa per case (end to end, and decode alone for generation)."""
    from flashlite.plotting import Bars, Figure, Panel

    mine = [r for r in rows if r["impl"] == ours and "x_sdpa" in r]

    def label(case: str) -> str:  # "generate B=16 prompt=32768" -> "gen B16\n32k prompt"
        kind, b, n = case.replace("prompt=", "N=").split()
        train = kind == "train"
        what = "seq" if train else "prompt"
        return f"{'train' if train else 'gen'} B{b[2:]}\n{int(n[2:]) // 1024}k {what}"

    labels = [label(r["case"]) for r in mine]
    decode = [r.get("x_sdpa_decode", float("nan")) for r in mine]
    bars = [Bars([r["x_sdpa"] for r in mine], "step time / tokens per s"),
            Bars(decode, "decode steps only")]  # fmt: skip
    panel = Panel(bars=bars, categories=labels, ylabel="flashlite ÷ sdpa (higher is better)",
                  title="training step and greedy generation")  # fmt: skip
    return Figure([[panel]], title="Llama ~1.1B (transformers), bf16")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    p.add_argument("--batch", type=int, default=16, help="largest training batch to try")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_models needs a CUDA GPU (or --smoke)")
        return 2
    from flashlite.integrations.transformers import register

    ours = register()
    impls = [ours, "sdpa"]
    if not args.smoke and importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")
    notes = [] if len(impls) == 3 else ["flash_attention_2: flash-attn not installed, skipped"]
    seq, batch, steps = (32, 2, 2) if args.smoke else (4096, args.batch, 5)
    gen_cases = [(1, 16), (2, 16)] if args.smoke else [(1, 4096), (16, 4096), (1, 32768),
                                                       (16, 32768)]  # fmt: skip
    new = 4 if args.smoke else 128
    rows: list[dict[str, Any]] = []
    for impl in impls:
        model = _llama(impl, args.smoke, max(seq, gen_cases[-1][1] + new))
        model.train()
        if not args.smoke and impl == impls[0]:  # the batch that fills the GPU, for all
            batch = _train_batch(model, seq, batch)
        if not args.smoke:
            torch.cuda.reset_peak_memory_stats()
        row = {"case": f"train B={batch} N={seq}", "impl": impl,
               "ms": train_step_ms(model, batch, seq, steps)}  # fmt: skip
        if not args.smoke:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        print("measured:", row, flush=True)  # as it comes: a later failure keeps it in the log
        model.zero_grad(set_to_none=True)
        model.eval()
        if impl != "flash_attention_2":
            for b, prompt in gen_cases:
                row = {"case": f"generate B={b} prompt={prompt}", "impl": impl}
                try:
                    row.update(generate_tps(model, b, prompt, new))
                except torch.cuda.OutOfMemoryError as err:  # reported, the others still run
                    row["error"] = f"out of memory: {str(err).splitlines()[0]}"
                    torch.cuda.empty_cache()
                rows.append(row)
                print("measured:", row, flush=True)
        del model
        if not args.smoke:
            torch.cuda.empty_cache()
    base = {r["case"]: r for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        ref = base[r["case"]]
        if "error" in r or "error" in ref:
            continue
        if "ms" in r:  # time: sdpa's / ours; throughput: ours / sdpa's (above 1: flashlite ahead)
            r["x_sdpa"] = ref["ms"] / r["ms"]
        else:
            r["x_sdpa"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["x_sdpa_decode"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    for r in rows:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    for note in notes:
        print("note:", note)
    mine = [r for r in rows if r["impl"] == ours]
    train = next(r for r in mine if "ms" in r)
    print(f"must: training step <= 1.0x sdpa's time: {1 / train['x_sdpa']:.3f}x "
          f"({'pass' if train['x_sdpa'] >= 1.0 else 'FAIL'})")  # fmt: skip
    gens = [r for r in mine if "tokens_per_s" in r and "x_sdpa" in r]
    worst = min(r["x_sdpa"] for r in gens)
    missing = [r["case"] for r in mine if r["case"].startswith("generate") and r not in gens]
    verdict = "pass" if worst >= 0.95 and not missing else "FAIL"
    print(f"must: generation >= 0.95x sdpa's tokens/s: worst {worst:.3f}x ({verdict}"
          f"{'; not measured: ' + ', '.join(missing) if missing else ''})")  # fmt: skip
    if not args.smoke:
        from _common import device_slug, metadata, write_results

        figure = _figure(rows, ours)
        version = importlib.import_module("transformers").__version__
        meta = metadata(dtype="bfloat16", notes=notes, transformers=version)
        write_results(f"models-{device_slug()}", rows, meta, figure=figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
