"""``benchmarks/cycles.py``'s count of what a step leaves in reference cycles, on cycles made with
known contents, and its table on the current capture (nothing left); and the one-rank tensor-
parallel benchmark's count of the collector's runs."""

from __future__ import annotations

import gc

import torch


def test_left_in_cycles_counts_the_objects_and_each_tensor_storage_once(benchmark_module):
    cycles = benchmark_module("cycles")
    storage = torch.zeros(1000, dtype=torch.float64)  # 8000 bytes

    def make():
        ring: list = [storage.view(10, 100), storage[:500]]  # two views of one storage
        ring.append(ring)  # the list holds itself: a cycle of one list

    enabled = gc.isenabled()
    gc.disable()
    try:
        objects, nbytes = cycles.left_in_cycles(make)
        assert (objects, nbytes) == (3, 8000)  # the list, its two tensors; the storage once
        assert cycles.left_in_cycles(lambda: None) == (0, 0)
    finally:
        if enabled:
            gc.enable()


def test_the_table_of_the_current_capture_has_nothing_in_cycles(
    benchmark_module, capsys, monkeypatch
):
    cycles = benchmark_module("cycles")
    argv = [
        "cycles.py",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--batch",
        "2",
    ]
    monkeypatch.setattr("sys.argv", argv)
    enabled = gc.isenabled()
    cycles.main()
    assert gc.isenabled() == enabled  # put back as it was
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| SDPA", "training"],
        ["| SDPA", "no_grad"],
        ["| explicit softmax", "training"],
        ["| explicit softmax", "no_grad"],
    ]
    assert all(row.endswith("| 0, 0.0 | 0, 0.0 |") for row in rows), rows


def test_the_one_rank_benchmark_counts_each_collection(benchmark_module):
    one_rank = benchmark_module("tensor_parallel_one_rank")
    before = list(gc.callbacks)
    one_rank.count_the_collector()
    try:
        one_rank.COLLECTOR[:] = [0.0, 0]
        gc.collect()
        gc.collect(0)
        assert one_rank.COLLECTOR[1] == 2 and one_rank.COLLECTOR[0] >= 0.0
    finally:
        gc.callbacks[:] = before


def test_nanogpts_slow_path_computes_what_its_sdpa_path_does(benchmark_module):
    """``benchmarks/nanogpt.py``'s ``flash=False`` (the explicit softmax ``cycles.py`` measures):
    the same logits as SDPA's on the same weights, and its mask a buffer that is not saved."""
    from qkmonitor.models import TransformerConfig

    nanogpt = benchmark_module("nanogpt")
    config = TransformerConfig(
        vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, dropout=0.0
    )
    torch.manual_seed(0)
    flash = nanogpt.GPT(config)
    slow = nanogpt.GPT(config, flash=False)
    slow.load_state_dict(flash.state_dict())  # the causal mask is no state: loads as it is
    tokens = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(slow(tokens), flash(tokens), rtol=1e-5, atol=1e-5)
