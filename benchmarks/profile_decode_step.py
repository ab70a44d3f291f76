"""Where a B = 1 decode step of a 1.1B Llama goes: flashlite against sdpa (GPU).

The model is ``bench_models.py``'s (about 1.1B parameters, random init, bf16, transformers).
For each attention implementation it measures greedy generation of 64 tokens after a
4096-token prompt (``bench_models.generate_tps``), then times ten single decode steps,
``model(next_token, past_key_values=cache)`` against the 4k-token cache after three warm-up
steps, and prints a ``torch.profiler`` table of five more: host time (CPU), kernel time
(CUDA) and the ops that take them.

    python benchmarks/profile_decode_step.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import bench_models as BM  # noqa: E402

from flashlite.integrations.transformers import register  # noqa: E402

PROMPT, NEW = 4096, 64


def _step(model: torch.nn.Module, cache: object, token: torch.Tensor) -> torch.Tensor:
    """One greedy decode step: the next token, kept on the device (no host sync)."""
    return model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


def main() -> None:
    if not torch.cuda.is_available():
        print("profile_decode_step needs a CUDA GPU")
        return
    ours = register()
    res = {}
    for impl in (ours, "sdpa"):
        model = BM._llama(impl, False, PROMPT + 80)
        model.eval()
        r = BM.generate_tps(model, 1, PROMPT, NEW)
        ids = torch.randint(1, 32000, (1, PROMPT), device="cuda")
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)

            for _ in range(3):
                nxt = _step(model, cache, nxt)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                nxt = _step(model, cache, nxt)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            r["step_host_ms"], r["step_wall_ms"] = (t1 - t0) * 100, (t2 - t0) * 100
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    nxt = _step(model, cache, nxt)
                torch.cuda.synchronize()
        ka = p.key_averages()
        r["cuda_ms_per_step"] = sum(e.self_device_time_total for e in ka) / 5 / 1e3
        res[impl] = r
        print(impl, {k: round(v, 4) for k, v in r.items()}, flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=6, max_name_column_width=40))
        del model, cache, out
        torch.cuda.empty_cache()
    print("RESULT", json.dumps(res))
    print("generate B=1 4k: flashlite / sdpa tokens/s",
          res[ours]["tokens_per_s"] / res["sdpa"]["tokens_per_s"])  # fmt: skip


if __name__ == "__main__":
    main()
