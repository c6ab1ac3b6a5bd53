"""The measures' spectra, ranks, entropies and probabilities against dense float64 math and
spectra built by hand."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from qkmonitor.measures import entropies, probabilities, ranks, spectra


def dense_w_qk(
    w_q: torch.Tensor, w_k: torch.Tensor, h: int, num_heads: int, num_kv_heads: int
) -> np.ndarray:
    """The d x d' matrix W_Q^h (W_K^g)^T, formed naively in float64."""
    d_k = w_q.shape[0] // num_heads
    g = h // (num_heads // num_kv_heads)
    wq_h = w_q[h * d_k : (h + 1) * d_k].double().numpy().T  # (d, d_k)
    wk_g = w_k[g * d_k : (g + 1) * d_k].double().numpy().T  # (d', d_k)
    return wq_h @ wk_g.T


def random_orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    return q


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "d", "d_kv_in"),
    [(4, 4, 32, 32), (8, 2, 64, 64), (4, 1, 32, 32), (2, 2, 16, 24)],
    ids=["mha", "gqa", "mqa", "cross-dims"],
)
def test_singular_values_match_dense_svd(num_heads, num_kv_heads, d, d_kv_in):
    gen = torch.Generator().manual_seed(0)
    d_k = d // num_heads
    w_q = torch.randn(num_heads * d_k, d, generator=gen)
    w_k = torch.randn(num_kv_heads * d_k, d_kv_in, generator=gen)
    got = spectra.qk_singular_values(w_q, w_k, num_heads, num_kv_heads)
    assert got.shape == (num_heads, d_k) and got.dtype == torch.float32
    for h in range(num_heads):
        expected = np.linalg.svd(
            dense_w_qk(w_q, w_k, h, num_heads, num_kv_heads), compute_uv=False
        )[:d_k]
        assert_close(got[h].double(), torch.from_numpy(expected), rtol=1e-4, atol=1e-4)


def test_batched_layers_equal_one_call_per_layer():
    gen = torch.Generator().manual_seed(1)
    w_q, w_k = torch.randn(3, 32, 32, generator=gen), torch.randn(3, 16, 32, generator=gen)
    batched = spectra.qk_singular_values(w_q, w_k, num_heads=4, num_kv_heads=2)
    assert batched.shape == (3, 4, 8)
    for layer in range(3):
        assert_close(batched[layer], spectra.qk_singular_values(w_q[layer], w_k[layer], 4, 2))


def test_known_spectrum_gives_exact_kappa_and_erank():
    """W_Q = U diag(s), W_K = V (orthonormal columns): W_QK = U diag(s) V^T has singular values
    s."""
    gen = torch.Generator().manual_seed(2)
    d, d_k = 24, 4
    s = torch.tensor([8.0, 4.0, 2.0, 1.0], dtype=torch.float64)
    w_q = (random_orthonormal(d, d_k, gen) * s).T  # rows = columns of W_Q^h
    w_k = random_orthonormal(d, d_k, gen).T
    metrics = spectra.qk_spectrum_metrics(w_q, w_k, num_heads=1, scale=0.5)
    p = s / s.sum()
    assert_close(spectra.qk_singular_values(w_q, w_k, 1)[0], s)
    assert_close(metrics["kappa"][0], s[0] / s.sum())
    assert_close(metrics["qk_erank"][0], torch.exp(-(p * p.log()).sum()))
    assert_close(metrics["qk_spectral_norm"][0], s[0] * 0.5)
    assert_close(metrics["qk_stable_rank"][0], (s**2).sum() / s[0] ** 2)
    assert_close(metrics["sec"][0], s[0] ** 2 / (s**2).sum())


def test_rank_one_head_has_kappa_one_and_erank_one():
    gen = torch.Generator().manual_seed(3)
    u, v = torch.randn(1, 16, generator=gen), torch.randn(1, 16, generator=gen)
    w_q = torch.cat([u * 3.0, torch.zeros(3, 16)])  # one non-zero direction in a d_k = 4 head
    w_k = torch.cat([v, torch.zeros(3, 16)])
    metrics = spectra.qk_spectrum_metrics(w_q, w_k, num_heads=1)
    assert_close(metrics["kappa"], torch.ones(1))
    assert_close(metrics["qk_erank"], torch.ones(1))


def test_eigenvalues_match_dense_eig():
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, d = 4, 2, 32
    d_k = d // num_heads
    w_q = torch.randn(num_heads * d_k, d, generator=gen, dtype=torch.float64)
    w_k = torch.randn(num_kv_heads * d_k, d, generator=gen, dtype=torch.float64)
    got = spectra.qk_eigenvalues(w_q, w_k, num_heads, num_kv_heads)
    assert got.shape == (num_heads, d_k) and got.dtype == torch.complex128
    for h in range(num_heads):
        dense = np.linalg.eigvals(dense_w_qk(w_q, w_k, h, num_heads, num_kv_heads))
        top = dense[np.argsort(-np.abs(dense), kind="stable")][:d_k]
        # the d - d_k others are zero
        assert np.abs(dense[np.argsort(-np.abs(dense))][d_k:]).max() < 1e-8
        assert_close(got[h].abs(), torch.from_numpy(np.abs(top)), rtol=1e-8, atol=1e-8)
        # as a multiset: every dense eigenvalue has a match among ours
        distance = np.abs(top[:, None] - got[h].numpy()[None, :]).min(axis=1)
        assert distance.max() < 1e-8
        mean, var = spectra.eigenvalue_moments(got[h])
        assert math.isclose(
            mean.item(),
            np.trace(dense_w_qk(w_q, w_k, h, num_heads, num_kv_heads)) / d_k,
            rel_tol=1e-9,
            abs_tol=1e-9,
        )
        assert math.isclose(var.item(), np.mean(np.abs(top - top.mean()) ** 2), rel_tol=1e-9)


def test_eigenvalues_of_a_symmetric_head_are_its_built_spectrum():
    """W_QK = U diag(lam) U^T: eigenvalues lam, kappa_eig = max|lam| / sum|lam|."""
    gen = torch.Generator().manual_seed(5)
    lam = torch.tensor([-5.0, 3.0, 1.0, 0.5], dtype=torch.float64)
    u = random_orthonormal(16, 4, gen)
    eig = spectra.qk_eigenvalues((u * lam).T, u.T, num_heads=1)[0]
    assert_close(eig.real, lam, atol=1e-10, rtol=0)  # by descending modulus, lam is already sorted
    assert_close(eig.imag, torch.zeros(4, dtype=torch.float64), atol=1e-10, rtol=0)
    assert_close(spectra.spectral_concentration(eig), lam.abs().max() / lam.abs().sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_computed_in_float32(dtype):
    gen = torch.Generator().manual_seed(6)
    w_q, w_k = (
        torch.randn(32, 32, generator=gen).to(dtype),
        torch.randn(32, 32, generator=gen).to(dtype),
    )
    got = spectra.qk_singular_values(w_q, w_k, num_heads=4)
    assert got.dtype == torch.float32
    expected = spectra.qk_singular_values(
        w_q.double(), w_k.double(), num_heads=4
    )  # same rounded weights
    assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_non_finite_head_gives_nan_for_that_head_only():
    gen = torch.Generator().manual_seed(7)
    w_q, w_k = torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)
    w_q[9, 3] = float("nan")  # head 1 of 4 (d_k = 8)
    w_k[30, 0] = float("inf")  # head 3
    metrics = spectra.qk_spectrum_metrics(w_q, w_k, num_heads=4)
    for name, values in metrics.items():
        assert values[[1, 3]].isnan().all(), name
        assert values[[0, 2]].isfinite().all(), name


def test_rank_measures_against_their_formulas():
    s = torch.tensor([[4.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    p = s / s.sum(-1, keepdim=True)
    assert_close(ranks.effective_rank(s), torch.exp(-(p * p.log()).sum(-1)))
    assert_close(ranks.effective_rank(s[1]), torch.tensor(4.0, dtype=torch.float64))
    assert_close(ranks.stable_rank(s), (s**2).sum(-1) / (s**2).amax(-1))
    assert_close(spectra.spectral_concentration(s), torch.tensor([0.5, 0.25], dtype=torch.float64))
    assert spectra.spectral_concentration(torch.zeros(3)).isnan()  # no direction to concentrate on


def test_attention_entropy_against_naive_sum():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # row i may attend keys j <= i + 2
    probs = logits.masked_fill(~mask, -math.inf).softmax(-1)
    got = entropies.attention_entropy(probs, mask=mask)
    norm = entropies.attention_entropy(probs, normalize=True, mask=mask)
    for i in range(5):
        n_i = i + 3
        row = probs[..., i, :n_i]
        h = -(row * row.log()).sum(-1)
        assert_close(got[..., i], h)
        assert_close(norm[..., i], h / math.log(n_i))
    uniform = torch.full((1, 4), 0.25)
    assert_close(entropies.attention_entropy(uniform, normalize=True), torch.ones(1))


def test_attention_entropy_of_single_key_rows_is_nan_when_normalized():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    mask = torch.tensor([[True, False], [True, True]])
    got = entropies.attention_entropy(probs, normalize=True, mask=mask)
    assert got[0].isnan() and got[1].item() == pytest.approx(1.0)
    assert entropies.attention_entropy(probs, mask=mask)[0].item() == 0.0


def _scores_with_every_row_kind():
    """(1, 1, 6, 5) float32 scores and a mask: healthy, NaN, +inf, fully masked, NaN under the mask,
    −inf on an allowed key."""
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(1, 1, 6, 5, generator=gen)
    mask = torch.ones(1, 1, 6, 5, dtype=torch.bool)
    s[0, 0, 0, 4] = -math.inf  # row 0: healthy; key 4 masked by its score
    s[0, 0, 1, 2] = math.nan  # row 1: a NaN score
    s[0, 0, 2, 3] = math.inf  # row 2: a +inf score
    mask[0, 0, 3] = False  # row 3: fully masked
    s[0, 0, 4, 1], mask[0, 0, 4, 1] = math.nan, False  # row 4: the NaN is on a masked key
    mask[0, 0, 5, 0], s[0, 0, 5, 2] = False, -math.inf  # row 5: masked by mask and by score
    return s, mask


def test_attention_stats_from_scores_marks_nonfinite_rows():
    s, mask = _scores_with_every_row_kind()
    stats = entropies.attention_stats_from_scores(s, mask=mask, sink_tokens=2)
    nan, inf = math.nan, math.inf
    for row in (0, 4, 5):  # healthy rows by the formula, over the finite allowed scores
        keep = mask[0, 0, row] & torch.isfinite(s[0, 0, row])
        x = s[0, 0, row].double()[keep]
        p = x.softmax(-1)
        expected = {
            "lse": torch.logsumexp(x, -1), "entropy": -(p * p.log()).sum(), "max_prob": p.max(),
            "max_logit": x.max(), "attended": keep.sum().double(),  # −inf is masking here
            "sink_mass": torch.where(keep[:2], s[0, 0, row, :2].double() - torch.logsumexp(x, -1),
                                     -inf).exp().sum(),
        }  # fmt: skip
        for name, value in expected.items():
            assert_close(getattr(stats, name)[0, 0, row].double(), value, atol=1e-6, rtol=1e-6)
    broken = {  # rows 1 (NaN), 2 (+inf) and 3 (no key)
        "lse": [nan, inf, -inf], "entropy": [nan, nan, 0.0], "max_prob": [nan, nan, 0.0],
        "max_logit": [nan, inf, -inf], "attended": [5.0, 5.0, 0.0], "sink_mass": [nan, nan, 0.0],
    }  # fmt: skip
    for name, values in broken.items():
        assert_close(getattr(stats, name)[0, 0, 1:4], torch.tensor(values), equal_nan=True)


def test_masked_softmax_gives_nan_rows_for_nan_and_posinf_scores():
    s, mask = _scores_with_every_row_kind()
    p = probabilities.masked_softmax(s, mask=mask)
    assert p[0, 0, 1:3].isnan().all()  # NaN and +inf rows: every entry NaN, not a partial row
    assert (p[0, 0, 3] == 0).all()  # the fully masked row: zeros
    for row in (0, 4, 5):
        expected = s[0, 0, row].masked_fill(~mask[0, 0, row], -math.inf).softmax(-1)
        assert_close(p[0, 0, row], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_softmax_in_place_is_the_float64_softmax_and_leaves_the_copy_alone(dtype):
    """Sharp rows (scores spread over hundreds: most probabilities underflow) and every row kind:
    the in-place softmax writes into the scores' memory; the copying one leaves its input."""
    s, mask = _scores_with_every_row_kind()
    g = torch.Generator().manual_seed(0)
    sharp = (torch.randn(2, 3, 6, 5, generator=g) * 300).to(dtype)
    for scores, allowed in ((s.to(dtype), mask), (sharp, torch.rand(6, 5, generator=g) > 0.3)):
        before = scores.clone()
        copied = probabilities.masked_softmax(scores, mask=allowed)
        assert_close(scores, before, rtol=0, atol=0, equal_nan=True)
        work = scores.clone()
        in_place = probabilities.masked_softmax_(work, mask=allowed)
        assert in_place.data_ptr() == work.data_ptr()
        assert_close(in_place, copied, rtol=0, atol=0, equal_nan=True)
        expected = scores.double().masked_fill(~allowed, -math.inf).softmax(-1)
        rows = torch.isfinite(scores.masked_fill(~allowed, 0)).all(-1) & allowed.any(-1)
        assert_close(copied[rows].double(), expected[rows], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    ("w_q_shape", "w_k_shape", "heads", "kv_heads", "match"),
    [
        ((30, 32), (30, 32), 4, None, "multiple of `num_heads`"),
        ((32, 32), (32, 32), 4, 3, "`num_kv_heads`"),
        ((32, 32), (24, 32), 4, 2, "num_kv_heads \\* d_k"),
        ((32,), (32, 32), 4, None, "shape"),
        ((2, 32, 32), (32, 32), 4, None, "leading dims"),
        ((32, 32), (32, 32), 0, None, "`num_heads`"),
        ((32, 32), (32, 32), True, None, "`num_heads` to be a positive int"),  # a bool is no count
        ((32, 32), (32, 32), 4, True, "`num_kv_heads`"),
    ],
)
def test_bad_shapes_raise_value_error_naming_the_argument(
    w_q_shape, w_k_shape, heads, kv_heads, match
):
    with pytest.raises(ValueError, match=match):
        spectra.qk_singular_values(torch.zeros(w_q_shape), torch.zeros(w_k_shape), heads, kv_heads)


def test_integer_weights_are_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        spectra.qk_singular_values(torch.zeros(4, 4, dtype=torch.int64), torch.zeros(4, 4), 1)


def test_eigenvalues_need_square_w_qk():
    with pytest.raises(ValueError, match="square"):
        spectra.qk_eigenvalues(torch.zeros(8, 8), torch.zeros(8, 6), 1)


def test_gram_singular_values_of_a_large_batch_on_threads_are_the_single_threaded_ones(
    monkeypatch,
):
    """A large CPU batch of eigenproblems is split over torch's threads; each matrix's values are
    those of one single-threaded call to float64's rounding, and match float64 SVD."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 12, 20, generator=gen).softmax(-1)
    monkeypatch.setattr(ranks, "_THREADED_EIGH", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        split = ranks.gram_singular_values(x)
        torch.set_num_threads(1)
        single = ranks.gram_singular_values(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(split, single, rtol=1e-12, atol=1e-15)
    reference = torch.linalg.svdvals(x.double())
    assert torch.allclose(split, reference, atol=1e-10)


@pytest.mark.parametrize("threads", [1, 2])
def test_gram_singular_values_in_parts_match_the_whole_batch_and_svd(monkeypatch, threads):
    """A CPU batch larger than a part is solved part after part (on threads when large), in order:
    the values are the whole batch's in one call to float64's rounding and match float64 SVD; a
    matrix larger than a part is a part of its own."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(2, 5, 9, 14, generator=gen).softmax(-1)  # 10 matrices of 126 numbers
    solve = ranks._gram_singular_values
    whole = solve(x.flatten(0, 1)).reshape(2, 5, 9)
    monkeypatch.setattr(ranks, "NUMBERS_PER_PART", 3 * 126)  # parts of 3 at most: 2, 3, 2, 3
    monkeypatch.setattr(ranks, "_THREADED_EIGH", 1)
    solved = []
    monkeypatch.setattr(ranks, "_gram_singular_values", lambda b: solved.append(len(b)) or solve(b))
    count = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values = ranks.gram_singular_values(x)
    finally:
        torch.set_num_threads(count)
    assert sorted(solved) == [2, 2, 3, 3]
    assert torch.allclose(values, whole, rtol=1e-12, atol=1e-15)
    assert torch.allclose(values, torch.linalg.svdvals(x.double()), atol=1e-10)
    solved.clear()
    monkeypatch.setattr(ranks, "NUMBERS_PER_PART", 100)  # smaller than one matrix
    assert torch.allclose(ranks.gram_singular_values(x[0]), whole[0], rtol=1e-12, atol=1e-15)
    assert solved == [1] * 5


def test_gram_parts_hold_at_most_a_part_one_a_thread_and_cover_the_batch_in_order():
    """Parts hold at most NUMBERS_PER_PART numbers (a matrix at least), are at least one a
    thread where the batch has as many matrices, and cover the batch in order; off the CPU the
    batch is one part."""
    per_part = ranks.NUMBERS_PER_PART
    cases = [(16, 128 * 128, 1), (40, 64 * 64, 2), (3, 2 * per_part, 1), (5, 8, 4), (1, 8, 2)]
    for count, numbers, threads in cases:
        parts = ranks._parts(count, numbers, "cpu", threads)
        sizes = [p.stop - p.start for p in parts]
        assert [p.start for p in parts] == [sum(sizes[:i]) for i in range(len(parts))]
        assert sum(sizes) == count
        assert all(s * numbers <= per_part or s == 1 for s in sizes)
        assert len(parts) >= min(threads, count) and max(sizes) - min(sizes) <= 1
    assert len(ranks._parts(16, 128 * 128, "cpu")) == 2  # EffectiveRank's 16 slices of 128
    assert ranks._parts(16, 128 * 128, "cuda") == [slice(0, 16)]


def test_hidden_state_metrics_in_parts_equal_float64_per_sequence(monkeypatch):
    """A batch of residual-stream matrices read a part of the sequences at a time (parts of 2
    here): each sequence's effective rank (float64 SVD) and collapse residual ‖X − 1x̄ᵀ‖ / ‖X‖
    are its own, in place; a NaN makes its sequence NaN alone; one token has no residual."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 7, 5, generator=gen)  # 6 sequences of 7 tokens x 5
    x[0, 1] += 3.0 * torch.randn(5, generator=gen)  # a sequence with a large mean direction
    x[1, 2, 4, 0] = float("nan")
    monkeypatch.setattr(ranks, "NUMBERS_PER_PART", 2 * 7 * 5)
    erank, collapse = ranks.hidden_state_metrics(x)
    assert erank.shape == collapse.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            seq = x[i, j].double()
            if seq.isnan().any():
                assert erank[i, j].isnan() and collapse[i, j].isnan()
                continue
            sv = torch.linalg.svdvals(seq)
            p = sv / sv.sum()
            assert erank[i, j].item() == pytest.approx(float(torch.exp(-(p * p.log()).sum())))
            residual = torch.linalg.norm(seq - seq.mean(0)) / torch.linalg.norm(seq)
            assert collapse[i, j].item() == pytest.approx(float(residual), rel=1e-12)
    one_token = ranks.hidden_state_metrics(x[:, :, :1])[1]
    assert one_token.isnan().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_an_empty_batch_gives_empty_values_of_its_shape(monkeypatch, threads):
    """No matrix in: no value out, shaped as the batch (as before the parts), on any threads."""
    monkeypatch.setattr(ranks, "_THREADED_EIGH", 1)
    count = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values = ranks.gram_singular_values(torch.zeros(0, 3, 4, 5))
        erank, collapse = ranks.hidden_state_metrics(torch.zeros(0, 4, 5))
    finally:
        torch.set_num_threads(count)
    assert values.shape == (0, 3, 4) and values.dtype == torch.float64
    assert erank.shape == collapse.shape == (0,)


def test_attention_erank_leaves_out_the_keys_no_row_attends_and_keeps_nan():
    """A causal slice of the first rows attends none of the later keys: their zero columns are
    left out of the Gram matrix, and the effective ranks are those of the whole slice (float64
    SVD); a NaN in a late column is not zero and still makes its matrix NaN."""
    from qkmonitor.engine.rank import _attention_erank

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 6, 10, generator=gen)
    causal = torch.arange(10)[None, :] <= torch.arange(6)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    (erank,) = _attention_erank(probs)
    sv = torch.linalg.svdvals(probs.double())
    p = sv / sv.sum(-1, keepdim=True)
    reference = torch.exp(-(p * torch.where(p > 0, p.log(), 0.0)).sum(-1))
    assert torch.allclose(erank, reference, atol=1e-9)
    broken = probs.clone()
    broken[1, 2, 0, 9] = float("nan")
    (with_nan,) = _attention_erank(broken)
    assert torch.isnan(with_nan[1, 2]) and torch.equal(with_nan[0], erank[0])


def test_work_on_threads_keeps_the_order_reuses_its_workers_and_waits_for_them_on_failure():
    """``on_threads`` returns the chunks' results in order, runs them on the same worker threads
    from call to call, restores torch's thread count, runs a call made inside a chunk on that
    chunk's thread (no wait on a busy worker), and on a failing chunk raises its error only after
    the other chunks have finished."""
    import threading
    import time

    from qkmonitor import threads as qk_threads

    count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[str] = []

        def solve(chunk: slice) -> list[int]:
            seen.append(threading.current_thread().name)
            return list(range(chunk.start, chunk.stop))

        chunks = [slice(i, i + 2) for i in range(0, 10, 2)]
        assert qk_threads.on_threads(solve, chunks) == [
            list(range(i, i + 2)) for i in range(0, 10, 2)
        ]
        workers = {name for name in seen if name.startswith("qkmonitor")}
        assert workers and threading.current_thread().name in seen
        seen.clear()
        qk_threads.on_threads(solve, chunks)
        assert {name for name in seen if name.startswith("qkmonitor")} <= workers
        assert torch.get_num_threads() == 2

        def nested(chunk: slice) -> list[list[int]]:  # a chunk that splits its work again
            return qk_threads.on_threads(solve, [slice(chunk.start, chunk.start + 1)] * 2)

        assert qk_threads.on_threads(nested, chunks[:2]) == [[[0], [0]], [[2], [2]]]

        finished: list[int] = []

        def failing(chunk: slice) -> None:
            if chunk.start == 0:  # the caller's chunk fails at once
                raise RuntimeError("chunk 0 failed")
            time.sleep(0.05)
            finished.append(chunk.start)

        with pytest.raises(RuntimeError, match="chunk 0 failed"):
            qk_threads.on_threads(failing, [slice(0, 1), slice(1, 2)])
        assert finished == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(count)


def _sums_on_threads(_: int) -> list[int]:
    from qkmonitor.threads import on_threads

    torch.set_num_threads(2)
    return on_threads(lambda c: sum(range(c.start, c.stop)), [slice(0, 3), slice(3, 6)])


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_work_on_threads_in_a_forked_child_makes_its_own_workers():
    """A forked child (a DataLoader worker) has none of its parent's threads: its first
    ``on_threads`` makes workers of its own instead of waiting on the parent's forever."""
    import multiprocessing

    count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _sums_on_threads(0) == [3, 12]  # the parent's workers exist
        pool = multiprocessing.get_context("fork").Pool(1)
        try:
            assert pool.map_async(_sums_on_threads, [0]).get(timeout=60) == [[3, 12]]
            pool.close()  # the worker leaves at the queue's end, as asked: `with Pool` would
            pool.join()  # SIGTERM it, which a handler the test process holds (Lightning's
        finally:  # signal connector, from a fit before) catches in the child: it never exits
            pool.terminate()
    finally:
        torch.set_num_threads(count)


@pytest.mark.parametrize("n, m", [(8, 8), (5, 9), (6, 3)])
@pytest.mark.parametrize("rows", [1, 3, 8, 12])
def test_probability_slice_of_a_causal_call_is_the_explicit_attention(n, m, rows):
    """A causal call's probability slice is computed over the keys its rows attend and zero past
    them; it equals float64 explicit attention of those rows over every key (M < N: rows that
    see no key are zeros), with key padding and grouped heads."""
    from qkmonitor.attention.calls import MaskedCall

    gen = torch.Generator().manual_seed(n * 100 + m * 10 + rows)
    q = torch.randn(3, 4, n, 8, generator=gen)
    k = torch.randn(3, 2, m, 8, generator=gen)
    padding = torch.rand(3, m, generator=gen) > 0.3
    padding[:, 0] = True
    call = MaskedCall(q, k, 0.35, True, padding, None, None)
    got = call.probs(2, rows)
    reference = probabilities.attention_probs(
        q[:2].double(), k[:2].double(), scale=0.35, causal=True, key_padding_mask=padding[:2]
    )[:, :, :rows]
    assert got.shape == reference.shape == (2, 4, min(rows, n), m)
    torch.testing.assert_close(got.double(), reference, atol=1e-6, rtol=0)
