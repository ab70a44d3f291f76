"""B requests decoding over one shared prompt with ``flashlite.attention_shared_prefix``.

A system prompt (or a few-shot preamble, or the document several questions ask about) is the
same for every request of a batch. Its keys and values are stored once, ``(Np, Hkv, D)``, and
each request keeps only its own tokens in its cache. Every decode step is two attentions and one
merge: all requests' query rows against the prefix at once (each prefix tile read once per
step, not once per request), each request against its own cache (the new token appended there),
and the exact merge of the two partial results.

This example decodes a few steps with random projections standing in for a model, checks each
step against ``attention_kvcache`` over per-request caches that hold a copy of the prompt, and
prints the time per step and the memory and bytes per step of both layouts.

    python examples/shared_prefix.py                                # tiny, on the CPU
    python examples/shared_prefix.py --device cuda --requests 64 --prefix 32768 --suffix 1024 \\
        --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

import flashlite


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prefix", type=int, default=40, help="shared prompt tokens")
    p.add_argument("--suffix", type=int, default=8, help="tokens of its own per request")
    p.add_argument("--steps", type=int, default=3, help="decode steps")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    b, hq, hkv, d = args.requests, args.heads, args.kv_heads, args.head_dim
    cap = args.suffix + args.steps  # each request's own cache: its tokens and the new ones

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    prefix_k, prefix_v = rand(args.prefix, hkv, d), rand(args.prefix, hkv, d)  # stored once
    k_cache, v_cache = rand(b, cap, hkv, d), rand(b, cap, hkv, d)
    # the baseline: every request's cache holds its own copy of the prompt
    k_copies = torch.cat([prefix_k.expand(b, -1, -1, -1), k_cache], 1)
    v_copies = torch.cat([prefix_v.expand(b, -1, -1, -1), v_cache], 1)
    lengths = torch.full((b,), args.suffix, dtype=torch.int32, device=dev)
    elapsed, worst = 0.0, 0.0
    for _ in range(args.steps):
        q, k_new, v_new = rand(b, 1, hq, d), rand(b, 1, hkv, d), rand(b, 1, hkv, d)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = flashlite.attention_shared_prefix(q, prefix_k, prefix_v, k_cache, v_cache,
                                                cache_seqlens=lengths, k_new=k_new,
                                                v_new=v_new)  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
        want = flashlite.attention_kvcache(q, k_copies, v_copies,
                                           cache_seqlens=lengths + args.prefix, k_new=k_new,
                                           v_new=v_new)  # fmt: skip
        worst = max(worst, (out.float() - want.float()).abs().max().item())
        lengths += 1  # (the new token is now part of each request's own cache)
    assert torch.equal(k_cache, k_copies[:, args.prefix :]), "the appends differ"

    kv_token = 2 * hkv * d * prefix_k.element_size()  # one token's K and V, bytes
    once = (args.prefix + b * cap) * kv_token
    copies = b * (args.prefix + cap) * kv_token
    last = args.suffix + args.steps  # keys of its own each request had at the last step
    step_once = (args.prefix + b * last) * kv_token
    step_copies = b * (args.prefix + last) * kv_token
    print(f"{b} requests, prompt {args.prefix} tokens, {args.suffix}+{args.steps} of their own, "
          f"Hq={hq} Hkv={hkv} D={d} {args.dtype} on {dev}")  # fmt: skip
    print(f"  time per step: {elapsed / args.steps * 1e3:.2f} ms (first step included)")
    print(f"  max difference from attention_kvcache over copies: {worst:.2e}")
    print(f"  KV memory: {once / 2**20:.3f} MiB with the prompt once, {copies / 2**20:.3f} MiB "
          f"with {b} copies ({copies / once:.1f}x)")  # fmt: skip
    print(f"  K/V bytes read at the last step: {step_once / 2**20:.3f} MiB against "
          f"{step_copies / 2**20:.3f} MiB ({step_copies / step_once:.1f}x)")  # fmt: skip
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
