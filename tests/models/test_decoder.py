"""The bundled decoder and the recall task: defining properties, not snapshots."""

from __future__ import annotations

import pytest
import torch

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks import AssociativeRecallDataModule, make_recall_batch
from qkmonitor.models.tasks.recall import IGNORE_INDEX


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_decoder_is_causal(n_kv_heads):
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(vocab_size=20, d_model=32, n_heads=4, n_kv_heads=n_kv_heads)
    ).eval()
    tokens = torch.randint(20, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = torch.randint(20, (2, 5))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(
        a[:, :7], b[:, :7], rtol=1e-5, atol=1e-5
    )  # the past ignores the future
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_decoder_backward_reaches_every_parameter():
    model = DecoderLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_kv_heads=1))
    model(torch.randint(10, (2, 6))).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("d_model", 30, "`d_model` \\(30\\) to be divisible by `n_heads`"),
        ("n_kv_heads", 3, "`n_kv_heads` \\(3\\) to divide `n_heads`"),
        ("n_layers", 0, "`n_layers` to be a positive int"),
        ("dropout", 1.0, "`dropout`"),
        ("attention_backend", "cuda", "`attention_backend`"),
        ("rope_base", 1.0, "`rope_base`"),
    ],
)
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{field: value})


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = DecoderLM(TransformerConfig(vocab_size=8, d_model=16, n_heads=2, max_seq_len=4))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_recall_targets_are_the_values_that_followed_each_queried_key():
    tokens, targets = make_recall_batch(200, 5, 3, 12, 7, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (200, 13)
    keys, values = tokens[:, 0:10:2], tokens[:, 1:10:2]
    assert (keys < 12).all() and ((values >= 12) & (values < 19)).all()
    assert all(len(set(row.tolist())) == 5 for row in keys)  # distinct keys
    assert (targets[:, :10] == IGNORE_INDEX).all()
    for seq, tgt in zip(tokens, targets):
        pairs = dict(zip(seq[0:10:2].tolist(), seq[1:10:2].tolist()))
        for pos in range(10, 13):
            assert tgt[pos].item() == pairs[seq[pos].item()]
    assert len({tuple(seq[10:].tolist()) for seq in tokens}) > 1  # queries vary


def test_recall_data_is_reproducible_from_the_seed_and_checks_its_arguments():
    a, b = (
        AssociativeRecallDataModule(train_size=8, seed=3),
        AssociativeRecallDataModule(train_size=8, seed=3),
    )
    a.setup(), b.setup()
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    with pytest.raises(ValueError, match="`num_queries` <= `num_pairs`"):
        AssociativeRecallDataModule(num_pairs=2, num_queries=3)
    with pytest.raises(ValueError, match="`num_keys` >= `num_pairs`"):
        AssociativeRecallDataModule(num_pairs=8, num_keys=4)
    with pytest.raises(ValueError, match="`batch_size`"):
        AssociativeRecallDataModule(batch_size=0)


def test_probed_attention_exposes_kernel_statistics_of_the_last_forward():
    """Entropy and max-prob from the fused kernel equal those of the explicit float64 softmax."""
    from qkmonitor.attention.adapters import find_attention_layers
    from qkmonitor.models.rope import apply_rotary_pos_emb

    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=16, d_model=32, n_heads=4, n_kv_heads=2)).eval()
    layers = find_attention_layers(model)
    assert all(layer.supports_stats for layer in layers)
    tokens = torch.randint(16, (3, 9))
    captured = {}
    attn = model.blocks[1].attn
    handle = attn.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    probes = [layer.open_probe() for layer in layers]
    with torch.no_grad():
        model(tokens)
    handle.remove()
    results = [probe.close() for probe in probes]
    assert results[1].calls == 1 and len(results[1].stats) == 1
    stats = results[1].stats[0]
    assert not attn.probing  # closing removed the observers
    with torch.no_grad():
        model(tokens)
    assert results[1].calls == 1  # a closed probe sees nothing more

    x = captured["x"].double()  # (B, N, d), the attention module's input
    q = (x @ attn.q_proj.weight.double().T).view(3, 9, 4, 8).transpose(1, 2)
    k = (
        (x @ attn.k_proj.weight.double().T)
        .view(3, 9, 2, 8)
        .transpose(1, 2)
        .repeat_interleave(2, dim=1)
    )
    cos, sin = attn.rope.cos[:9].double(), attn.rope.sin[:9].double()
    q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) * attn.qk_weights().scale
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    p = scores.softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert stats.entropy.shape == (3, 4, 9)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.max_prob.double(), p.amax(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        stats.attended, torch.arange(1, 10, dtype=torch.float32).expand(3, 4, 9)
    )


def test_two_probes_on_one_module_are_independent():
    model = DecoderLM(TransformerConfig(vocab_size=8, d_model=16, n_heads=2))
    layer = find_attention_layers(model)[0]
    attn = layer.module
    plain = layer.open_probe()
    sliced = layer.open_probe(ProbeRequest(probs_slice=(1, 3), sink_tokens=1))
    with torch.no_grad():
        model(torch.randint(8, (2, 5)))
    first = plain.close()
    assert attn.probing  # the other probe is still open
    with torch.no_grad():
        model(torch.randint(8, (2, 5)))
    second = sliced.close()
    assert not attn.probing
    assert first.calls == 1 and second.calls == 2 and not first.probs
    assert [p.shape for p in second.probs] == [(1, 2, 3, 5)] * 2
    assert all(
        stats.sink_mass is not None for stats in second.stats
    )  # the kernel measured it in the same pass
    assert plain.close() is first  # closing again changes nothing
