"""group_by_length: a partition of the sequences, optimal under its cost model, waste bounded."""
from __future__ import annotations


from hypothesis import given, settings
from hypothesis import strategies as st

from devin_compile.backends.attention.length_groups import group_by_length


def _cost(groups, lengths, call_cost):
    return sum(call_cost + len(g) * max(lengths[i] for i in g) for g in groups)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2000), min_size=0, max_size=40), st.integers(0, 500))
def test_partition_and_never_worse_than_one_batch_or_singletons(lengths, call_cost):
    res = group_by_length(lengths, call_cost)
    flat = sorted(i for g in res.groups for i in g)
    assert flat == list(range(len(lengths)))
    if lengths:
        cost = _cost(res.groups, lengths, call_cost)
        assert cost <= _cost([list(range(len(lengths)))], lengths, call_cost)
        assert cost <= _cost([[i] for i in range(len(lengths))], lengths, call_cost)
        assert res.real_tokens == sum(lengths)
        assert res.padded_tokens == sum(len(g) * max(lengths[i] for i in g) for g in res.groups)
        assert 0.0 <= res.waste < 1.0 or res.padded_tokens == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=7), st.integers(0, 200))
def test_optimal_among_sorted_contiguous_cuts(lengths, call_cost):
    """Brute force over every cut of the sorted order: the DP finds the cheapest."""
    res = group_by_length(lengths, call_cost)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = None
    n = len(order)
    for mask in range(2 ** (n - 1)):
        groups, cur = [], [order[0]]
        for j in range(1, n):
            if mask >> (j - 1) & 1:
                groups.append(cur)
                cur = []
            cur.append(order[j])
        groups.append(cur)
        c = _cost(groups, lengths, call_cost)
        best = c if best is None else min(best, c)
    assert _cost(res.groups, lengths, call_cost) == best


@given(st.lists(st.integers(1, 2000), min_size=1, max_size=30), st.sampled_from([0.0, 0.1, 0.25, 0.5]))
def test_max_waste_bounds_every_group(lengths, max_waste):
    res = group_by_length(lengths, call_cost=10_000, max_waste=max_waste)  # huge call cost: wants one group
    for g in res.groups:
        real = sum(lengths[i] for i in g)
        padded = len(g) * max(lengths[i] for i in g)
        assert 1 - real / padded <= max_waste + 1e-9


def test_spread_lengths_split_equal_lengths_do_not():
    assert len(group_by_length([1000, 1000, 1000, 20, 20, 20]).groups) == 2
    assert len(group_by_length([64] * 50).groups) == 1
