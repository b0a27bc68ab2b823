"""The covering share the test run takes of a ``covering`` test's parameters (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest

from conftest import _outside_covering_share


def _matrix(*sizes):
    """Every combination of parameters with these numbers of values, as the share sees them."""
    return [(f"item{i}", tuple(enumerate(combo)))
            for i, combo in enumerate(itertools.product(*(range(n) for n in sizes)))]


@pytest.mark.parametrize("sizes, strength", [((3, 3, 2, 3), 2), ((2, 2, 2, 2), 2), ((3, 5), 1), ((4,), 2)])
def test_share_covers_every_combination_of_strength_values(sizes, strength):
    members = _matrix(*sizes)
    skipped = set(_outside_covering_share(members, strength))
    kept = [values for item, values in members if item not in skipped]
    for n in range(1, strength + 1):
        for columns in itertools.combinations(range(len(sizes)), n):
            wanted = set(itertools.product(*(range(sizes[c]) for c in columns)))
            seen = {tuple(values[c][1] for c in columns) for values in kept}
            assert seen == wanted, (columns, wanted - seen)
    if len(sizes) > strength:
        assert len(kept) < len(members)  # a share, not the whole matrix


def test_share_is_deterministic():
    members = _matrix(3, 3, 2)
    assert _outside_covering_share(members, 2) == _outside_covering_share(list(members), 2)
