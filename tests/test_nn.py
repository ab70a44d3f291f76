"""flashlite.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

import pytest
import torch

from flashlite.nn import MultiheadAttention


def _pair(e: int = 32, h: int = 4, bias: bool = True) -> tuple:
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(e, h, bias=bias, batch_first=True)
    ours = MultiheadAttention(e, h, bias=bias)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


@pytest.mark.parametrize("case", ["self", "cross", "causal", "padding", "no-bias"])
def test_matches_torch(case: str) -> None:
    ours, ref = _pair(bias=case != "no-bias")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, generator=gen)
    kv = torch.randn(2, 13, 32, generator=gen) if case == "cross" else x
    kw_ours: dict = {}
    kw_ref: dict = {"need_weights": False}
    if case == "causal":
        kw_ours["is_causal"] = True
        kw_ref.update(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(9),
                      is_causal=True)  # fmt: skip
    if case == "padding":
        mask = torch.zeros(2, 9, dtype=torch.bool)
        mask[1, 6:] = True  # three padded keys at the end of row 1
        kw_ours["key_padding_mask"] = kw_ref["key_padding_mask"] = mask
    xs = [x.clone().requires_grad_() for _ in range(2)]
    kvs = [kv.clone().requires_grad_() for _ in range(2)] if case == "cross" else xs
    got, _ = ours(xs[0], kvs[0], kvs[0], **kw_ours)
    want, _ = ref(xs[1], kvs[1], kvs[1], **kw_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(got.shape, generator=gen)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-5, rtol=1e-4)


def test_unsupported_options_raise() -> None:
    ours, _ = _pair()
    x = torch.randn(1, 4, 32)
    with pytest.raises(NotImplementedError, match="need_weights"):
        ours(x, x, x, need_weights=True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(4, 4))
    holes = torch.tensor([[False, True, False, False]])
    with pytest.raises(NotImplementedError, match="not at the end"):
        ours(x, x, x, key_padding_mask=holes)
    with pytest.raises(TypeError, match="bool"):
        ours(x, x, x, key_padding_mask=torch.zeros(1, 4))
    with pytest.raises(NotImplementedError, match="dropout"):
        MultiheadAttention(32, 4, dropout=0.1)
    with pytest.raises(ValueError, match="batch_first"):
        MultiheadAttention(32, 4, batch_first=False)
