"""The update metrics of models read by interception, whose W_Q/W_K layout is known only once the
first probed forward has checked it: ``q_update_ratio`` and ``k_update_ratio`` are read from the
first update on (step 1; NaN by definition at step 0 alone) and equal the float64 ratio
``‖W_Q^h' − W_Q^h‖_F / ‖W_Q^h‖_F`` of rows the test copies before and after the optimizer step;
a healthy model gives no warning at all. A plain module calling SDPA (with ``enable_gqa=True``
too), and Hugging Face's GPT-Neo (intercepted)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink


class Attention(nn.Module):
    """A user's attention: separate projections, SDPA, grouped keys where ``kv_heads < heads``."""

    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = heads, kv_heads
        width = d // heads * kv_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, width)
        self.v_proj, self.o_proj = nn.Linear(d, width), nn.Linear(d, d)

    def forward(self, x):  # (B, N, d)
        b, n, d = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, -1).transpose(1, 2)  # (B, H, N, D)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, -1).transpose(1, 2)
        gqa = {"enable_gqa": True} if self.num_kv_heads != self.num_heads else {}  # torch >= 2.5
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


class Stack(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Attention(kv_heads=kv_heads) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def gpt_neo() -> tuple[nn.Module, list[nn.Module], int]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=16,
        window_size=4,
    )
    model = transformers.GPTNeoForCausalLM(config)
    return model, [block.attn.attention for block in model.transformer.h], 4


def ratios(before: torch.Tensor, after: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, the float64 ‖after − before‖_F / ‖before‖_F of its rows."""
    b, a = before.double().reshape(heads, -1), after.double().reshape(heads, -1)
    return (a - b).norm(dim=1) / b.norm(dim=1)


def run(model, attentions, heads, kv_heads, batch, loss):
    """Three steps in a plain loop; the test's float64 ratios of the update before step 1's read."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = QKSpectrum(per_head=True)
    truth = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitoring(
            model, [engine], writer=MemorySink(), every_n_steps=1, optimizer=optimizer
        ) as monitoring:
            for step in range(3):
                with monitoring.step(step):
                    loss(model, batch).backward()
                    before = [
                        (a.q_proj.weight.clone(), a.k_proj.weight.clone()) for a in attentions
                    ]
                    optimizer.step()
                    optimizer.zero_grad()
                    after = [(a.q_proj.weight.clone(), a.k_proj.weight.clone()) for a in attentions]
                if step == 0:
                    group = heads // kv_heads
                    truth = {
                        "q_update_ratio": [
                            ratios(q0, q1, heads) for (q0, _), (q1, _) in zip(before, after)
                        ],
                        "k_update_ratio": [
                            ratios(k0, k1, kv_heads).repeat_interleave(group)
                            for (_, k0), (_, k1) in zip(before, after)
                        ],
                    }
                if step == 1:  # the read after step 0's update, logged at step 1
                    assert engine.schedule.latest_step == 1
                    for name, want in truth.items():
                        for got, expected in zip(engine.latest[name], want):
                            assert_close(got.double(), expected, rtol=1e-4, atol=1e-7)
    return [
        str(w.message) for w in caught if "qkmonitor" in str(w.message) or "QK" in str(w.message)
    ]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["sdpa", "enable_gqa"])
def test_a_module_calling_sdpa_reads_its_updates_from_step_1_without_a_warning(kv_heads):
    if kv_heads != 4 and torch.__version__ < "2.5":
        pytest.skip(f"SDPA's enable_gqa arrived in torch 2.5 (installed: {torch.__version__})")
    torch.manual_seed(0)
    model = Stack(kv_heads)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    messages = run(
        model, list(model.blocks), 4, kv_heads, x, lambda m, batch: m(batch).pow(2).mean()
    )
    assert messages == []


def test_gpt_neo_read_by_interception_reads_its_updates_from_step_1_without_a_warning():
    model, attentions, heads = gpt_neo()
    tokens = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    messages = run(
        model, attentions, heads, heads, tokens, lambda m, batch: m(batch, labels=batch).loss
    )
    assert messages == []
