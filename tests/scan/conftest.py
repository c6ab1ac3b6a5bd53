"""Tiny Hugging Face models built from configs and saved (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(1))


def tiny_llama(layers: int = 2):
    """A tiny LLaMA with GQA (8 query, 2 key heads of 8), random weights from torch's generator."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def save_llama(path, seed: int = 0, layers: int = 2, **saving):
    """:func:`tiny_llama` saved at ``path``; returns the model."""
    torch.manual_seed(seed)
    model = tiny_llama(layers).eval()
    model.save_pretrained(path, **saving)
    return model


@pytest.fixture
def llama_saver():
    """``save_llama(path, seed=0, layers=2, **save_pretrained_kwargs)``."""
    return save_llama
