"""qkmonitor.measures.gram_spectra and layer_spectra against dense float64 linear algebra on the
explicit d x d W_QK of each head.

The tolerances are the bounds stated in gram_spectra's docstring, evaluated for each head: with
``u`` the unit roundoff of the Gram products, ``ε = u·sqrt(d)``, ``S = ||W_Q^h|| ||W_K^g||``:
``|Δσ_i| <= min(sqrt(3ε)·S, 3ε S²/σ_i)`` where σ̂_i > 0, ``σ_i <= sqrt(6ε)·S`` where σ̂_i was
reported as 0, and ``|Δλ| <= cond(V)·(ε S + d_k u ||C||)``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from qkmonitor.measures import gram_spectra, layer_spectra
from qkmonitor.measures.gram_spectra import qk_head_spectra
from qkmonitor.measures.layer_spectra import SPECTRUM_METRICS, QKWeights, spectrum_of_layers

FLOAT32_U = 2.0**-24
FLOAT64_U = 2.0**-53


# -- the reference: dense float64 ---------------------------------------------------------------


def head_factors(w_q: torch.Tensor, w_k: torch.Tensor, h: int, num_heads: int, num_kv_heads: int):
    """W_Q^h (d x d_k) and W_K^g (d' x d_k) of head h, float64 numpy, from the (rounded) weights."""
    d_k = w_q.shape[0] // num_heads
    g = h // (num_heads // num_kv_heads)
    return w_q[h * d_k : (h + 1) * d_k].double().numpy().T, w_k[
        g * d_k : (g + 1) * d_k
    ].double().numpy().T


def dense_reference(w_q, w_k, num_heads, num_kv_heads):
    """Per head: σ and λ of the explicit d x d W_QK (top d_k), S = ||W_Q^h|| ||W_K^g||, and C."""
    d_k = w_q.shape[0] // num_heads
    heads = []
    for h in range(num_heads):
        wq_h, wk_g = head_factors(w_q, w_k, h, num_heads, num_kv_heads)
        w_qk = wq_h @ wk_g.T
        sigma = np.linalg.svd(w_qk, compute_uv=False)[:d_k]
        scale = np.linalg.norm(wq_h, 2) * np.linalg.norm(wk_g, 2)
        head = {"sigma": sigma, "S": scale}
        if w_qk.shape[0] == w_qk.shape[1]:
            head["C"] = wk_g.T @ wq_h
            lam = np.linalg.eigvals(w_qk)
            head["lam"] = lam[np.argsort(-np.abs(lam), kind="stable")][:d_k]
        heads.append(head)
    return heads


def sigma_bound(
    sigma: np.ndarray, scale: float, eps: float, reported: np.ndarray | None = None
) -> np.ndarray:
    """The stated per-value bound on |σ̂_i − σ_i| (``reported`` σ̂: where it is 0, the floor's)."""
    with np.errstate(divide="ignore"):
        relative = np.where(sigma > 0, 3 * eps * scale**2 / sigma, np.inf)
    bound = np.minimum(math.sqrt(3 * eps) * scale, relative)
    if reported is None:
        return bound
    return np.where(reported > 0, bound, math.sqrt(6 * eps) * scale)


def eigenvalue_bound(c: np.ndarray, scale: float, eps: float, u: float) -> float:
    """Bauer-Fike: cond(V) times the backward error of the computed C."""
    _, vectors = np.linalg.eig(c)
    return np.linalg.cond(vectors) * (eps * scale + c.shape[0] * u * np.linalg.norm(c, 2))


def naive_metrics(sigma: np.ndarray, lam: np.ndarray | None, scale: float) -> dict[str, float]:
    p = sigma / sigma.sum()
    p = p[p > 0]
    out = {
        "kappa": sigma[0] / sigma.sum(),
        "qk_erank": math.exp(-(p * np.log(p)).sum()),
        "qk_spectral_norm": sigma[0] * scale,
    }
    if lam is not None:
        out.update(
            kappa_eig=np.abs(lam).max() / np.abs(lam).sum(),
            eig_mean=lam.mean().real,
            eig_var=np.mean(np.abs(lam - lam.mean()) ** 2),
        )
    return out


def metric_tolerances(
    sigma: np.ndarray, delta: np.ndarray, lam: np.ndarray | None, delta_lam: float, scale: float
):
    """First-order error bounds of the metrics, given per-value bounds on σ (``delta``) and λ."""
    total, shift = sigma.sum(), delta.sum()
    p = sigma / total
    log_p = np.log(np.where(p > 0, p, 1.0))
    entropy = -(p * log_p).sum()
    out = {
        "kappa": (delta[0] + sigma[0] / total * shift) / (total - shift),
        "qk_erank": math.exp(entropy) * (delta * np.abs(log_p + entropy)).sum() / (total - shift),
        "qk_spectral_norm": delta[0] * scale,
    }
    if lam is not None:
        moduli = np.abs(lam).sum()
        d_k = len(lam)
        out.update(
            kappa_eig=(delta_lam + np.abs(lam).max() / moduli * d_k * delta_lam)
            / (moduli - d_k * delta_lam),
            eig_mean=delta_lam,
            eig_var=4 * delta_lam * np.abs(lam - lam.mean()).max() + 4 * delta_lam**2,
        )
    return out


# -- weights ------------------------------------------------------------------------------------


def orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64)).Q


def head_rows(d: int, d_k: int, spectrum: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(d_k, d) rows of one head's weight with singular values ``spectrum``: U diag(s) V^T."""
    return (orthonormal(d_k, d_k, gen) * spectrum) @ orthonormal(d, d_k, gen).T


def make_weights(kind: str, num_heads: int, num_kv_heads: int, d: int, d_k: int, seed: int):
    """(w_q, w_k) float64 of a named kind: random, ill-conditioned (~1e4), low-rank (rank 3)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(num_heads * d_k, d, generator=gen, dtype=torch.float64), torch.randn(
            num_kv_heads * d_k, d, generator=gen, dtype=torch.float64
        )
    if kind == "ill-conditioned":
        spectrum = torch.logspace(0, -4, d_k, dtype=torch.float64)
    elif kind == "low-rank":
        spectrum = torch.cat(
            [
                torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64),
                torch.zeros(d_k - 3, dtype=torch.float64),
            ]
        )
    else:
        raise ValueError(kind)
    w_q = torch.cat([head_rows(d, d_k, spectrum, gen) for _ in range(num_heads)])
    w_k = torch.cat([head_rows(d, d_k, spectrum, gen) for _ in range(num_kv_heads)])
    return w_q, w_k


KINDS = ["random", "ill-conditioned", "low-rank"]
# (heads, kv heads, d, d_k): MHA, GQA, and heads wide enough (d_k >= 64) for the Gram by halves
LAYOUTS = [(4, 4, 64, 16), (8, 2, 64, 16), (2, 1, 96, 64)]
LAYOUT_IDS = ["mha", "gqa", "mqa-wide"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_singular_and_eigenvalues_within_the_stated_bound(kind, layout, dtype):
    num_heads, num_kv_heads, d, d_k = layout
    w_q, w_k = (w.to(dtype) for w in make_weights(kind, num_heads, num_kv_heads, d, d_k, seed=0))
    u = FLOAT64_U if dtype == torch.float64 else FLOAT32_U
    eps = u * math.sqrt(d)
    got = qk_head_spectra(w_q, w_k, num_heads, num_kv_heads)
    assert got.singular_values.shape == (num_heads, d_k) and got.eigenvalues.shape == (
        num_heads,
        d_k,
    )
    assert got.eigenvalues.dtype == (
        torch.complex128 if dtype == torch.float64 else torch.complex64
    )
    for h, ref in enumerate(dense_reference(w_q, w_k, num_heads, num_kv_heads)):
        sigma = got.singular_values[h].numpy()
        assert np.all(np.diff(sigma) <= 0), "descending"
        bound = sigma_bound(ref["sigma"], ref["S"], eps, sigma)
        assert np.all(np.abs(sigma - ref["sigma"]) <= bound), (h, sigma, ref["sigma"])
        lam = got.eigenvalues[h].numpy().astype(np.complex128)
        tol = eigenvalue_bound(ref["C"], ref["S"], eps, u)
        assert np.abs(np.abs(lam) - np.abs(ref["lam"])).max() <= tol, h  # sorted moduli
        assert np.abs(lam[:, None] - ref["lam"][None, :]).min(axis=1).max() <= tol, (
            h
        )  # as a multiset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_low_rank_heads_have_exact_zeros_and_rank_one_heads_kappa_one(dtype):
    w_q, w_k = (w.to(dtype) for w in make_weights("low-rank", 4, 2, 64, 16, seed=13))  # rank 3
    assert qk_head_spectra(w_q, w_k, 4, 2).singular_values[:, 3:].eq(0).all()
    gen = torch.Generator().manual_seed(13)
    rank_one = (
        torch.randn(64, 1, generator=gen, dtype=torch.float64)
        @ torch.randn(1, 48, generator=gen, dtype=torch.float64)
    ).to(dtype)
    spectra = spectrum_of_layers([QKWeights(rank_one, w_k[:, :48], 4, 2, 1.0)])
    assert (
        spectra.singular_values[0][:, 1:].eq(0).all()
        and spectra.singular_values[0][:, 0].gt(0).all()
    )
    assert spectra.metrics["kappa"][0].eq(1).all() and spectra.metrics["qk_erank"][0].eq(1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_metrics_match_naive_float64_within_propagated_bounds(layout, dtype):
    num_heads, num_kv_heads, d, d_k = layout
    scale = 0.25
    layers = [
        tuple(w.to(dtype) for w in make_weights("random", num_heads, num_kv_heads, d, d_k, seed=s))
        for s in (2, 3)
    ]
    spectra = spectrum_of_layers(
        [QKWeights(w_q, w_k, num_heads, num_kv_heads, scale) for w_q, w_k in layers]
    )
    eps = FLOAT32_U * math.sqrt(d)
    for index, (w_q, w_k) in enumerate(layers):
        for h, ref in enumerate(dense_reference(w_q, w_k, num_heads, num_kv_heads)):
            delta = sigma_bound(
                ref["sigma"], ref["S"], eps, spectra.singular_values[index][h].double().numpy()
            )
            expected = naive_metrics(ref["sigma"], ref["lam"], scale)
            tols = metric_tolerances(
                ref["sigma"],
                delta,
                ref["lam"],
                eigenvalue_bound(ref["C"], ref["S"], eps, FLOAT32_U),
                scale,
            )
            for name in SPECTRUM_METRICS:
                value = spectra.metrics[name][index][h].item()
                # the float32 output rounds once more
                assert abs(value - expected[name]) <= tols[name] + FLOAT32_U * abs(
                    expected[name]
                ), (name, index, h)
            assert_close(
                spectra.singular_values[index][h].double(),
                torch.from_numpy(ref["sigma"]),
                rtol=FLOAT32_U,
                atol=float(delta.max()),
            )


def test_outputs_are_float32_cpu_with_masks_of_the_same_shape():
    w_q, w_k = make_weights("random", 4, 2, 32, 8, seed=4)
    spectra = spectrum_of_layers([QKWeights(w_q, w_k, 4, 2, 1.0)] * 2)
    assert set(spectra.metrics) == set(spectra.undefined) == set(SPECTRUM_METRICS)
    for name in SPECTRUM_METRICS:
        assert len(spectra.metrics[name]) == 2
        for values, mask in zip(spectra.metrics[name], spectra.undefined[name]):
            assert (
                values.shape == mask.shape == (4,)
                and values.dtype == torch.float32
                and values.device.type == "cpu"
            )
            assert mask.dtype == torch.bool and not mask.any()
    assert [sv.shape for sv in spectra.singular_values] == [(4, 8), (4, 8)]
    assert spectra.singular_values[0].dtype == torch.float32


# -- undefined by definition versus broken ---------------------------------------------------------


def test_non_square_w_qk_has_no_eigen_metrics_and_says_so():
    gen = torch.Generator().manual_seed(5)
    w_q, w_k = (
        torch.randn(16, 24, generator=gen),
        torch.randn(16, 40, generator=gen),
    )  # kdim != embed_dim
    spectra = spectrum_of_layers([QKWeights(w_q, w_k, 2, 2, 1.0)])
    for name in ("kappa_eig", "eig_mean", "eig_var"):
        assert spectra.metrics[name][0].isnan().all() and spectra.undefined[name][0].all(), name
    eps = FLOAT32_U * math.sqrt(40)
    for h, ref in enumerate(dense_reference(w_q, w_k, 2, 2)):
        assert "lam" not in ref
        delta = sigma_bound(ref["sigma"], ref["S"], eps)
        tol = metric_tolerances(ref["sigma"], delta, None, 0.0, 1.0)["kappa"]
        assert (
            abs(spectra.metrics["kappa"][0][h].item() - ref["sigma"][0] / ref["sigma"].sum())
            <= tol + 1e-7
        )
    for name in ("kappa", "qk_erank", "qk_spectral_norm"):
        assert spectra.metrics[name][0].isfinite().all() and not spectra.undefined[name][0].any(), (
            name
        )
    assert qk_head_spectra(w_q, w_k, 2, 2).eigenvalues is None


def test_zero_w_q_gives_undefined_ratios_and_zero_moments():
    """muP zero-initialises W_Q: W_QK = 0, κ and erank are 0/0, the eigenvalues are all 0."""
    gen = torch.Generator().manual_seed(6)
    w_q, w_k = torch.randn(32, 32, generator=gen), torch.randn(16, 32, generator=gen)
    w_q[8:16] = 0.0  # head 1 of 4
    spectra = spectrum_of_layers([QKWeights(w_q, w_k, 4, 2, 0.5)])
    for name in ("kappa", "kappa_eig", "qk_erank"):
        assert spectra.metrics[name][0].isnan().tolist() == [False, True, False, False], name
        assert spectra.undefined[name][0].tolist() == [False, True, False, False], name
    for name in ("eig_mean", "eig_var", "qk_spectral_norm"):
        assert spectra.metrics[name][0][1].item() == 0.0 and not spectra.undefined[name][0].any(), (
            name
        )
    assert spectra.singular_values[0][1].eq(0).all()


def test_zero_w_qk_from_disjoint_factors_is_undefined_too():
    """W_Q^h uses head coordinates 0-1, W_K^g coordinates 2-3: W_QK = Σ_k q_k k_k^T = 0, C
    nilpotent."""
    gen = torch.Generator().manual_seed(7)
    w_q, w_k = torch.zeros(4, 12), torch.zeros(4, 12)
    w_q[:2], w_k[2:] = torch.randn(2, 12, generator=gen), torch.randn(2, 12, generator=gen)
    assert not (w_q.double().T @ w_k.double()).any()
    spectra = spectrum_of_layers([QKWeights(w_q, w_k, 1, 1, 1.0)])
    assert spectra.undefined["kappa"][0].item() and spectra.undefined["kappa_eig"][0].item()
    assert (
        spectra.metrics["eig_var"][0].item() == 0.0
    )  # not the eigen-solver's noise on a Jordan block


def test_w_qk_zero_only_up_to_rounding_is_undefined_too():
    """Rows q_1 = q_2 = x, k_1 = -k_2 = y, rotated: W_QK = x y^T - x y^T = 0, up to rounding."""
    gen = torch.Generator().manual_seed(14)
    x, y = (
        torch.randn(1, 12, generator=gen, dtype=torch.float64),
        torch.randn(1, 12, generator=gen, dtype=torch.float64),
    )
    rotation = orthonormal(2, 2, gen)
    w_q, w_k = rotation @ torch.cat([x, x]), rotation @ torch.cat([y, -y])
    spectra = spectrum_of_layers([QKWeights(w_q.float(), w_k.float(), 1, 1, 1.0)])
    assert spectra.singular_values[0].eq(0).all()
    for name in ("kappa", "kappa_eig", "qk_erank"):
        assert spectra.metrics[name][0].isnan().all() and spectra.undefined[name][0].all(), name
    assert (
        spectra.metrics["eig_var"][0].item() == 0.0 and spectra.metrics["eig_mean"][0].item() == 0.0
    )


def test_non_finite_weights_are_nan_not_undefined_and_stay_in_their_head_and_layer():
    gen = torch.Generator().manual_seed(8)
    clean = [
        (torch.randn(32, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(3)
    ]
    broken_q, broken_k = clean[1][0].clone(), clean[1][1].clone()
    broken_q[9, 3] = float("nan")  # head 1
    broken_k[0, 5] = float("inf")  # group 0: heads 0 and 1
    broken_q[30, 0] = float("-inf")  # head 3
    layers = [clean[0], (broken_q, broken_k), clean[2]]
    spectra = spectrum_of_layers([QKWeights(q, k, 4, 2, 1.0) for q, k in layers])
    alone = spectrum_of_layers([QKWeights(q, k, 4, 2, 1.0) for q, k in clean])
    for name in SPECTRUM_METRICS:
        assert spectra.metrics[name][1].isnan().tolist() == [True, True, False, True], name
        assert not spectra.undefined[name][1].any(), name
        for index in (0, 2):
            assert_close(spectra.metrics[name][index], alone.metrics[name][index], rtol=0, atol=0)
    assert spectra.singular_values[1][[0, 1, 3]].isnan().all()
    assert_close(spectra.metrics["kappa"][1][2], alone.metrics["kappa"][1][2], rtol=1e-6, atol=0)


def test_a_failing_decomposition_makes_its_layer_nan_with_a_warning(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    odd = QKWeights(
        torch.randn(12, 24, generator=gen), torch.randn(12, 24, generator=gen), 2, 2, 1.0
    )  # d_k = 6
    fine = QKWeights(
        torch.randn(16, 24, generator=gen), torch.randn(16, 24, generator=gen), 2, 2, 1.0
    )
    eigvals = torch.linalg.eigvals

    def failing_on_d_k_6(batch):
        if batch.shape[-1] == 6:
            raise torch.linalg.LinAlgError("the algorithm failed to converge")
        return eigvals(batch)

    expected = spectrum_of_layers([fine])
    monkeypatch.setattr(torch.linalg, "eigvals", failing_on_d_k_6)
    with pytest.warns(RuntimeWarning, match="layer 1: the algorithm failed to converge"):
        spectra = spectrum_of_layers([fine, odd, fine])
    for name in SPECTRUM_METRICS:
        assert spectra.metrics[name][1].isnan().all() and not spectra.undefined[name][1].any(), name
        for index in (0, 2):
            assert_close(spectra.metrics[name][index], expected.metrics[name][0], rtol=0, atol=0)
    assert spectra.singular_values[1].shape == (2, 6) and spectra.singular_values[1].isnan().all()


# -- how it runs ----------------------------------------------------------------------------------


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op creates (this thread)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and func is not torch.ops.aten.lift_fresh.default:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_layers_are_never_stacked(dtype, monkeypatch):
    """Eight layers of one shape, each over the run limit: no op makes a tensor larger than one
    layer's query weight."""
    monkeypatch.setattr("qkmonitor.measures.layer_spectra._RUN_ELEMENTS", 64 * 48 - 1)
    gen = torch.Generator().manual_seed(10)
    layers = [
        QKWeights(
            torch.randn(64, 48, generator=gen).to(dtype),
            torch.randn(32, 48, generator=gen).to(dtype),
            4,
            2,
            1.0,
        )
        for _ in range(8)
    ]
    with LargestTensor() as spy:
        spectrum_of_layers(layers)
    assert 0 < spy.largest <= 64 * 48  # stacking the query weights alone would make 8 * 64 * 48


def test_small_layers_solved_together_give_the_layer_by_layer_result(monkeypatch):
    """Runs of small layers (up to the run limit, one shape) are one batch of heads; the numbers
    are those of one layer at a time, and a layer of another shape starts a new run."""
    gen = torch.Generator().manual_seed(14)
    shapes = [(64, 48, 32)] * 5 + [(32, 48, 32)] * 2  # (q rows, d, k rows)
    layers = [
        QKWeights(
            torch.randn(q, d, generator=gen),
            torch.randn(k, d, generator=gen),
            q // 16,
            k // 16,
            0.5 + i,
        )
        for i, (q, d, k) in enumerate(shapes)
    ]
    layers[2].w_q[5, 0] = float("nan")  # a broken head in a run breaks only itself
    monkeypatch.setattr("qkmonitor.measures.layer_spectra._RUN_ELEMENTS", 3 * 64 * 48)
    assert [len(run) for run in layer_spectra._runs(layers)] == [3, 2, 2]
    together = spectrum_of_layers(layers)
    monkeypatch.setattr("qkmonitor.measures.layer_spectra._RUN_ELEMENTS", 0)
    assert [len(run) for run in layer_spectra._runs(layers)] == [1] * 7
    alone = spectrum_of_layers(layers)
    for name in SPECTRUM_METRICS:
        for a, b in zip(together.metrics[name], alone.metrics[name]):
            assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)
        assert all(
            torch.equal(a, b) for a, b in zip(together.undefined[name], alone.undefined[name])
        )
    assert (
        together.metrics["kappa"][2].isnan().sum() == 1
        and not together.metrics["kappa"][1].isnan().any()
    )


def test_a_failing_run_of_small_layers_is_solved_layer_by_layer(monkeypatch):
    """An eigen-solver failing in a run of layers: the run is solved again one layer at a time,
    so the warning names the failing layer and only that layer is NaN."""
    gen = torch.Generator().manual_seed(15)
    layers = [
        QKWeights(torch.randn(32, 24, generator=gen), torch.randn(32, 24, generator=gen), 2, 2, 1.0)
        for _ in range(3)
    ]
    bad = layers[1].w_q

    def eigvals(batch, real=torch.linalg.eigvals):
        if batch.shape[0] == 2 * len(layers) or getattr(eigvals, "bad", False):
            eigvals.bad = False
            raise torch.linalg.LinAlgError("did not converge")
        return real(batch)

    def head_spectra(w_q, w_k, *args, real=layer_spectra.qk_head_spectra):
        eigvals.bad = w_q.data_ptr() == bad.data_ptr()
        return real(w_q, w_k, *args)

    monkeypatch.setattr(torch.linalg, "eigvals", eigvals)
    monkeypatch.setattr(layer_spectra, "qk_head_spectra", head_spectra)
    with pytest.warns(RuntimeWarning, match="layer 1: did not converge") as record:
        spectra = spectrum_of_layers(layers)
    assert len(record) == 1
    assert [bool(k.isnan().all()) for k in spectra.metrics["kappa"]] == [False, True, False]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "threads"),
    [(8, 2, 3), (12, 6, 2), (6, 6, 2), (6, 1, 2)],
    ids=["groups-split", "whole-groups", "mha", "mqa"],
)
@pytest.mark.parametrize("square", [True, False], ids=["square", "kdim"])
def test_threaded_runs_of_heads_give_the_single_threaded_result(
    monkeypatch, heads, kv_heads, threads, square
):
    # thread even these small layers
    monkeypatch.setattr("qkmonitor.measures.gram_spectra._THREADED_WORK", 0)
    w_q, w_k = (w.float() for w in make_weights("random", heads, kv_heads, 32, 4, seed=11))
    if not square:
        w_k = w_k[:, :24].contiguous()
    w_q[4 * (heads - 1) :] = float("nan")  # a broken head in the last run
    spy = []
    monkeypatch.setattr(
        "qkmonitor.measures.gram_spectra._spectra_of_heads",
        lambda q, *rest, real=gram_spectra._spectra_of_heads: (
            spy.append(q.shape[0]) or real(q, *rest)
        ),
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = qk_head_spectra(w_q, w_k, heads, kv_heads)
        assert spy == [heads]
        torch.set_num_threads(threads)
        spy.clear()
        threaded = qk_head_spectra(w_q, w_k, heads, kv_heads)
        assert len(spy) == min(2 * threads, heads) and sum(spy) == heads  # two runs per thread
        assert torch.get_num_threads() == threads  # restored
    finally:
        torch.set_num_threads(before)
    assert_close(threaded.singular_values, serial.singular_values, rtol=0, atol=0, equal_nan=True)
    if square:
        assert_close(threaded.eigenvalues, serial.eigenvalues, rtol=0, atol=0, equal_nan=True)
    else:
        assert threaded.eigenvalues is None
    assert (
        threaded.singular_values[-1].isnan().all()
        and not threaded.singular_values[:-1].isnan().any()
    )


def test_a_failing_run_of_heads_restores_the_thread_count(monkeypatch):
    """A solver raising on one worker thread propagates, and torch's thread count is restored."""
    monkeypatch.setattr("qkmonitor.measures.gram_spectra._THREADED_WORK", 0)
    calls = []

    def eigvals(batch, real=torch.linalg.eigvals):
        calls.append(torch.get_num_threads())  # each run computes single-threaded
        if len(calls) == 2:
            raise torch.linalg.LinAlgError("did not converge")
        return real(batch)

    monkeypatch.setattr(torch.linalg, "eigvals", eigvals)
    w_q, w_k = (w.float() for w in make_weights("random", 8, 2, 32, 4, seed=13))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.warns(RuntimeWarning, match="layer 0.*did not converge"):
            spectra = spectrum_of_layers([QKWeights(w_q, w_k, 8, 2, 1.0)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert set(calls) == {1} and len(calls) >= 2
    assert spectra.metrics["kappa"][0].isnan().all()  # the layer is NaN, not half of it


def test_reduced_precision_float32_matmuls_switch_the_products_to_float64():
    """`set_float32_matmul_precision("medium")` may run float32 matmuls in bf16 on CPU (oneDNN)."""
    matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision flags (CPU matmuls are IEEE)")
    w_q, w_k = (w.float() for w in make_weights("random", 2, 2, 16, 4, seed=12))
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # some CPUs warn that they lack bf16
            got = qk_head_spectra(w_q, w_k, 2, 2)
    finally:
        matmul.fp32_precision = before
    assert got.eigenvalues.dtype == torch.complex128
    assert qk_head_spectra(w_q, w_k, 2, 2).eigenvalues.dtype == torch.complex64


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="2-D `w_q` and `w_k`"):
        qk_head_spectra(torch.zeros(2, 8, 8), torch.zeros(2, 8, 8), 1)
    with pytest.raises(ValueError, match="`num_kv_heads`"):
        spectrum_of_layers([QKWeights(torch.zeros(8, 8), torch.zeros(8, 8), 2, 3, 1.0)])
