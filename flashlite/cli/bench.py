"""`flashlite bench`: the benchmark scripts of a clone's ``benchmarks/`` and what each measures."""

from __future__ import annotations

import argparse

#: The scripts in ``benchmarks/`` (run from a clone; each needs a GPU) and what each measures:
#: ``flashlite bench`` lists them (a test keeps this list and the folder in agreement).
BENCHMARKS = (
    ("bench_softmax.py", "softmax / log_softmax GB/s against torch and the copy ceiling"),
    ("bench_attention.py", "attention forward TFLOP/s against SDPA's backends and Flex"),
    ("bench_attention_bwd.py", "attention backward against SDPA flash and cuDNN"),
    ("bench_decode.py", "decoding, varlen, window and softcap against SDPA and cuDNN"),
    ("bench_shared_prefix.py", "shared-prefix decoding against kvcache over prefix copies"),
    ("bench_sinks.py", "attention with and without sinks, forward, backward and decode"),
    ("bench_fp8.py", "FP8 attention and FP8-cache decoding against flashlite's bf16"),
    ("bench_mla.py", "192/128 attention against cuDNN; absorbed MLA decoding against the copy"),
    ("bench_mods.py", "mask and score functions against FlexAttention and the built-ins"),
    ("bench_cross_entropy.py", "cross-entropy and linear cross-entropy speed and memory"),
    ("bench_ce_memory.py", "cross-entropy peak memory at flash-attn's test vocabularies"),
    ("bench_overhead.py", "per-call host cost at small shapes (loop, graph, do_bench)"),
    ("bench_ab.py", "two source trees side by side: new/old time of every flashlite point"),
    (
        "bench_ab_probe.py",
        "one tree's quick probe for bench_ab: a few calls' host loop and kernels",
    ),
    ("bench_ab_worker.py", "one tree's side of bench_ab's pairs job (started by bench_ab)"),
    ("bench_models.py", "Hugging Face Llama training step and generation against SDPA"),
    ("bench_traffic.py", "measured DRAM bytes with Nsight Compute against the model"),
    ("bench_ring.py", "ring attention on two GPUs against one"),
    ("profile_decode_step.py", "where one decode step of a 1.1B Llama goes (torch.profiler)"),
    ("sweep_softmax_longrow.py", "long-row softmax kernel configs against the copy ceiling"),
)


def cmd_bench(args: argparse.Namespace) -> int:
    width = max(len(name) for name, _ in BENCHMARKS)
    lines = [f"  python benchmarks/{name:<{width}}  # {what}" for name, what in BENCHMARKS]
    print(
        "Benchmarks are scripts in benchmarks/ of a clone (each needs a GPU):",
        *lines,
        "Each writes JSON + PNG to benchmarks/results/ and prints a table last.",
        sep="\n",
    )
    return 0
