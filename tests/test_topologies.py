"""The topology library: builders, weights, schedules, analysis, names, topology from membership."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from topologies import (
    FAMILIES,
    SCHEMES,
    SpecError,
    Topology,
    TopologyError,
    active_passive,
    analyze,
    check_column_stochastic,
    check_doubly_stochastic,
    member_order,
    mixing_row,
    pairwise_partner,
    second_eigenvalue_modulus,
)

NAMED = [name for name in FAMILIES if name != "file"]
SIZES = [1, 2, 3, 4, 5, 7, 8, 12, 16, 32]


def defined(name: str, n: int) -> bool:
    """Where each family exists with its default parameters."""
    return {
        "hypercube": n & (n - 1) == 0,
        "random-regular": n >= 4 and n % 2 == 0,  # degree 3: n * 3 even, 3 < n
        "small-world": n >= 5,  # k = 4 < n
    }.get(name, True)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", NAMED)
def test_every_builder_gives_a_simple_connected_graph_or_says_why(name: str, n: int) -> None:
    topology = Topology.parse(name)
    if not defined(name, n):
        with pytest.raises(TopologyError):
            topology.graph(n)
        return
    for round in range(3):
        graph = topology.graph(n, round)
        assert graph.number_of_nodes() == n and sorted(graph) == list(range(n))
        assert nx.number_of_selfloops(graph) == 0
        assert graph.is_directed() == FAMILIES[name].directed
        if not FAMILIES[name].time_varying and n > 1:
            connected = nx.is_strongly_connected if graph.is_directed() else nx.is_connected
            assert connected(graph)


@pytest.mark.parametrize(
    ("name", "n", "degrees"),
    [
        ("ring", 8, {2}),
        ("torus", 16, {4}),
        ("exponential", 8, {5}),  # i +- 1, 2, 4 (mod 8) = {1, 2, 4, 6, 7}
        ("hypercube", 16, {4}),
        ("complete", 8, {7}),
        ("star", 8, {1, 7}),
        ("random-regular:degree=4", 10, {4}),
        ("expander:degree=6", 20, {6}),
        ("small-world:k=6,p=0", 10, {6}),  # no rewiring: the ring lattice
        ("random-matching", 8, {1}),
        ("random-matching", 7, {0, 1}),
    ],
)
def test_degrees(name: str, n: int, degrees: set[int]) -> None:
    assert {d for _, d in Topology.parse(name).graph(n).degree} == degrees


def test_directed_graphs() -> None:
    graph = Topology.parse("directed-exponential").graph(8)
    assert sorted(graph.successors(0)) == [1, 2, 4] and sorted(graph.predecessors(0)) == [4, 6, 7]
    one_peer = Topology.parse("one-peer-exponential")
    assert [list(one_peer.graph(8, r).successors(3)) for r in range(4)] == [[4], [5], [7], [4]]
    assert one_peer.period(8) == 3 and one_peer.period(9) == 4


def test_erdos_renyi_is_seeded_and_connected() -> None:
    a, b = (Topology.parse("erdos-renyi:p=0.1,seed=3").graph(40) for _ in range(2))
    assert nx.utils.graphs_equal(a, b) and nx.is_connected(a)
    assert not nx.utils.graphs_equal(a, Topology.parse("erdos-renyi:p=0.1,seed=4").graph(40))
    sparse = Topology.parse("erdos-renyi:p=0.01").graph(30)  # almost never connected: repaired
    assert nx.is_connected(sparse)


def test_random_matching_is_the_same_for_everyone_and_changes_per_round() -> None:
    topology = Topology.parse("random-matching:seed=9")
    edges = [sorted(map(sorted, topology.graph(10, r).edges)) for r in range(5)]
    assert edges[0] == sorted(map(sorted, Topology.parse("random-matching:seed=9").graph(10, 0).edges))
    assert len({str(e) for e in edges}) == 5


@pytest.mark.parametrize(
    ("spec", "n", "message"),
    [
        ("hypercube", 12, "hypercube needs a power-of-two number of nodes, got 12; use 8 or 16"),
        ("random-regular:degree=3", 7, "a 3-regular graph on 7 nodes does not exist (n * degree is odd)"),
        ("random-regular:degree=8", 8, "degree must be in 1..n-1 (n = 8), got 8"),
        ("small-world:k=4", 4, "k must be in 2..n-1 (n = 4), got 4"),
        ("torus:rows=5", 12, "5 rows do not divide 12 nodes"),
        ("expander:degree=3", 12, "degree must be an even number >= 2, got 3"),
    ],
)
def test_undefined_graphs_say_why(spec: str, n: int, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        Topology.parse(spec).graph(n)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("donut", "unknown topology 'donut'; choose one of ring, torus,"),
        ("ring:degree=3", "ring: unknown parameter 'degree'; it takes: weights"),
        ("random-regular:degree=x", "random-regular: degree: 'x' is not a whole number"),
        ("ring:weights=magic", "ring: weights: choose one of metropolis-hastings, max-degree, uniform"),
        ("file:", "file: needs path, as in file:PATH"),
        ("directed-exponential:weights=uniform", "unknown parameter 'weights'; it takes: none"),
        ("erdos-renyi:p=2", "erdos-renyi: p: must be in [0, 1], got 2.0"),
    ],
)
def test_bad_names_and_parameters(spec: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        Topology.parse(spec)


def test_names_round_trip() -> None:
    for spec in [
        "ring",
        "random-regular:degree=4,seed=2",
        "file:/tmp/g.json",
        "torus:rows=2,weights=max-degree",
    ]:
        assert str(Topology.parse(spec)) == spec


@pytest.mark.parametrize("n", [2, 5, 8, 16])
@pytest.mark.parametrize("name", NAMED)
def test_every_weight_matrix_is_stochastic(name: str, n: int) -> None:
    topology = Topology.parse(name)
    if not defined(name, n):
        return
    for round in range(4):
        weights = topology.weights(n, round)
        if FAMILIES[name].directed:
            check_column_stochastic(weights)  # push-sum
            check_doubly_stochastic(weights, symmetric=False)  # and, on these regular digraphs, rows too
        else:
            check_doubly_stochastic(weights)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_schemes(scheme: str) -> None:
    weights = Topology.parse(f"torus:weights={scheme}").weights(12)
    check_doubly_stochastic(weights)
    if scheme != "metropolis-hastings":  # on a 4-regular graph every scheme gives 1/5
        np.testing.assert_allclose(weights[weights > 0], 0.2)
    star = Topology.parse("star:weights=max-degree").weights(5)
    np.testing.assert_allclose(star[0], [0.2] * 5)  # hub keeps 1 - 4/5
    np.testing.assert_allclose(star[1], [0.2, 0.8, 0, 0, 0])
    with pytest.raises(TopologyError, match="uniform weights need a regular graph"):
        Topology.parse("star:weights=uniform").weights(5)


def test_stochasticity_checks_catch_bad_matrices() -> None:
    with pytest.raises(ValueError, match="symmetric"):
        check_doubly_stochastic(np.array([[0.5, 0.5, 0], [0, 0.5, 0.5], [0.5, 0, 0.5]]))
    with pytest.raises(ValueError, match="rows"):
        check_doubly_stochastic(np.array([[0.5, 0.6], [0.5, 0.4]]))
    with pytest.raises(ValueError, match="columns"):
        check_column_stochastic(np.array([[0.5, 0.5], [0.6, 0.4]]))
    with pytest.raises(ValueError, match="non-negative"):
        check_column_stochastic(np.array([[1.5, 0.0], [-0.5, 1.0]]))


def test_ring_spectrum_matches_closed_form() -> None:
    n = 12
    eigenvalues = np.sort(np.linalg.eigvalsh(Topology.parse("ring").weights(n)))
    expected = np.sort([1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n) for k in range(n)])
    np.testing.assert_allclose(eigenvalues, expected, atol=1e-12)
    assert analyze(Topology.parse("ring"), n).spectral_gap == pytest.approx(
        1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / n)), abs=1e-6
    )


def test_complete_and_hypercube_gaps() -> None:
    assert analyze(Topology.parse("complete"), 9).spectral_gap == pytest.approx(1.0)
    for d in (2, 3, 4, 5):  # W = (I + A) / (d + 1); A's eigenvalues d - 2k: |lambda_2| = (d-1)/(d+1)
        assert analyze(Topology.parse("hypercube"), 2**d).spectral_gap == pytest.approx(2 / (d + 1), abs=1e-6)


def test_one_peer_exponential_averages_exactly_in_log2_n_rounds() -> None:
    topology = Topology.parse("one-peer-exponential")
    n = 16
    product = np.eye(n)
    for round in range(4):
        product = topology.weights(n, round) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1 / n), atol=1e-12)
    assert analyze(topology, n).contraction == pytest.approx(0.0, abs=1e-6)
    assert analyze(topology, 12).contraction > 0.0  # not exact when n is not a power of two


def test_random_matching_contraction_matches_monte_carlo() -> None:
    topology = Topology.parse("random-matching")
    for n in (10, 11):
        deviations = [topology.weights(n, r) - 1 / n for r in range(4000)]
        expected = np.mean([d.T @ d for d in deviations], axis=0)
        sampled = math.sqrt(np.linalg.eigvalsh(expected)[-1])
        assert analyze(topology, n).contraction == pytest.approx(sampled, rel=0.03)


def test_analysis_fields() -> None:
    analysis = analyze(Topology.parse("exponential"), 8, model_bytes=1000)
    assert (analysis.edges, analysis.degree_max, analysis.diameter) == (20, 5, 2)
    assert analysis.bytes_per_round == 5000
    assert analysis.spectral_gap == pytest.approx(
        1 - second_eigenvalue_modulus(Topology.parse("exponential").weights(8))
    )
    assert set(analysis.as_json()) >= {"name", "nodes", "edges", "spectral_gap", "degree_max", "diameter"}
    assert analyze(Topology.parse("directed-exponential"), 8).diameter == 3  # 7 = 4 + 2 + 1 hops forward
    assert analyze(Topology.parse("one-peer-exponential"), 8).diameter == 3  # over one period


def test_file_topologies(tmp_path: Path) -> None:
    edges = tmp_path / "g.txt"
    edges.write_text("# a path with a chord\n0 1\n1 2\n2 3  # end\n0 2\n")
    graph = Topology.parse(f"file:{edges}").graph(4)
    assert sorted(graph.edges) == [(0, 1), (0, 2), (1, 2), (2, 3)]
    adjacency = tmp_path / "g.json"
    adjacency.write_text(json.dumps({"0": [1, 2], "1": [0], "2": [0]}))
    assert sorted(Topology.parse(f"file:{adjacency}").graph(3).edges) == [(0, 1), (0, 2)]
    as_lists = tmp_path / "lists.json"  # graphs are cached per file: a new name for new contents
    as_lists.write_text(json.dumps([[1], [0, 2], [1]]))
    assert sorted(Topology.parse(f"file:{as_lists}").graph(3).edges) == [(0, 1), (1, 2)]
    with pytest.raises(TopologyError, match=re.escape("a mesh of 5 needs exactly 0..4")):
        Topology.parse(f"file:{edges}").graph(5)
    malformed = tmp_path / "malformed.txt"
    malformed.write_text("0 1 2\n")
    with pytest.raises(TopologyError, match="line 1: expected 'u v'"):
        Topology.parse(f"file:{malformed}").graph(3)
    split = tmp_path / "split.txt"
    split.write_text("0 1\n2 3\n")
    with pytest.raises(TopologyError, match="not connected"):
        Topology.parse(f"file:{split}").graph(4)
    with pytest.raises(TopologyError, match="cannot read topology file"):
        Topology.parse(f"file:{tmp_path / 'missing.txt'}").graph(4)


def test_member_order_is_natural() -> None:
    assert member_order(["node-10", "node-2", "node-1", "b", "a"]) == [
        "a",
        "b",
        "node-1",
        "node-2",
        "node-10",
    ]


@pytest.mark.parametrize(
    "name", ["ring", "exponential", "directed-exponential", "one-peer-exponential", "random-matching"]
)
def test_every_member_derives_the_same_graph(name: str) -> None:
    members = {f"node-{i}" for i in range(8)}
    topology = Topology.parse(name)
    for round in range(3):
        rows = {m: mixing_row(topology, members, m, round) for m in members}
        for me, row in rows.items():
            assert math.isclose(row.self_weight + sum(row.receive_from.values()), 1.0)
            for target in row.send_to:  # whatever I send, the receiver expects from me
                assert me in rows[target].receive_from
            for sender, weight in row.receive_from.items():
                assert me in rows[sender].send_to
                if not topology.family.directed:
                    assert rows[sender].receive_from[me] == weight


def test_membership_change_changes_the_graph() -> None:
    ring = Topology.parse("ring")
    before = mixing_row(ring, {f"n{i}" for i in range(5)}, "n0")
    after = mixing_row(ring, {f"n{i}" for i in range(5)} - {"n4"}, "n0")
    assert set(before.send_to) == {"n1", "n4"}
    assert set(after.send_to) == {"n1", "n3"}


def test_renormalisation_over_what_arrived() -> None:
    row = mixing_row(Topology.parse("ring"), {"a", "b", "c", "d"}, "a")  # 1/3 each
    kept = row.renormalized({"b"})
    assert kept.self_weight == pytest.approx(0.5) and dict(kept.receive_from) == pytest.approx({"b": 0.5})
    assert row.renormalized(set()).self_weight == pytest.approx(1.0)


def test_active_passive_pairings() -> None:
    ring = Topology.parse("ring").graph(8)
    active, passive = active_passive(ring)
    assert active == {0, 2, 4, 6} and passive == {1, 3, 5, 7}  # the ring's 2-colouring
    for round in range(10):
        partner = pairwise_partner(ring, 2, round)
        assert partner in {1, 3}
        assert pairwise_partner(ring, partner, round) is None  # passives only answer
    partners = {pairwise_partner(ring, 2, r) for r in range(20)}
    assert partners == {1, 3}
    triangle = Topology.parse("complete").graph(3)  # not bipartite: even/odd node numbers
    assert active_passive(triangle) == ({0, 2}, {1})


def test_a_topology_undefined_for_the_current_members_falls_back_to_exponential() -> None:
    hypercube = Topology.parse("hypercube")
    members = {f"n{i}" for i in range(7)}  # one of 8 has left
    rows = {m: mixing_row(hypercube, members, m) for m in members}
    assert all(row.topology == Topology("exponential") for row in rows.values())
    for me, row in rows.items():  # still a graph every node agrees on
        for target in row.send_to:
            assert me in rows[target].receive_from
    full = mixing_row(hypercube, members | {"n7"}, "n0")
    assert full.topology == hypercube and set(full.send_to) == {"n1", "n2", "n4"}
