"""Graph builders, mixing weights, and topology derived from membership."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from topologies import NAMES, TopologyError, build, member_order, mixing_matrix, mixing_row


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("name", NAMES)
def test_every_graph_is_simple_and_connected(name: str, n: int) -> None:
    graph = build(name, n)
    assert graph.number_of_nodes() == n
    assert nx.number_of_selfloops(graph) == 0
    assert nx.is_connected(graph)


def test_degrees() -> None:
    assert {d for _, d in build("ring", 8).degree()} == {2}
    assert {d for _, d in build("complete", 8).degree()} == {7}
    # exponential: i +- 1, 2, 4 (mod 8) -> {1, 2, 4, 6, 7}: degree 5
    assert {d for _, d in build("exponential", 8).degree()} == {5}
    assert sorted(build("exponential", 8).neighbors(0)) == [1, 2, 4, 6, 7]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [2, 5, 8])
def test_metropolis_hastings_is_symmetric_doubly_stochastic(name: str, n: int) -> None:
    weights = mixing_matrix(name, n)
    np.testing.assert_allclose(weights, weights.T)
    np.testing.assert_allclose(weights.sum(axis=0), 1.0)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    assert (weights >= 0).all()


def test_ring_spectrum_matches_closed_form() -> None:
    n = 12
    eigenvalues = np.sort(np.linalg.eigvalsh(mixing_matrix("ring", n)))
    expected = np.sort([1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n) for k in range(n)])
    np.testing.assert_allclose(eigenvalues, expected, atol=1e-12)


def test_complete_graph_averages_in_one_round() -> None:
    np.testing.assert_allclose(mixing_matrix("complete", 6), np.full((6, 6), 1 / 6))


def test_unknown_topology_is_a_clear_error() -> None:
    with pytest.raises(TopologyError, match="unknown topology 'torus2'; choose one of ring"):
        build("torus2", 4)


def test_member_order_is_natural() -> None:
    assert member_order(["node-10", "node-2", "node-1", "b", "a"]) == [
        "a",
        "b",
        "node-1",
        "node-2",
        "node-10",
    ]


def test_every_member_derives_the_same_symmetric_graph() -> None:
    members = {f"node-{i}" for i in range(6)}
    rows = {m: mixing_row("ring", members, m) for m in members}
    for me, row in rows.items():
        assert math.isclose(row.self_weight + sum(row.neighbors.values()), 1.0)
        for other, weight in row.neighbors.items():
            assert rows[other].neighbors[me] == weight
    assert set(rows["node-0"].neighbors) == {"node-1", "node-5"}


def test_membership_change_changes_the_graph() -> None:
    before = mixing_row("ring", {f"n{i}" for i in range(5)}, "n0")
    after = mixing_row("ring", {f"n{i}" for i in range(5)} - {"n4"}, "n0")
    assert set(before.neighbors) == {"n1", "n4"}
    assert set(after.neighbors) == {"n1", "n3"}
