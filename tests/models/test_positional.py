"""Positional encodings: defining properties, checked against float64 rotation matrices and the
papers' formulas written out here (never against the code under test)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qkmonitor.models.additive_positions import (
    LearnedPositionalEmbedding,
    PositionalEncoding,
    sinusoidal_encoding,
)
from qkmonitor.models.axial_rope import NDimensionalRoPE, grid_coords
from qkmonitor.models.rope import (
    RopeScaling,
    RotaryEmbedding,
    apply_rotary_pos_emb,
    rope_attention_factor,
    rope_inv_freq,
)

SCALINGS = [
    None,
    RopeScaling("linear", 4.0),
    RopeScaling("ntk", 4.0),
    RopeScaling("yarn", 4.0, original_max_len=16),
]
SCALING_IDS = ["none", "linear", "ntk", "yarn"]


# ----------------------------------------------------------------------------- references


def _ref_theta(head_dim: int, base: float) -> list[float]:
    return [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]


def _ref_rotation_matrix(angles: list[float], interleaved: bool) -> torch.Tensor:
    """Block rotation acting on pairs (i, i + D/2) or (2i, 2i + 1), float64."""
    half = len(angles)
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i, phi in enumerate(angles):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        r[a, a], r[a, b] = math.cos(phi), -math.sin(phi)
        r[b, a], r[b, b] = math.sin(phi), math.cos(phi)
    return r


def _ref_rotate(
    x: torch.Tensor, position: float, theta: list[float], interleaved: bool
) -> torch.Tensor:
    """Rotate the vectors x (..., D) by R(position) as an explicit matrix product."""
    r = _ref_rotation_matrix([position * t for t in theta], interleaved)
    return x.double() @ r.T


def _half_to_interleaved(head_dim: int) -> list[int]:
    """Index map: interleaved dim 2i holds half-split dim i, dim 2i+1 holds dim i + D/2."""
    half = head_dim // 2
    return [j for i in range(half) for j in (i, i + half)]


# ----------------------------------------------------------------------------- sinusoidal


def test_sinusoidal_matches_vaswani_formula():
    table = sinusoidal_encoding(50, 10, base=100.0, dtype=torch.float64)
    ref = torch.tensor(
        [
            [
                (math.sin if c % 2 == 0 else math.cos)(t / 100.0 ** ((c - c % 2) / 10))
                for c in range(10)
            ]
            for t in range(50)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(table, ref, rtol=0, atol=1e-12)


def test_sinusoidal_odd_dim_truncates_the_last_cosine():
    table = sinusoidal_encoding(20, 7, dtype=torch.float64)
    assert table.shape == (20, 7)
    ref = [
        [
            (math.sin if c % 2 == 0 else math.cos)(t / 10_000.0 ** ((c - c % 2) / 7))
            for c in range(7)
        ]
        for t in range(20)
    ]
    torch.testing.assert_close(table, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)


def test_sinusoidal_bounded_and_distinct():
    table = sinusoidal_encoding(512, 64)
    assert table.dtype == torch.float32
    assert table.abs().max() <= 1.0
    dist = torch.cdist(table.double(), table.double())
    off_diagonal = dist[~torch.eye(512, dtype=torch.bool)]
    assert off_diagonal.min() > 1e-3


def test_sinusoidal_shift_is_a_fixed_rotation_per_pair():
    dim, k = 16, 7
    table = sinusoidal_encoding(200, dim, dtype=torch.float64)
    for i in range(dim // 2):
        w = 10_000.0 ** (-2 * i / dim)
        # [sin(x + kw), cos(x + kw)] = M [sin x, cos x], the same M for every position t
        m = torch.tensor(
            [[math.cos(k * w), math.sin(k * w)], [-math.sin(k * w), math.cos(k * w)]],
            dtype=torch.float64,
        )
        pair = table[:, 2 * i : 2 * i + 2]  # (T, 2)
        torch.testing.assert_close(pair[k:], pair[:-k] @ m.T, rtol=0, atol=1e-10)


def test_positional_encoding_adds_table_non_persistent():
    pe = PositionalEncoding(dim=12, max_len=30)
    x = torch.randn(3, 9, 12)
    torch.testing.assert_close(
        pe(x) - x, sinusoidal_encoding(9, 12).expand(3, 9, 12), rtol=0, atol=1e-6
    )
    assert pe.state_dict() == {}
    assert pe(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exceeds `max_len` 30"):
        pe(torch.zeros(1, 31, 12))
    with pytest.raises(ValueError, match=r"Expected `x` of shape \(\.\.\., N, 12\)"):
        pe(torch.zeros(1, 5, 11))


def test_learned_embedding_adds_trained_rows():
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(max_len=16, dim=8)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(
        emb(x) - x, emb.weight[:5].detach().expand(2, 5, 8), rtol=0, atol=1e-6
    )
    emb(x).sum().backward()
    assert emb.weight.grad[:5].abs().sum() > 0 and emb.weight.grad[5:].abs().sum() == 0
    assert set(emb.state_dict()) == {"weight"}
    with pytest.raises(ValueError, match="Sequence length 17 exceeds `max_len` 16"):
        emb(torch.zeros(1, 17, 8))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sinusoidal_encoding(0, 4), "`num_positions`"),
        (lambda: sinusoidal_encoding(4, 0), "`dim`"),
        (lambda: sinusoidal_encoding(4, 4, base=1.0), "`base`"),
        (lambda: LearnedPositionalEmbedding(0, 4), "`max_len`"),
    ],
)
def test_additive_encoding_argument_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- apply_rotary_pos_emb


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_equals_rotation_matrix(interleaved):
    torch.manual_seed(0)
    d, n = 8, 6
    x = torch.randn(2, 3, n, d, dtype=torch.float64)
    theta = _ref_theta(d, 10_000.0)
    angles = torch.tensor(
        [[t * th for th in theta] for t in range(n)], dtype=torch.float64
    )  # (N, D/2)
    out = apply_rotary_pos_emb(x, angles.cos(), angles.sin(), interleaved=interleaved)
    ref = torch.stack([_ref_rotate(x[..., t, :], t, theta, interleaved) for t in range(n)], dim=-2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_half_split_and_interleaved_agree_under_permutation():
    torch.manual_seed(1)
    d = 12
    perm = _half_to_interleaved(d)
    x = torch.randn(2, 4, 10, d, dtype=torch.float64)
    angles = torch.rand(10, d // 2, dtype=torch.float64) * 20
    half = apply_rotary_pos_emb(x, angles.cos(), angles.sin())
    inter = apply_rotary_pos_emb(x[..., perm], angles.cos(), angles.sin(), interleaved=True)
    torch.testing.assert_close(inter, half[..., perm], rtol=0, atol=1e-12)


def test_apply_rotary_computes_in_input_dtype_and_checks_shapes():
    x = torch.randn(1, 4, 8, dtype=torch.float16)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
    assert apply_rotary_pos_emb(x, cos, sin).dtype == torch.float16
    torch.testing.assert_close(apply_rotary_pos_emb(x, cos, sin), x)
    with pytest.raises(ValueError, match="last dim of `x` to be even"):
        apply_rotary_pos_emb(torch.zeros(4, 7), cos, sin)
    with pytest.raises(ValueError, match="`cos` and `sin`"):
        apply_rotary_pos_emb(x, torch.ones(4, 3), torch.zeros(4, 3))


# ----------------------------------------------------------------------------- RotaryEmbedding


def _score_matrix(
    rope: RotaryEmbedding, q_vec: torch.Tensor, k_vec: torch.Tensor, n: int
) -> torch.Tensor:
    """S[s, t] = <R_s q, R_t k> for positions 0..n-1 (float64 vectors)."""
    q = q_vec.expand(1, 1, n, -1)
    k = k_vec.expand(1, 1, n, -1)
    q_rot, k_rot = rope(q, k)
    return (q_rot @ k_rot.transpose(-1, -2))[0, 0]


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_offset(interleaved, scaling):
    torch.manual_seed(2)
    n, d = 48, 16
    rope = RotaryEmbedding(d, max_seq_len=n, interleaved=interleaved, scaling=scaling)
    q_vec, k_vec = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    s = _score_matrix(rope, q_vec, k_vec, n)
    for delta in (1, 5, 17):  # <R_s q, R_t k> == <R_{s+Δ} q, R_{t+Δ} k>
        torch.testing.assert_close(s[delta:, delta:], s[:-delta, :-delta], rtol=0, atol=1e-5)
    assert not torch.allclose(
        s[0, 1:], s[0, :1].expand(n - 1), atol=1e-3
    )  # but it does depend on the offset


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_equals_rotation_matrix_at_each_position(interleaved):
    torch.manual_seed(3)
    d, n = 8, 20
    rope = RotaryEmbedding(d, max_seq_len=n, base=500.0, interleaved=interleaved)
    q, k = (
        torch.randn(2, 3, n, d, dtype=torch.float64),
        torch.randn(2, 1, n, d, dtype=torch.float64),
    )
    q_rot, k_rot = rope(q, k)
    theta = _ref_theta(d, 500.0)
    for t in (0, 1, 7, n - 1):
        torch.testing.assert_close(
            q_rot[..., t, :], _ref_rotate(q[..., t, :], t, theta, interleaved), rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            k_rot[..., t, :], _ref_rotate(k[..., t, :], t, theta, interleaved), rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_rope_preserves_norms_and_position_zero_is_identity(scaling):
    torch.manual_seed(4)
    rope = RotaryEmbedding(16, max_seq_len=32, scaling=scaling)
    q, k = (
        torch.randn(2, 4, 32, 16, dtype=torch.float64),
        torch.randn(2, 2, 32, 16, dtype=torch.float64),
    )
    q_rot, k_rot = rope(q, k)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(k_rot.norm(dim=-1), k.norm(dim=-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(q_rot[..., 0, :], q[..., 0, :], rtol=0, atol=0)


def test_rope_right_aligns_queries_when_decoding_with_a_cache():
    torch.manual_seed(5)
    rope = RotaryEmbedding(8, max_seq_len=16)
    q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    q_full, k_full = rope(q, k)
    q_last, k_same = rope(q[..., -3:, :], k)  # 3 new queries at positions 7, 8, 9
    torch.testing.assert_close(q_last, q_full[..., -3:, :], rtol=0, atol=0)
    torch.testing.assert_close(k_same, k_full, rtol=0, atol=0)


def test_rope_explicit_positions_shared_and_per_sequence():
    torch.manual_seed(6)
    d = 8
    rope = RotaryEmbedding(d, max_seq_len=64, interleaved=True)
    q, k = (
        torch.randn(2, 3, 4, d, dtype=torch.float64),
        torch.randn(2, 1, 4, d, dtype=torch.float64),
    )
    theta = _ref_theta(d, 10_000.0)
    pos = torch.tensor([5, 0, 63, 9])
    q_rot, k_rot = rope(q, k, positions=pos)
    for j, p in enumerate(pos.tolist()):
        torch.testing.assert_close(
            q_rot[..., j, :], _ref_rotate(q[..., j, :], p, theta, True), rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            k_rot[..., j, :], _ref_rotate(k[..., j, :], p, theta, True), rtol=0, atol=1e-6
        )
    per_seq = torch.tensor([[5, 0, 63, 9], [1, 2, 3, 4]])
    q_rot2, _ = rope(q, k, positions=per_seq)
    torch.testing.assert_close(q_rot2[0], q_rot[0], rtol=0, atol=0)
    torch.testing.assert_close(
        q_rot2[1, :, 2, :], _ref_rotate(q[1, :, 2, :], 3, theta, True), rtol=0, atol=1e-6
    )


def test_rope_buffers_and_attention_factor():
    rope = RotaryEmbedding(8, max_seq_len=10, scaling=RopeScaling("yarn", 8.0, original_max_len=4))
    assert rope.state_dict() == {}
    assert rope.cos.dtype == torch.float32 and rope.cos.shape == (10, 4)
    assert rope.attention_factor == pytest.approx((0.1 * math.log(8.0) + 1) ** 2)
    assert RotaryEmbedding(8, 10).attention_factor == 1.0
    q = torch.randn(1, 1, 10, 8, dtype=torch.bfloat16)
    assert rope(q, q)[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: RotaryEmbedding(7, 16), "`head_dim` to be even"),
        (lambda: RotaryEmbedding(8, 0), "`max_seq_len`"),
        (lambda: RotaryEmbedding(8, 16, base=0.5), "`base`"),
        (
            lambda: RotaryEmbedding(8, 4)(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8)),
            "exceeds `max_seq_len` 4",
        ),
        (
            lambda: RotaryEmbedding(8, 8)(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 4, 8)),
            "Query length 5 exceeds key",
        ),
        (
            lambda: RotaryEmbedding(8, 8)(torch.zeros(1, 1, 2, 6), torch.zeros(1, 1, 2, 6)),
            r"`q` of shape \(\.\.\., N, 8\)",
        ),
        (
            lambda: RotaryEmbedding(8, 8)(
                torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), positions=torch.tensor([0, 8])
            ),
            r"`positions` in \[0, 8\)",
        ),
        (
            lambda: RotaryEmbedding(8, 8)(
                torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), positions=torch.tensor([0.0, 1])
            ),
            "integer tensor",
        ),
        (
            lambda: RotaryEmbedding(8, 8)(
                torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 3, 8), positions=torch.tensor([0, 1])
            ),
            "lengths must match",
        ),
        (lambda: RopeScaling("dynamic", 2.0), "`kind` to be one of"),
        (lambda: RopeScaling("linear", 1.0), "`factor` to be a finite number > 1"),
        (lambda: RopeScaling("linear", float("inf")), "`factor`"),
        (lambda: RopeScaling("yarn", 2.0), "`original_max_len`"),
        (
            lambda: RopeScaling("yarn", 2.0, original_max_len=64, beta_fast=1.0, beta_slow=2.0),
            "`beta_fast` > `beta_slow`",
        ),
        (lambda: RopeScaling("yarn", 2.0, original_max_len=64, beta_slow=0.0), "`beta_slow`"),
        (lambda: rope_inv_freq(2, scaling=RopeScaling("ntk", 2.0)), "`head_dim` >= 4"),
        (lambda: rope_inv_freq(8, scaling="linear"), "`scaling` to be a RopeScaling"),
    ],
)
def test_rope_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ frequencies and scaling


def test_inv_freq_unscaled_and_linear():
    d, base, s = 32, 10_000.0, 3.0
    theta = torch.tensor(_ref_theta(d, base), dtype=torch.float64)
    got = rope_inv_freq(d, base)
    assert got.dtype == torch.float64 and got.shape == (d // 2,)
    torch.testing.assert_close(got, theta, rtol=1e-14, atol=0)
    torch.testing.assert_close(
        rope_inv_freq(d, base, RopeScaling("linear", s)), theta / s, rtol=1e-14, atol=0
    )


def test_inv_freq_ntk_base_formula_and_interpolated_longest_wavelength():
    d, base, s = 64, 10_000.0, 8.0
    got = rope_inv_freq(d, base, RopeScaling("ntk", s))
    new_base = base * s ** (d / (d - 2))
    torch.testing.assert_close(
        got, torch.tensor(_ref_theta(d, new_base), dtype=torch.float64), rtol=1e-12, atol=0
    )
    theta = _ref_theta(d, base)
    assert got[-1].item() == pytest.approx(
        theta[-1] / s, rel=1e-12
    )  # the longest wavelength is stretched by s
    assert got[0].item() == pytest.approx(theta[0], rel=1e-12)  # the shortest is kept
    ratio = got / torch.tensor(theta, dtype=torch.float64)
    assert torch.all(ratio[1:] < ratio[:-1])  # interpolation grows smoothly toward low frequencies


def test_inv_freq_yarn_matches_paper_ramp():
    d, base, s, length = 64, 10_000.0, 4.0, 2048
    scaling = RopeScaling("yarn", s, original_max_len=length, beta_fast=32.0, beta_slow=1.0)
    got = rope_inv_freq(d, base, scaling)
    theta = _ref_theta(d, base)
    regimes = {"kept": 0, "interpolated": 0, "ramp": 0}
    for i, th in enumerate(theta):
        turns = length / (2 * math.pi / th)  # r = L / λ
        if turns >= 32.0:
            gamma, regimes["kept"] = 1.0, regimes["kept"] + 1
        elif turns <= 1.0:
            gamma, regimes["interpolated"] = 0.0, regimes["interpolated"] + 1
        else:
            gamma, regimes["ramp"] = (turns - 1.0) / 31.0, regimes["ramp"] + 1
        expected = (1 - gamma) * th / s + gamma * th
        assert got[i].item() == pytest.approx(expected, rel=1e-12), i
    assert min(regimes.values()) >= 3, regimes  # the test covers all three regimes
    ratio = got / torch.tensor(theta, dtype=torch.float64)
    assert torch.all(ratio[1:] <= ratio[:-1]) and ratio.max() == 1.0
    assert ratio.min().item() == pytest.approx(1 / s)


def test_attention_factor_formula():
    for s in (1.5, 4.0, 32.0):
        assert rope_attention_factor(RopeScaling("yarn", s, original_max_len=8)) == pytest.approx(
            (1 + 0.1 * math.log(s)) ** 2
        )
        assert rope_attention_factor(RopeScaling("linear", s)) == 1.0
        assert rope_attention_factor(RopeScaling("ntk", s)) == 1.0
    assert rope_attention_factor(None) == 1.0


# ----------------------------------------------------------------------------- N-D RoPE


def test_grid_coords_row_major():
    coords = grid_coords(2, 3, 4)
    assert coords.dtype == torch.long
    assert coords.tolist() == [list(c) for c in itertools.product(range(2), range(3), range(4))]
    with pytest.raises(ValueError, match="`sizes`"):
        grid_coords(2, 0)
    with pytest.raises(ValueError, match="at least one"):
        grid_coords()


def _nd_scores(
    rope: NDimensionalRoPE, q: torch.Tensor, k: torch.Tensor, coords: torch.Tensor
) -> torch.Tensor:
    q_rot, k_rot = rope(q, k, coords)
    return q_rot @ k_rot.transpose(-1, -2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("grid", "head_dim"), [((3, 4), 16), ((2, 3, 3), 24)])
def test_nd_rope_scores_invariant_to_shifting_one_axis(grid, head_dim, interleaved):
    torch.manual_seed(7)
    rope = NDimensionalRoPE(
        head_dim, axes_max_len=tuple(g + 5 for g in grid), interleaved=interleaved
    )
    coords = grid_coords(*grid)
    n = coords.shape[0]
    q, k = (
        torch.randn(1, 2, n, head_dim, dtype=torch.float64),
        torch.randn(1, 2, n, head_dim, dtype=torch.float64),
    )
    base_scores = _nd_scores(rope, q, k, coords)
    for axis in range(len(grid)):
        shifted = coords.clone()
        shifted[:, axis] += 5
        torch.testing.assert_close(_nd_scores(rope, q, k, shifted), base_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_nd_rope_equals_per_axis_rotation_matrices(interleaved):
    torch.manual_seed(8)
    head_dim, grid = 12, (2, 3, 4)
    d_a = head_dim // 3
    rope = NDimensionalRoPE(head_dim, axes_max_len=grid, base=100.0, interleaved=interleaved)
    coords = grid_coords(*grid)
    x = torch.randn(1, 1, coords.shape[0], head_dim, dtype=torch.float64)
    out, _ = rope(x, x, coords)
    theta = _ref_theta(d_a, 100.0)  # base^{-2i/d_a}, per axis
    for r, c in enumerate(coords.tolist()):
        for a in range(3):
            sl = slice(a * d_a, (a + 1) * d_a)
            ref = _ref_rotate(x[0, 0, r, sl], c[a], theta, interleaved)
            torch.testing.assert_close(out[0, 0, r, sl], ref, rtol=0, atol=1e-6)


def test_nd_rope_score_along_one_axis_is_1d_rope_on_its_slice():
    torch.manual_seed(9)
    head_dim, n_axes = 24, 3
    d_a = head_dim // n_axes
    rope = NDimensionalRoPE(head_dim, axes_max_len=(10, 10, 10))
    rope_1d = RotaryEmbedding(d_a, max_seq_len=10)
    q_vec, k_vec = (
        torch.randn(head_dim, dtype=torch.float64),
        torch.randn(head_dim, dtype=torch.float64),
    )
    c1 = [2, 5, 7]
    for axis in range(n_axes):
        c2 = list(c1)
        c2[axis] = 9
        coords = torch.tensor([c1, c2])
        q_rot, _ = rope(q_vec.expand(1, 1, 2, head_dim), q_vec.expand(1, 1, 2, head_dim), coords)
        _, k_rot = rope(k_vec.expand(1, 1, 2, head_dim), k_vec.expand(1, 1, 2, head_dim), coords)
        score = (q_rot[0, 0, 0] * k_rot[0, 0, 1]).sum()
        sl = slice(axis * d_a, (axis + 1) * d_a)
        pos = torch.tensor([c1[axis], c2[axis]])
        q1, k1 = rope_1d(
            q_vec[sl].expand(1, 1, 2, d_a), k_vec[sl].expand(1, 1, 2, d_a), positions=pos
        )
        other = sum(
            (q_vec[b * d_a : (b + 1) * d_a] * k_vec[b * d_a : (b + 1) * d_a]).sum()
            for b in range(n_axes)
            if b != axis
        )
        torch.testing.assert_close(
            score, (q1[0, 0, 0] * k1[0, 0, 1]).sum() + other, rtol=0, atol=1e-5
        )


def test_nd_rope_non_persistent_and_dtype():
    rope = NDimensionalRoPE(8, axes_max_len=(4, 4))
    assert rope.state_dict() == {}
    x = torch.randn(1, 1, 16, 8, dtype=torch.bfloat16)
    assert rope(x, x, grid_coords(4, 4))[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: NDimensionalRoPE(10, (4, 4, 4)), r"`head_dim` \(10\) to split into 3 axes"),
        (lambda: NDimensionalRoPE(6, (4, 4)), r"`head_dim` \(6\) to split into 2 axes"),
        (lambda: NDimensionalRoPE(8, ()), "`axes_max_len`"),
        (lambda: NDimensionalRoPE(8, (4, 0)), "`axes_max_len`"),
        (
            lambda: NDimensionalRoPE(8, (2, 2))(
                torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), grid_coords(2, 3)
            ),
            "`coords` of shape",
        ),
        (
            lambda: NDimensionalRoPE(8, (2, 2))(
                torch.zeros(1, 1, 6, 8), torch.zeros(1, 1, 6, 8), grid_coords(2, 3)
            ),
            r"`coords\[:, a\]`",
        ),
        (
            lambda: NDimensionalRoPE(8, (2, 2))(
                torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), grid_coords(2, 2).float()
            ),
            "integer",
        ),
    ],
)
def test_nd_rope_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
