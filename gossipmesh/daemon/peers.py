"""The node's network endpoint made from its config: one way for the daemon and for users' own
training loops (``connect``) to become a member of a mesh."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from gossip.algorithms.registry import FAMILIES, Algorithm
from gossip.buffers.flat import host_vector_bytes
from gossip.messages import FINAL, STATE_REQUEST
from gossip.optim.local_group import LocalGroup
from gossip.optim.optimizer import averaged_buffers
from gossip.state import manifest as state
from gossipmesh.config import NodeConfig
from gossipmesh.daemon.local_ranks import rank_endpoint
from gossipmesh.logs import NODE_LOGGER
from p2p import LocalRankPeer, Peer
from p2p.address import default_name, split_endpoint
from p2p.membership.protocol import PROFILES
from p2p.security.curve import Curve, insecure_warning
from p2p.wire import Limits

log = logging.getLogger(NODE_LOGGER)


def message_kinds(algorithm: Algorithm | None = None) -> frozenset[str]:
    """What a daemon's inbox takes: its ``algorithm``'s kinds (every registered algorithm's if
    None), the final exchange's and state transfer's. Others are rejected at the door: a kind
    nobody reads would wait in the inbox for good."""
    families = FAMILIES.values() if algorithm is None else [algorithm.family]
    algorithms = {kind for family in families for kind in family.averager.kinds}
    return frozenset({*algorithms, FINAL, STATE_REQUEST, *state.JOINER_KINDS})


def make_peer(
    config: NodeConfig,
    model: torch.nn.Module,
    *,
    node_id: str,
    clock: Callable[[], float] = time.monotonic,
    first_round: int = 0,
    ranks: Sequence[str] = (),
) -> Peer:
    """A peer (not started) with the config's addresses, discovery and CURVE keys (none with
    ``--insecure``, said loudly in the log), and messages limited to what this model needs;
    ``ranks``: the data addresses of the machine's other local ranks. The kinds the algorithm
    mixes as they arrive are taken piece by piece from the start: a neighbour's first value may
    come before this node's algorithm is built."""
    peer = Peer(
        node_id,
        None if config.no_listen else config.listen,
        config.bootstrap,
        advertise=config.advertise,
        inbox_kinds=message_kinds(config.algorithm),
        limits=_limits(model),
        profile=PROFILES[config.profile],
        clock=clock,
        first_round=first_round,
        beacon_port=config.beacon,
        mesh_name=config.mesh_name,
        curve=_curve(config, node_id),
        max_send_bytes_per_s=_send_cap(config),
        ranks=ranks,
        streams=config.streams,
    )
    peer.take_pieces(config.algorithm.piece_kinds(config.robust, config.compression))
    return peer


def machine_peer(
    config: NodeConfig,
    model: torch.nn.Module,
    group: LocalGroup,
    *,
    node_id: str,
    clock: Callable[[], float] = time.monotonic,
    first_round: int = 0,
) -> Peer | LocalRankPeer:
    """This local rank's network (see ``p2p.endpoint.local_rank``): rank 0's peer, its record naming
    the other ranks' addresses; another rank's own data endpoint (started: its address is
    what rank 0 needs), on the ``--listen`` port + its rank (``--advertise``'s, if given)."""
    if group.rank == 0:
        addresses = group.all_gather_bytes(b"")
        ranks = [address.decode() for address in addresses[1:]]
        return make_peer(config, model, node_id=node_id, clock=clock, first_round=first_round, ranks=ranks)
    endpoint = LocalRankPeer(
        node_id,
        group.rank,
        rank_endpoint(config.listen, group.rank),
        advertise=rank_endpoint(config.advertise, group.rank) if config.advertise else None,
        limits=_limits(model),
        curve=_curve(config, node_id),
        max_send_bytes_per_s=_send_cap(config),
        streams=config.streams,
    )
    group.all_gather_bytes(endpoint.start().encode())
    return endpoint


def _curve(config: NodeConfig, node_id: str) -> Curve | None:
    """The node's CURVE keys (none with ``--insecure``, said loudly in the log)."""
    if config.insecure:
        log.warning(insecure_warning())
        return None
    if config.keys is not None and config.trusted is not None:
        return Curve.load(config.keys, config.trusted, node_id)
    return None


def _limits(model: torch.nn.Module) -> Limits:
    return Limits(max_message_bytes=max(largest_message(model), state.CHUNK_BYTES))


def _send_cap(config: NodeConfig) -> float | None:
    return config.max_send_mbps * 1e6 / 8 if config.max_send_mbps else None


def largest_message(model: torch.nn.Module) -> int:
    """The most bytes a gossip message about ``model`` carries: the mixing vector (float32, or
    float64; twice a bfloat16 model's own bytes) with room for what goes beside it (SGP's
    weight, a sparse codec's positions: at most 1/8 more)."""
    vector_bytes = host_vector_bytes([*model.parameters(), *averaged_buffers(model)])
    return vector_bytes + vector_bytes // 8 + (1 << 16)


def connect(config: NodeConfig, model: torch.nn.Module) -> Peer:
    """A started peer that has joined the mesh and sees ``--expect`` members (all members
    train from round 0, so start them together). Raises ``p2p.TransportError`` after
    ``--startup-timeout`` with what to check."""
    peer = make_peer(config, model, node_id=config.id or default_id(config.listen))
    peer.start()
    try:
        peer.wait_ready(config.startup_timeout, expect=max(1, config.expect))
    except BaseException:
        peer.close()
        raise
    return peer


def default_id(listen: str) -> str:
    """HOSTNAME-PORT, made a valid node id."""
    _, port = split_endpoint(listen)
    return f"{default_name()}-{port or os.getpid()}"
