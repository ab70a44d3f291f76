"""Build a Hugging Face model from a config (random weights, nothing downloaded), switch it to
flashlite's attention, and generate greedily next to the same model under SDPA.

    pip install "flashlite-attn[hf]"
    python examples/hf_generate.py                 # tiny Llama on CPU (the interpreter)
    python examples/hf_generate.py --family qwen2 --width 1024 --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

FAMILIES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    p.add_argument("--width", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import transformers

    from flashlite.integrations.transformers import register

    name = register()  # "flite": the attn_implementation to ask for
    models = {}
    for impl in (name, "sdpa"):
        cfg = getattr(transformers, FAMILIES[args.family])(
            vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)  # the same random weights for both
        models[impl] = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=impl
        ).to(args.device)
    prompt = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    out = {}
    with torch.no_grad():
        for impl, model in models.items():
            out[impl] = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                       pad_token_id=0)[0, prompt.shape[1]:].tolist()  # fmt: skip
    for impl, tokens in out.items():
        print(f"{impl:>5}: {tokens}")
    print("identical" if out[name] == out["sdpa"] else "DIFFERENT")
    return 0 if out[name] == out["sdpa"] else 1


if __name__ == "__main__":
    sys.exit(main())
