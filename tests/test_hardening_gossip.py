"""Hardening of what the algorithms take in (issue 16): nothing non-finite reaches a model (6),
robust rules are defined for any number of arrivals (7), a request cannot make a node copy its
state or model without bound (9), and a joiner checks a state source's counters and skips a
bad source for another (12)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Collection
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from helpers import in_background, started_peers

from gossip import CHOCO, DPSGD, Algorithm, GossipOptimizer
from gossip.algorithms.choco_replicas import MAX_PENDING
from gossip.algorithms.robust import RobustRule
from gossip.compression import INT8_BLOCK, BFloat16, Codec, CodecError, Float16, Int8
from gossip.messages import CHOCO_FULL as FULL
from gossip.messages import CHOCO_FULL_REQUEST as FULL_REQUEST
from gossip.messages import CHOCO_UPDATE as KIND
from gossip.messages import PARAMS
from gossip.messages import STATE_CHUNK as CHUNK
from gossip.messages import STATE_REQUEST as REQUEST
from gossip.network import Envelope, PeerWrapper
from gossip.optim.optimizer import JOIN_LEAD_S, MAX_ROUNDS_PER_S
from gossip.state.fetch import fetch_state
from gossip.state.manifest import MAX_WINDOW, Snapshot, StateTransferError
from gossip.state.server import MAX_TRANSFERS, STATE_COPIES, StateServer
from gossip.tuning.auto_period import MAX_H, PeriodAgreement
from gossipmesh.config import NodeConfig
from gossipmesh.daemon.lifecycle import join_running_mesh
from gossipmesh.sim.memory import MemoryNetwork, MemoryPeer
from topologies import Topology

SIZE = 300
_F32_MAX = float(np.finfo(np.float32).max)


def _int8_frames(q: int, scale: float) -> list[np.ndarray]:
    blocks = -(-SIZE // INT8_BLOCK)
    return [np.full(blocks, scale, np.float32), np.full(SIZE, q, np.int8)]


@pytest.mark.parametrize(
    ("codec", "frames", "reason"),
    [
        (Codec(), [np.full(SIZE, np.nan, np.float32)], "non_finite"),
        (Float16(), [np.full(SIZE, np.inf, np.float16)], "non_finite"),
        (BFloat16(), [np.full(SIZE, 0x7FC0, np.uint16)], "non_finite"),  # a bf16 NaN
        (Int8(), _int8_frames(1, 3e38), "codec_scale"),
        (Int8(), _int8_frames(-128, _F32_MAX / 127), "codec_value"),  # -inf, within the scale bound
    ],
)
def test_no_codec_decodes_to_non_finite_values(codec: Codec, frames: list[np.ndarray], reason: str) -> None:
    """Item 6."""
    with pytest.raises(CodecError) as caught:
        codec.decode(frames, {}, SIZE)
    assert caught.value.reason == reason


def _choco_pair(round_timeout: float = 0.2) -> tuple[CHOCO, np.ndarray, MemoryPeer]:
    """Node a running CHOCO (exact codec) on a ring with b, which the test plays by hand, and
    b's full copy of ones already in a's inbox for round 0. It waits for b (``stragglers=wait``):
    a round mixes b's replica only at that round, so a refused update leaves the model as it was
    (tolerant, it would mix the replica a round old)."""
    network = MemoryNetwork()
    a, b = network.join("a"), network.join("b")
    params = np.zeros(SIZE, np.float32)
    choco = CHOCO(
        a,
        params,
        topology=Topology.parse("ring"),
        codec=Codec(),
        round_timeout=round_timeout,
        stragglers="wait",
    )
    b.send("a", FULL, 0, [np.ones(SIZE, np.float32)], {"gamma": 1.0})
    return choco, params, b


def test_choco_refuses_non_finite_updates() -> None:
    """Item 6: a neighbour's update of NaN."""
    choco, params, b = _choco_pair()
    choco.after_step()  # round 0 mixes b's full copy
    b.send("a", KIND, 1, [np.full(SIZE, np.nan, np.float32)], {"codec": "none", "gamma": 1.0})
    choco.after_step()
    assert np.isfinite(params).all() and params[0] == pytest.approx(0.5)
    assert choco.rejected["non_finite"] == 1


def test_choco_drops_a_replica_that_a_diverged_neighbour_made_infinite() -> None:
    """Item 6: finite updates that add up past float32's range (a neighbour that diverged)."""
    choco, params, b = _choco_pair()
    choco.after_step()
    for r in (1, 2):
        b.send("a", KIND, r, [np.full(SIZE, 3e38, np.float32)], {"codec": "none", "gamma": 1.0})
        choco.after_step()
    assert np.isfinite(params).all()
    assert choco.rejected["non_finite"] == 1


def test_choco_keeps_a_bounded_number_of_updates_for_future_rounds() -> None:
    """A neighbour's q's for the next 400 rounds, after its full copy: at most MAX_PENDING wait
    (each a model's size), the rest are dropped as too far ahead."""
    choco, _, b = _choco_pair()
    choco.after_step()
    for r in range(2, 402):
        b.send("a", KIND, r, [np.zeros(SIZE, np.float32)], {"codec": "none", "gamma": 1.0})
    choco.after_step()
    pending = choco._replicas["b"].pending
    assert sum(f.nbytes for q in pending.values() for f in q.frames) <= MAX_PENDING * SIZE * 4
    assert choco.dropped["choco_ahead"] == 400 - len(pending) > 0


@pytest.mark.parametrize("gamma", [None, 0.0, 1.5, "1", float("nan")])
def test_choco_refuses_an_update_without_a_valid_step_size(gamma: object) -> None:
    """A pair mixes at the smaller of the two step sizes its updates name: one that names none,
    or one outside (0, 1], is refused rather than trusted."""
    choco, params, b = _choco_pair()
    choco.after_step()
    meta = {"codec": "none"} if gamma is None else {"codec": "none", "gamma": gamma}
    b.send("a", KIND, 1, [np.full(SIZE, 3.0, np.float32)], meta)
    choco.after_step()
    assert choco.rejected["choco_gamma"] == 1 and params[0] == pytest.approx(0.5)


def test_robust_rules_do_not_trust_fewer_arrivals_than_they_tolerate() -> None:
    """Trimmed-mean with one arrival does not raise, and clip with one does not take that
    arrival's own distance as the radius (which would move a third of the way to a value 1e6
    away)."""
    own = np.zeros(4, np.float32)
    liar = np.full(4, 1e6, np.float32)
    out = np.empty(4, np.float32)
    for rule in (RobustRule("trimmed-mean", 1), RobustRule("clip", 1)):
        rule.mix(own, {"liar": (liar, 1 / 3)}, out)
        np.testing.assert_array_equal(out, own)
    RobustRule("trimmed-mean", 1).mix(own, {}, out)
    np.testing.assert_array_equal(out, own)


def test_dpsgd_with_trimmed_mean_goes_on_when_a_neighbour_is_silent() -> None:
    """Item 7: one silent neighbour on the default ring."""
    network = MemoryNetwork()
    a, b, _ = network.join("a"), network.join("b"), network.join("c")
    params = np.zeros(4, np.float32)
    dpsgd = DPSGD(
        a, params, topology=Topology.parse("ring"), round_timeout=0.2, robust=RobustRule("trimmed-mean")
    )
    b.send("a", "params", 0, [np.ones(4, np.float32)])
    stats = dpsgd.after_step()
    assert stats.arrived == 1 and (params == 0).all()


def _optimizer(peer: MemoryPeer) -> GossipOptimizer:
    return GossipOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), peer=peer)


def test_a_flood_of_state_requests_costs_a_bounded_number_of_chunks() -> None:
    """Item 9: a source copies no state for a request, only the chunks it answers: a member's
    20 requests for 32 chunks each bring 32 (its window), a non-member's nothing, and past
    ``MAX_TRANSFERS`` requesters at once the rest wait."""
    network = MemoryNetwork()
    source = _optimizer(network.join("source"))
    asker = network.join("asker")
    asker.send("source", REQUEST, 0, meta={"transfer": 7, "manifest": True})
    for _ in range(20):
        asker.send("source", REQUEST, 0, meta=_chunks_request(transfer=7))
    assert source.serve_state() == 21 and source._state_server.chunks_sent == MAX_WINDOW
    outsider = network.join("outsider")
    network.leave("outsider")
    outsider.send("source", REQUEST, 0, meta=_chunks_request(transfer=1))
    for i in range(MAX_TRANSFERS):
        other = network.join(f"other-{i}")
        other.send("source", REQUEST, 0, meta={"transfer": i, "manifest": True})
        other.send("source", REQUEST, 0, meta=_chunks_request(transfer=i))
    source.serve_state()
    refused = source._state_server.refused
    assert refused["not_a_member"] == 1 and refused["busy"] == 2  # the last one's two requests
    assert source._state_server.chunks_sent == MAX_WINDOW + (MAX_TRANSFERS - 1) * MAX_WINDOW


def _chunks_request(transfer: int) -> dict[str, object]:
    return {"transfer": transfer, "chunk_bytes": 256, "chunks": [0] * MAX_WINDOW, "settled": 0}


def test_a_flood_of_full_copy_requests_costs_one_copy() -> None:
    """Item 9: CHOCO answers 20 requests for its public copy in one round with one copy."""
    choco, _, b = _choco_pair()
    for _ in range(20):
        b.send("a", FULL_REQUEST, 0)
    choco.after_step()
    assert choco.full_copies_sent == 1


def test_a_state_with_impossible_counters_is_refused() -> None:
    """Round 1e300: the joiner must not announce it (its network thread would die)."""
    network = MemoryNetwork()
    source, newcomer = network.join("source"), network.join("newcomer")
    state = Snapshot({"params": np.zeros(4, np.float32)}, {"round": 1e300})
    with (
        in_background(StateServer(source, state).serve),
        pytest.raises(StateTransferError, match="source: counters must map names to numbers"),
    ):
        fetch_state(newcomer, ["source"], timeout=5, max_bytes=1 << 20)


def test_a_joiner_skips_a_bad_state_source_for_a_good_one() -> None:
    """Item 12: "bad" sends impossible counters; the joiner takes "good"'s state instead."""
    network = MemoryNetwork()
    bad, good, late = network.join("bad"), network.join("good"), network.join("late")
    config = NodeConfig(insecure=True, startup_timeout=20)
    task = config.task.make()
    joiner = config.gossip_optimizer(config.local_optimizer(task.model(0)), late)
    source = GossipOptimizer(torch.optim.SGD(task.model(1).parameters(), lr=0.1), peer=good)
    source.step_count = 7
    impossible = Snapshot({"params": joiner.flat.array.copy()}, {"round": 1e300})
    with (
        in_background(StateServer(bad, impossible).serve),
        in_background(source.serve_state),
    ):
        assert join_running_mesh(late, joiner, 20, lambda: False) is not None  # type: ignore[arg-type]
    np.testing.assert_array_equal(joiner.flat.array, source.flat.array)
    assert joiner.step_count == 7 and joiner.round == 2  # good's round 0 + the lead


def test_a_source_whose_manifest_does_not_fit_the_model_is_the_one_left_out() -> None:
    """ "bad" answers first with a layout 2 elements longer: it is left out, not the honest
    source that answers after it, and the joiner takes the honest state."""
    network = MemoryNetwork()
    bad, good, late = network.join("bad"), network.join("good"), network.join("late")
    config = NodeConfig(insecure=True, startup_timeout=20)
    task = config.task.make()
    joiner = config.gossip_optimizer(config.local_optimizer(task.model(0)), late)
    source = GossipOptimizer(torch.optim.SGD(task.model(1).parameters(), lr=0.1), peer=good)
    source.step_count = 7
    longer = Snapshot({"params": np.zeros(joiner.flat.array.size + 2, np.float32)}, {"round": 0})
    lying = StateServer(bad, longer)
    lied = threading.Event()

    def lie() -> None:
        if lying.serve(0.1):
            lied.set()

    with in_background(lie), in_background(lambda: lied.wait() and source.serve_state(0.1)):
        stats = join_running_mesh(late, joiner, 20, lambda: False)  # type: ignore[arg-type]
    assert stats is not None and "does not fit this model" in stats.dropped_sources["bad"]
    np.testing.assert_array_equal(joiner.flat.array, source.flat.array)


def test_a_requester_claiming_everything_settled_gets_a_bounded_number_of_state_copies() -> None:
    """200 requests of a full window, each claiming all it was sent as settled: the source
    sends at most STATE_COPIES times a window's bytes (the state is smaller)."""
    network = MemoryNetwork()
    source = _optimizer(network.join("source"))
    asker = network.join("asker")
    asker.send("source", REQUEST, 0, meta={"transfer": 7, "manifest": True})
    source.serve_state()
    server = source._state_server
    for _ in range(200):
        request = {**_chunks_request(transfer=7), "settled": server.chunks_sent}
        asker.send("source", REQUEST, 0, meta=request)
        source.serve_state()
    assert server._bytes_sent["asker"] <= STATE_COPIES * MAX_WINDOW * 256  # (_chunks_request's size)
    assert server.refused["beyond_state_copies"] > 0


def test_a_round_beyond_the_wire_is_refused_where_it_is_announced() -> None:
    """Item 12: such a round, announced, killed the network thread (it could not encode the
    node's own record): now the caller hears of it, and the node goes on."""
    with started_peers(["a", "b"]) as (a, b):
        with pytest.raises(ValueError, match="first_round must be in 0"):
            a.start_at_round(2**70)
        a.send("b", "params", 0, [np.zeros(2, np.float32)])
        assert b.recv(5, {"params"}) is not None and a.transport.failure is None


@pytest.mark.parametrize(
    ("algorithm", "kind", "meta"), [("dpsgd", PARAMS, {}), ("choco", KIND, {"codec": "none", "gamma": 1.0})]
)
def test_an_agreement_takes_proposals_only_from_messages_its_algorithm_accepted(
    algorithm: str, kind: str, meta: dict[str, object]
) -> None:
    """Issue 29, item 5: b's refused message (NaN) claims H = MAX_H in force; its accepted
    one claims more than any node's cap. Neither moves a's H; an accepted H = 3 does."""
    network = MemoryNetwork()
    a, b = network.join("a"), network.join("b")
    node = GossipOptimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(SIZE))], lr=0.1),
        peer=a,
        algorithm=Algorithm.parse(algorithm),
        average_every="auto",
        round_timeout=0.2,
    )
    agreement = node.period_agreement
    assert agreement is not None
    key, value = PeriodAgreement.meta_key, np.zeros(SIZE, np.float32)
    b.send("a", kind, 0, [np.full(SIZE, np.nan, np.float32)], {**meta, key: [0, MAX_H, MAX_H]})
    b.send("a", kind, 0, [value], {**meta, key: [0, 10 * MAX_H, 10 * MAX_H]})
    node.step()  # round 0
    assert node.averager.rejected["non_finite"] == 1
    assert agreement.history == [] and agreement.value_for(1) == 1
    b.send("a", kind, 1, [value], {**meta, key: [0, 3, 3]})
    node.step()  # round 1
    assert agreement.history == [(0, 3)] and agreement.value_for(2) == 3


class _AnswersFirst(PeerWrapper):
    """A state source's network that, once it has answered (its manifest), hears nothing more
    until :attr:`others_answered` is set: its chunks come after the other sources' manifests."""

    def __init__(self, peer: MemoryPeer) -> None:
        super().__init__(peer)
        self.answered, self.others_answered = threading.Event(), threading.Event()

    def send(self, *args: Any, **kwargs: Any) -> None:
        super().send(*args, **kwargs)
        self.answered.set()

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Envelope | None:
        if self.answered.is_set() and not self.others_answered.is_set():
            return None
        return super().recv(timeout, kinds)


def _joiner(peer: MemoryPeer) -> tuple[GossipOptimizer, Snapshot]:
    """The daemon's optimizer on ``peer``, and a state that fits it (at round 5, 10 rounds a
    second) for its sources to serve."""
    config = NodeConfig(insecure=True, startup_timeout=20)
    task = config.task.make()
    joiner = config.gossip_optimizer(config.local_optimizer(task.model(0)), peer)
    state = Snapshot({"params": joiner.flat.array.copy()}, {"steps": 7, "round": 5, "rounds_per_s": 10})
    return joiner, state


def _join_with_a_liar(honest_sources: int, lie: dict[str, float]) -> int:
    """The first round a joiner takes from "liar", which answers first with ``lie`` in its
    counters, and ``honest_sources`` (at round 5 and 10 rounds a second) answering after it."""
    network = MemoryNetwork()
    liar = _AnswersFirst(network.join("liar"))
    honest = [network.join(f"honest-{i}") for i in range(honest_sources)]
    late = network.join("late")
    joiner, state = _joiner(late)
    if not honest:
        liar.others_answered.set()

    def answer(server: StateServer) -> None:
        if liar.answered.wait(0.1) and server.serve(0.1):
            liar.others_answered.set()

    lying = StateServer(liar, Snapshot(state.tensors, {**state.counters, **lie}))
    with contextlib.ExitStack() as stack:
        stack.enter_context(in_background(lying.serve))
        for peer in honest:
            stack.enter_context(in_background(partial(answer, StateServer(peer, state))))
        assert join_running_mesh(late, joiner, 20, lambda: False) is not None  # type: ignore[arg-type]
    return joiner.round


def test_a_joiner_starts_at_the_round_its_sources_agree_on_not_at_a_liars() -> None:
    """Issue 29, item 7: a source claiming round = rounds_per_s = 2^53 once made the joiner
    announce a first round no member would run for ages. Among three sources, the others'
    counters stand; alone, it can still say any round but no rate beyond MAX_ROUNDS_PER_S."""
    lead = math.ceil(10 * JOIN_LEAD_S) + 2
    assert _join_with_a_liar(2, {"round": 2**53, "rounds_per_s": 2**53}) == 5 + lead
    assert _join_with_a_liar(0, {"rounds_per_s": 2**53}) == 5 + math.ceil(MAX_ROUNDS_PER_S * JOIN_LEAD_S) + 2


class _Sends(PeerWrapper):
    """A network that sets ``sent`` once it has sent a message of ``kind``."""

    def __init__(self, peer: MemoryPeer, kind: str) -> None:
        super().__init__(peer)
        self.kind, self.sent = kind, threading.Event()

    def send(self, to: str, kind: str, *args: Any, **kwargs: Any) -> None:
        super().send(to, kind, *args, **kwargs)
        if kind == self.kind:
            self.sent.set()


def test_a_fast_liar_does_not_set_a_joiners_round_before_the_others_answer() -> None:
    """Issue 29, item 7: "liar" sends its whole state, claiming round 10^6, before two honest
    sources (round 5) answer at all. The joiner waits for the counters of most sources: it
    starts at the honest round, and the report names the liar."""
    network = MemoryNetwork()
    liar = _Sends(network.join("liar"), CHUNK)
    honest = [network.join(f"honest-{i}") for i in range(2)]
    late = network.join("late")
    joiner, state = _joiner(late)
    lying = StateServer(liar, Snapshot(state.tensors, {**state.counters, "round": 10**6}))
    with contextlib.ExitStack() as stack:
        stack.enter_context(in_background(lying.serve))
        for peer in honest:
            server = StateServer(peer, state)
            stack.enter_context(in_background(lambda s=server: liar.sent.wait(0.1) and s.serve(0.1)))
        stats = join_running_mesh(late, joiner, 20, lambda: False)  # type: ignore[arg-type]
    assert joiner.round == 5 + math.ceil(10 * JOIN_LEAD_S) + 2
    assert stats is not None and stats.outvoted.keys() == {"liar"}
    assert "round 1e+06" in stats.outvoted["liar"]


def test_a_lone_source_among_silent_ones_does_not_decide_the_counters() -> None:
    """Of two sources one answers and one stays silent: the answer alone is not taken."""
    network = MemoryNetwork()
    source, _, newcomer = network.join("source"), network.join("silent"), network.join("newcomer")
    state = Snapshot({"params": np.zeros(4, np.float32)}, {"round": 10**6})
    with (
        in_background(StateServer(source, state).serve),
        pytest.raises(StateTransferError, match=r"stated by 1 of the 2 sources .* fewer than the 2"),
    ):
        fetch_state(newcomer, ["source", "silent"], timeout=20, max_bytes=1 << 20, patience_s=0.5)
