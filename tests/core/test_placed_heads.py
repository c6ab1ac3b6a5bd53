"""Where one rank's attention call's heads are among the layer's under tensor parallelism, checked
against its query projection (qkmonitor.attention.layouts.placed_heads, issue 59): this rank's
part of the heads is kept, every head on every rank is measured whole, and anything else is
refused by name. The two gloo ranks' values are tests/distributed/test_tensor_parallel_heads.py's.
"""

from __future__ import annotations

import pytest

from qkmonitor.attention.layouts import placed_heads
from qkmonitor.measures.sharding import HeadPlacement

#: 4 query heads of 8 features (32 rows) split over 2 ranks: rank 1 holds heads 2 and 3
ROWS, D = 32, 8
RANK_1 = HeadPlacement(2, 2, 4)
#: what the capture says of a rank-1 call of 4 heads: heads 4..7 of 8
ALL_ON_RANK_1 = HeadPlacement(4, 4, 8)


@pytest.mark.parametrize("named", [False, True])
def test_this_ranks_heads_keep_their_place(named):
    heads, head_dim = (4, D) if named else (None, None)
    got = placed_heads(RANK_1, call_head_dim=D, rows=ROWS, heads=heads, head_dim=head_dim)
    assert got == RANK_1


@pytest.mark.parametrize("named", [False, True])
def test_every_head_on_every_rank_is_measured_whole(named):
    # ColwiseParallel(output_layouts=Replicate()): the call holds all 4 heads of 8 on each rank
    heads, head_dim = (4, D) if named else (None, None)
    got = placed_heads(ALL_ON_RANK_1, call_head_dim=D, rows=ROWS, heads=heads, head_dim=head_dim)
    assert got is None


def test_a_view_of_this_ranks_rows_by_the_global_head_count_is_refused():
    # view(b, t, num_heads, -1) of this rank's 16 rows: 4 "heads" of 4
    why = placed_heads(ALL_ON_RANK_1, call_head_dim=4, rows=ROWS, heads=4, head_dim=D)
    assert isinstance(why, str)
    assert "4 query heads on this rank hold 4 features each" in why
    assert "projections' 4 heads hold 8" in why


def test_local_head_counts_on_the_module_are_refused():
    # torchtitan's way: num_heads set to this rank's 2, the weights' 32 rows read as 2 heads of 16
    why = placed_heads(RANK_1, call_head_dim=D, rows=ROWS, heads=2, head_dim=16)
    assert isinstance(why, str)


def test_heads_that_are_neither_part_nor_all_are_refused():
    why = placed_heads(HeadPlacement(3, 3, 6), call_head_dim=D, rows=ROWS)
    assert isinstance(why, str)
    assert "neither this rank's part of its 4 heads nor all of them" in why


def test_explicit_logits_of_every_head_are_refused_where_nothing_tells_them_apart():
    # no queries, so no head dim: all 4 heads, or a module whose num_heads is this rank's part
    assert isinstance(placed_heads(ALL_ON_RANK_1, call_head_dim=None, rows=ROWS, heads=4), str)
    assert placed_heads(RANK_1, call_head_dim=None, rows=ROWS, heads=4) == RANK_1


def test_without_the_head_count_a_consistent_split_is_kept():
    # 4 heads of 4 on each rank, 8 heads of 4 in all: what a split model of 8 heads of 4 computes
    # too; nothing on one rank tells them apart (a module that names its heads is refused above)
    assert placed_heads(ALL_ON_RANK_1, call_head_dim=4, rows=ROWS) == ALL_ON_RANK_1
