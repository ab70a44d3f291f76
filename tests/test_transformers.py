"""flashlite.integrations.transformers (issue 15): real model classes from small configs (random
weights, nothing downloaded) on flashlite's kernels against the same model under ``"sdpa"``
(``"eager"`` for Gemma 2 and gpt-oss, which have no SDPA path): logits, loss, every gradient, a
padded batch and greedy generation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashlite.integrations.transformers import register  # noqa: E402

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 256, "pad_token_id": 0}  # fmt: skip


def _config(family: str) -> object:
    """A fresh config per model: from_config records the implementation on the config it gets."""
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=4, **SMALL)
    if family == "mistral":  # sliding window shorter than the sequences
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=7, **SMALL)
    if family == "qwen2":  # GQA
        return transformers.Qwen2Config(num_key_value_heads=1, **SMALL)
    if family == "gpt_oss":  # attention sinks, alternating sliding-window and full layers, GQA
        small = {**SMALL, "num_hidden_layers": 4}
        return transformers.GptOssConfig(
            num_key_value_heads=2, head_dim=16, sliding_window=7, num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2, **small,
        )  # fmt: skip
    if family == "deepseek_v3":  # multi-head latent attention: q, k 24 wide (16 + 8 rotary), v 16
        return transformers.DeepseekV3Config(
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, n_group=1, topk_group=1,
            first_k_dense_replace=1, initializer_range=0.2, **SMALL,
        )  # fmt: skip
    return transformers.Gemma2Config(  # softcap, window, alternating layers
        num_key_value_heads=2, head_dim=16, sliding_window=7, attn_logit_softcapping=20.0,
        query_pre_attn_scalar=16, **SMALL,
    )  # fmt: skip


FAMILIES = ["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "deepseek_v3"]
#: families with no SDPA path: compared with "eager"
EAGER = ("gemma2", "gpt_oss")


def _pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    name = register()
    peer = "eager" if family in EAGER else "sdpa"
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation=name)
    theirs = transformers.AutoModelForCausalLM.from_config(_config(family),
                                                           attn_implementation=peer)  # fmt: skip
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == name
    assert theirs.config._attn_implementation == peer
    return ours, theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_backward_and_padding_match(family: str) -> None:
    ours, theirs = _pair(family)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (2, 20), generator=gen)
    outs = [m(ids, labels=ids) for m in (ours, theirs)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0].loss, outs[1].loss, atol=1e-5, rtol=1e-5)
    for out in outs:
        out.loss.backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3, msg=name)
    # a padded batch (left padding in row 0, right padding in row 1): the real tokens' logits
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[1, 15:] = 0
    padded = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        got, want = (m(padded, attention_mask=mask).logits for m in (ours, theirs))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


# three families (plain, soft caps + windows, sinks): each generation takes ~10 s of CI
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_greedy_generation_matches(family: str) -> None:
    """10 new tokens, greedy, from a left-padded batch: the KV cache grows each step past the
    windows (7 keys) and the decode path attends to it; the token ids equal the peer's."""
    ours, theirs = _pair(family)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (2, 6), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        got, want = (m.generate(ids, **kw) for m in (ours, theirs))
    assert got.shape == (2, 16) and torch.equal(got, want)


def test_unsupported_features_raise() -> None:
    from flashlite.integrations.transformers import _attention

    ours, _ = _pair("llama")
    layer = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    layer.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        _attention(layer, q, q, q, None, dropout=0.1)
    layer.eval()
    with pytest.raises(NotImplementedError, match="4-D attention_mask"):
        _attention(layer, q, q, q, torch.zeros(1, 1, 5, 5))
    with pytest.raises(NotImplementedError, match="llama passes 'position_bias'.*ALiBi"):
        _attention(layer, q, q, q, None, position_bias=torch.zeros(1, 4, 5, 5))


def test_register_without_transformers_names_the_extra() -> None:
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from flashlite.integrations.transformers import register\n"
            "try:\n    register()\nexcept ImportError as e:\n"
            "    assert 'flashlite-attn[hf]' in str(e)\n"
            "else:\n    raise SystemExit('no ImportError')")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_flashlite_does_not_import_transformers() -> None:
    code = "import sys, flashlite; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_realistic_width(family: str) -> None:
    """The same checks on a GPU at realistic widths (hidden 2048, head dim 128, fp32 weights:
    flashlite's fp32 path runs tf32x3, so greedy decoding should not flip on rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    wide = {**SMALL, "hidden_size": 2048, "intermediate_size": 4096, "num_attention_heads": 16,
            "vocab_size": 32000}  # fmt: skip
    name = register()
    peer = "eager" if family in EAGER else "sdpa"
    models = []
    for impl in (name, peer):
        torch.manual_seed(0)
        cfg = _config(family)
        for key, value in wide.items():
            setattr(cfg, key, value)
        if family == "gemma2":
            cfg.head_dim, cfg.query_pre_attn_scalar = 128, 128
        if family == "gpt_oss":
            cfg.head_dim = 128
        if family == "deepseek_v3":  # DeepSeek's own: 192/128, latent 512, query rank 1536
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim = 128, 64, 128
            cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_head_dim = 512, 1536, 192
        models.append(transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=impl).cuda())  # fmt: skip
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(1, 32000, (2, 256), device="cuda")
    outs = [m(ids, labels=ids) for m in models]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=2e-3, rtol=2e-3)
    for out in outs:
        out.loss.backward()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-3, rtol=2e-2)
    mask = torch.ones_like(ids)
    mask[0, :40] = 0  # left padding
    mask[1, 200:] = 0  # right padding
    with torch.no_grad():
        got, want = (m(ids.masked_fill(mask == 0, 0), attention_mask=mask).logits for m in models)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=2e-3, rtol=2e-3)
        got, want = (m.generate(ids[:, :16], max_new_tokens=32, do_sample=False, pad_token_id=0)
                     for m in models)  # fmt: skip
    assert torch.equal(got, want)
