"""``tools/gpu/tail_model.py`` (docs/benchmarks.md, nineteenth session): the persistent programs'
static snake assignment and ``_tiles.section_order`` (the grid's L2-section item order) against
hand-counted schedules, and where a static snake assignment ends later than the hardware's
first-free-SM order."""

from __future__ import annotations

import pytest
from conftest import load_tool

from cpattn.kernels import _tiles


@pytest.fixture(scope="module")
def tail():
    return load_tool("tools/gpu/tail_model.py")


def test_snake_makespan_alternates_direction(tail):
    # 2 programs, rounds [5, 4] then [3, 1] taken right to left: program 0 gets 5 + 1, program 1 4 + 3
    assert tail.snake_makespan([5.0, 4.0, 3.0, 1.0], 2) == 7.0
    # one round: the largest item; fewer items than programs leave programs idle
    assert tail.snake_makespan([2.0, 9.0, 1.0], 4) == 9.0


def test_section_order_repeats_tiles_per_head_group():
    assert _tiles.section_order([3.0, 1.0], 3, 2) == [3.0, 3.0, 1.0, 1.0, 3.0, 1.0]
    assert _tiles.section_order([3.0, 1.0], 2, 2) == [3.0, 3.0, 1.0, 1.0]


def test_snake_is_static_where_the_grid_order_is_greedy(tail):
    # 3 programs, items heaviest first. The grid order gives each item to the first program to
    # free up: 4 + 3, 4 + 1 + 1, 4 + 1 + 1 -> 7. The snake fixes the assignment by position: round
    # 1 (right to left) gives the 3 to program 2, round 2 (left to right) gives it one more -> 8.
    items = [4.0, 4.0, 4.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert _tiles._list_makespan(items, 3) == 7.0
    assert tail.snake_makespan(items, 3) == 8.0
