"""flex_attention in training on CUDA (its backward exists there, not on CPU): a module calling it
with a score_mod and a block mask, trained for a few steps under ``Monitoring``; each probe's
entropy_norm and max_prob against float64 math on the module's own queries and keys, the loss
that of an unmonitored twin, and nothing left on the model after."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

pytestmark = pytest.mark.gpu

flex = pytest.importorskip("torch.nn.attention.flex_attention")
flex_attention, create_block_mask = flex.flex_attention, flex.create_block_mask

D, H, T, B, WINDOW = 64, 4, 128, 2, 32


def causal_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def soft_cap(score, b, h, q_idx, kv_idx):
    return 8.0 * torch.tanh(score / 8.0)


class FlexBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.num_heads = H

    def qk(self, x):
        b, t, _ = x.shape
        return tuple(p(x).view(b, t, H, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj))

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, H, -1).transpose(1, 2)
        mask = create_block_mask(causal_window, None, None, t, t, device=x.device)
        y = flex_attention(q, k, v, score_mod=soft_cap, block_mask=mask)
        return x + self.o_proj(y.transpose(1, 2).reshape(b, t, D))


def reference(q, k):
    q, k = q.double(), k.double()
    s = soft_cap(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), None, None, None, None)
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None]
    allowed = causal_window(None, None, i, j)
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    n = allowed.sum(-1).double()
    rows = n > 1
    return (entropy[..., rows] / n[rows].log()).mean((0, 2)), p.amax(-1).mean((0, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_trains_on_cuda_measured_as_flex_computes_it(leftovers):
    torch.manual_seed(0)
    model = nn.Sequential(FlexBlock(), FlexBlock()).cuda()
    twin = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    entropy = AttentionEntropy(per_head=True)
    monitoring = Monitoring(
        model, [QKSpectrum(), entropy], writer=MemorySink(), optimizer=optimizer, every_n_steps=1
    )
    seen = {}

    def keep_qk(module, args, output) -> None:
        with torch.no_grad():
            seen[module] = module.qk(args[0])

    handles = [block.register_forward_hook(keep_qk) for block in model]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        for step in range(3):
            x = torch.randn(B, T, D, device="cuda")
            with monitoring.step(step):
                loss = model(x).square().mean()
                loss.backward()
            twin_loss = twin(x).square().mean()
            twin_loss.backward()
            torch.testing.assert_close(loss, twin_loss, rtol=1e-5, atol=0)
            for block_index, block in enumerate(model):
                norm, max_prob = reference(*seen[block])
                torch.testing.assert_close(
                    entropy.latest["entropy_norm"][block_index].double(),
                    norm.cpu(),
                    rtol=0,
                    atol=1e-4,
                )
                torch.testing.assert_close(
                    entropy.latest["max_prob"][block_index].double(),
                    max_prob.cpu(),
                    rtol=0,
                    atol=1e-4,
                )
            for opt in (optimizer, twin_optimizer):
                opt.step()
                opt.zero_grad()
    monitoring.close()
    for handle in handles:
        handle.remove()
    assert leftovers(model) == []
