"""A node's life in a mesh, written once for the daemon and for users' own loops: come in (start
together with the expected members, or take a running mesh's state), checkpoint, resume, leave.

:class:`Entry` decides how a node comes in from its options and whether it resumed: a node
given ``--expect N`` waits for N members and all start from round 0; a node with contacts and
no ``--expect`` (or one that resumed from its own checkpoint: it rejoins the mesh it crashed out
of) joins a running mesh and takes the state of members that train. :class:`Session` is the
whole life for a user's loop, as a context manager.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from gossip import GossipOptimizer
from gossip.buffers.shards import shard_model
from gossip.optim.local_group import LocalGroup
from gossip.state.fetch import RETRY_S, TransferStats
from gossip.state.manifest import MAX_COUNTER, Snapshot, StateTransferError
from gossipmesh.config import ConfigError, NodeConfig
from gossipmesh.config.configs import SHARD_NEEDS_RANKS
from gossipmesh.console import say
from gossipmesh.daemon.checkpoint import (
    Checkpoint,
    checkpoint_due,
    checkpoint_steps,
    load_newest,
    restore_newest,
    save_checkpoint,
)
from gossipmesh.daemon.local_ranks import (
    RankPlace,
    collective_timeout,
    data_shard,
    join_local_group,
    share_members,
)
from gossipmesh.daemon.peers import default_id, machine_peer, make_peer
from p2p import LocalRankPeer, Peer
from p2p.address import split_endpoint
from p2p.membership.protocol import NOT_YET
from topologies import member_order

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
SOURCE_PATIENCE_S = 3 * RETRY_S  # a state source that sends nothing this long is left for the others
STATE_SOURCES = 3  # members a joiner takes its state from at once
WAITING_EVERY_S = 5.0  # how often a node waiting for its members says what it waits for
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """How a node comes into the mesh (see the module docstring)."""

    config: NodeConfig
    resumed: bool  # it resumed from a checkpoint of its own

    @property
    def joins_running_mesh(self) -> bool:
        has_contacts = bool(self.config.bootstrap or self.config.beacon)
        return has_contacts and (self.config.expect == 0 or self.resumed)

    @property
    def first_round(self) -> int:
        """The peer's first gossip round: announced later (once ready to train) unless it
        starts alone: members that start together wait for each other at round 0, so a node
        that is seconds slower to start is not averaged around."""
        return NOT_YET if self.joins_running_mesh or self.config.expect > 1 else 0

    def wait_for_members(
        self, peer: Peer | LocalRankPeer, cancelled: Callable[[], bool], group: LocalGroup | None = None
    ) -> list[str]:
        """Block until joined (with ``--expect`` members, unless joining a running mesh); the
        members in rank order. On a machine of local ranks (``group``, a collective) rank 0
        waits, then hands the members and its view of the mesh to the others."""
        ordered = None
        if isinstance(peer, Peer):
            expect = 1 if self.joins_running_mesh else max(1, self.config.expect)
            said = started = time.monotonic()

            def waiting() -> bool:
                nonlocal said
                if time.monotonic() - said >= WAITING_EVERY_S:
                    said = time.monotonic()
                    say(self.config.progress, self._waiting(peer, expect, said - started))
                return cancelled()

            peer.wait_ready(self.config.startup_timeout, expect=expect, cancelled=waiting)
            ordered = member_order(peer.members())
        if group is not None:
            ordered = share_members(group, ordered)
            group.share_view(peer)
        if ordered is None:
            raise TypeError("a local rank other than 0 waits for the members with its machine's group")
        return ordered

    def _waiting(self, peer: Peer, expect: int, waited_s: float) -> str:
        """What a node that waits for its members lacks, for people."""
        of = f"{waited_s:.0f} s of --startup-timeout {self.config.startup_timeout:g}"
        if not peer.membership.joined.is_set():
            contacts = ", ".join(self.config.bootstrap) or f"beacons on UDP port {self.config.beacon}"
            return f"{peer.node_id} waiting to join through {contacts} ({of})"
        have = sorted(peer.members())
        return (
            f"{peer.node_id} waiting for {expect - len(have)} more member(s) of --expect {expect} "
            f"(have: {', '.join(have)}; {of})"
        )

    def come_in(
        self,
        peer: Peer | LocalRankPeer,
        optimizer: GossipOptimizer,
        members: list[str],
        cancelled: Callable[[], bool],
    ) -> TransferStats | None:
        """Take a running mesh's state (returns how it went), or start from round 0 with the
        members present (None). On a machine of local ranks (a collective) rank 0 comes in,
        then every rank takes its state (the one it took, resumed, or began with); with
        ``--shard`` every rank takes its own shard's state from the same rank of the sources."""
        group = optimizer.local_group
        transfer = None
        joins = self.joins_running_mesh and len(members) > 1
        if joins and (isinstance(peer, Peer) or optimizer.shard):
            transfer = join_running_mesh(peer, optimizer, self.config.startup_timeout, cancelled)
        if transfer is None and isinstance(peer, Peer):
            self._start_together(peer, optimizer, members, cancelled)
        if group is not None:
            optimizer.share_state()
        return transfer

    def _start_together(
        self, peer: Peer, optimizer: GossipOptimizer, members: list[str], cancelled: Callable[[], bool]
    ) -> None:
        """Start from round 0 with the members present (none of them trains yet)."""
        if self.first_round == NOT_YET:  # (also when no member trains yet: those present start together)
            peer.start_at_round(0)
            if self.joins_running_mesh:  # each member present starts with us, or takes our state

                def serving() -> bool:
                    optimizer.serve_state()
                    return cancelled()

                announced = NOT_YET - 1  # the members of this "round" have announced a first round
                peer.wait_ready(
                    self.config.startup_timeout, expect=len(members), round=announced, cancelled=serving
                )
            else:
                peer.wait_ready(
                    self.config.startup_timeout, expect=self.config.expect, round=0, cancelled=cancelled
                )


def join_running_mesh(
    peer: Peer | LocalRankPeer, optimizer: GossipOptimizer, timeout: float, cancelled: Callable[[], bool]
) -> TransferStats | None:
    """Take the state of members that train (ones that have announced their first round: a
    member still starting has no state to give), up to ``STATE_SOURCES`` at once, chosen in an
    random order of this node's own so that joiners spread over the mesh; silent sources and bad
    states are left for the others. None when no member trains (the members present start from
    round 0 together) or when ``cancelled()``; raises StateTransferError when none gave its
    state within ``timeout``. On a sharded machine every rank calls it (a collective): rank 0
    chooses the sources of each try, and each rank takes its shard from theirs."""
    group = optimizer.local_group if optimizer.shard else None
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    left_out: set[str] = set()  # sources that sent a bad state or went silent: asked last
    while True:
        going = time.monotonic() < deadline and not cancelled()
        sources = _sources(peer, left_out) if going and not isinstance(peer, LocalRankPeer) else []
        if group is not None:  # rank 0's choice (go on with these sources, or stop), and its view
            going = bool(group.share_int(int(going) if group.rank == 0 else None))
            sources = share_members(group, sources if group.rank == 0 else None)
            group.share_view(peer)  # (each rank reaches the sources' ranks through it)
        if not going:
            break
        if not sources:
            return None
        try:
            optimizer.join_from(
                sources[:STATE_SOURCES],
                timeout=deadline - time.monotonic(),
                patience_s=SOURCE_PATIENCE_S,
                cancelled=cancelled,
            )
        except StateTransferError as exc:
            failures.append(str(exc))
            left_out |= exc.dropped.keys()
            if not cancelled():
                log.warning("%s: %s; asking again", peer.node_id, exc)
            continue
        transfer = optimizer.last_transfer
        assert transfer is not None
        for source, why in transfer.outvoted.items():
            log.warning("%s: the counters of state source %s were outvoted: %s", peer.node_id, source, why)
        return transfer
    stopped = cancelled()
    if group is not None:
        stopped = bool(group.share_int(int(stopped) if group.rank == 0 else None))
    if stopped:
        return None
    raise StateTransferError(f"no member gave its state within {timeout:g} s: " + "; ".join(failures[-3:]))


def _sources(peer: Peer, left_out: set[str]) -> list[str]:
    """The members to take the state of, in a fresh random order of this node's own (no source
    is always asked first), those in ``left_out`` last."""
    me = peer.node_id
    hidden = peer.not_listening()  # (a node that does not listen reaches none of them)
    sources = member_order(peer.members(NOT_YET - 1) - {me} - (hidden if me in hidden else set()))
    random.shuffle(sources)
    sources.sort(key=lambda source: source in left_out)  # (stable: the others keep their order)
    return sources


def save_state(
    folder: Path,
    steps: int,
    optimizer: GossipOptimizer,
    node_id: str,
    tensors: Mapping[str, np.ndarray] | None = None,
    counters: Mapping[str, Any] | None = None,
) -> Path:
    """A checkpoint of the model, the optimizer, the gossip counters and torch's RNG (plus the
    caller's ``tensors`` and ``counters``); see ``gossipmesh.daemon.checkpoint``."""
    snapshot = optimizer.snapshot()
    everything = {**snapshot.tensors, "rng.torch": torch.get_rng_state().numpy(), **(tensors or {})}
    own = {"steps": optimizer.step_count, "round": optimizer.round, "node_id": node_id}
    return save_checkpoint(folder, steps, everything, {**own, **(counters or {})})


def restore_state(checkpoint: Checkpoint, optimizer: GossipOptimizer) -> None:
    """Continue from ``checkpoint`` (of :func:`save_state`): model, optimizer, counters, RNG.
    Raises (ValueError, KeyError, StateTransferError) before changing anything unless all of
    it fits: this model's layout, counts in range, torch's RNG state."""
    tensors, counters = checkpoint.tensors, checkpoint.counters
    model_state = {
        k: v for k, v in tensors.items() if k == "params" or k.startswith(("optimizer.", "scalar."))
    }
    steps = saved_count(counters, "steps", saved_count(counters, "local_steps", 0))  # (0.1's name)
    saved_count(counters, "round", 0)
    rng = tensors["rng.torch"]
    expected = torch.get_rng_state()
    if rng.dtype != np.uint8 or rng.shape != tuple(expected.shape):
        raise ValueError(
            f"torch's RNG state is {rng.dtype}{list(rng.shape)}, not uint8{list(expected.shape)}"
        )
    optimizer.restore(Snapshot(model_state, {"steps": steps}))  # (checks the layout first)
    torch.set_rng_state(torch.from_numpy(rng.copy()))


def saved_count(counters: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """A checkpoint's count ``name`` (``default`` where it has none, if given); ValueError
    unless it is an integer in 0..MAX_COUNTER."""
    value = counters.get(name, default)
    if type(value) is not int or not 0 <= value <= MAX_COUNTER:
        raise ValueError(f"counter {name}={value!r} is not a count in 0..{MAX_COUNTER}")
    return value


def resume(
    config: NodeConfig, newest: Checkpoint | None, restore: Callable[[Checkpoint], None]
) -> Checkpoint | None:
    """Restore this node's newest checkpoint that fits, with ``restore`` (see
    ``gossipmesh.daemon.checkpoint.restore_newest``); None: there is none."""
    if config.state_dir is None:
        return None
    return restore_newest(config.state_dir, newest, restore)


def join_machine(config: NodeConfig, device: str | None = None) -> tuple[NodeConfig, LocalGroup | None]:
    """This process's machine under torchrun: its local group (None for a process alone) and the
    config this rank runs. ``device``: the model's (default: ``--device``, where ``cuda`` becomes
    this rank's own device). Local rank 0 keeps the machine's state, report and metrics; with
    ``--shard`` rank r > 0 keeps the checkpoints of its shard in ``STATE_DIR/rank-r``."""
    place = RankPlace.from_environment()
    if place is None:
        if config.shard:
            raise ConfigError(f"--shard: {SHARD_NEEDS_RANKS}")
        return config, None
    if device is None and config.device == "cuda":  # one device per local rank
        config = replace(config, device=f"cuda:{place.local_rank}")
        torch.cuda.set_device(place.local_rank)
    group = join_local_group(device or config.device, collective_timeout(config))
    if group.rank > 0:
        config = replace(
            config,
            state_dir=rank_state_dir(config.state_dir, group.rank) if config.shard else None,
            report=None,
            save_params=None,
            live_params=None,
            metrics_port=None,
            progress="none",
        )
    return config, group


def rank_state_dir(state_dir: Path | None, local_rank: int) -> Path | None:
    """Where local rank ``local_rank`` > 0 of a sharded machine keeps its shard's checkpoints."""
    return state_dir / f"rank-{local_rank}" if state_dir is not None else None


def machine_checkpoint(
    group: LocalGroup, folder: Path | None, newest: Checkpoint | None
) -> Checkpoint | None:
    """The checkpoint of a sharded machine's rank: of the newest steps that every rank has (a
    collective; a rank killed while writing a newer one takes its older one), None on every rank
    when one has none."""
    mine = checkpoint_steps(newest.path) if newest is not None else -1
    target = min(int(steps) for steps in group.all_gather_bytes(str(mine).encode()))
    if folder is not None and newest is not None and 0 <= target < mine:
        newest = load_newest(folder, at_most=target)
    found = newest is not None and checkpoint_steps(newest.path) == target
    return newest if not group.agree(not found) else None


def share_cores(
    config: NodeConfig, peer: Peer | LocalRankPeer, members: list[str], group: LocalGroup | None
) -> str | None:
    """Give torch this process's share of the machine's cores when other members (by their
    addresses) or local ranks compute on it too and ``--threads`` says nothing: torch's default
    of one thread per core in every process makes them all wait on each other. Returns what it
    did, for the user to see (None: nothing)."""
    if config.threads:
        return None
    here = sum(1 for node in members if _on_this_machine(peer, node)) if isinstance(peer, Peer) else 1
    processes = max(1, here) * (group.size if group is not None else 1)
    cores = os.cpu_count() or 1
    threads = max(1, cores // processes)
    if processes == 1 or torch.get_num_threads() <= threads:
        return None
    torch.set_num_threads(threads)
    return (
        f"{processes} processes of the mesh share this machine's {cores} cores: torch computes on "
        f"{threads} thread{'s' if threads > 1 else ''} in each (--threads N to choose)"
    )


def _on_this_machine(peer: Peer, node_id: str) -> bool:
    if node_id == peer.node_id:
        return True
    contact = peer.membership.contact(node_id)
    if contact is None or not contact[0].startswith("tcp://"):
        return False
    host = split_endpoint(contact[0])[0]
    own = split_endpoint(peer.address)[0] if peer.address.startswith("tcp://") else None
    return host == own or host in LOOPBACK


@dataclass(frozen=True)
class Member:
    """A node made ready to come in: its id, its newest checkpoint, how it comes in, its network."""

    node_id: str
    checkpoint: Checkpoint | None
    entry: Entry
    peer: Peer | LocalRankPeer


def member(
    config: NodeConfig,
    model: torch.nn.Module,
    group: LocalGroup | None,
    clock: Callable[[], float] = time.monotonic,
) -> Member:
    """The member ``config`` describes (of :func:`join_machine`'s config and group), its network
    made and not yet started; ``clock``: the report clock of its membership events."""
    node_id = config.id or default_id(config.listen)
    checkpoint = load_newest(config.state_dir) if config.state_dir is not None else None
    if group is not None and config.shard:
        checkpoint = machine_checkpoint(group, config.state_dir, checkpoint)
    entry = Entry(config, resumed=checkpoint is not None)
    peer: Peer | LocalRankPeer
    if group is None:
        peer = make_peer(config, model, node_id=node_id, clock=clock, first_round=entry.first_round)
    else:
        peer = machine_peer(config, model, group, node_id=node_id, clock=clock, first_round=entry.first_round)
    return Member(node_id, checkpoint, entry, peer)


class Session:
    """A node's whole life in a mesh, for a user's own training loop::

        with gossipmesh.Session(config, model, torch.optim.AdamW(model.parameters())) as node:
            for inputs, targets in batches:
                loss = loss_fn(model(inputs), targets)
                node.optimizer.zero_grad(); loss.backward(); node.optimizer.step()

    On entering it joins (``gossipmesh.connect``'s options: ``--listen``, ``--bootstrap``,
    ``--expect``...), resumes from the newest checkpoint in ``--state-dir`` when there is one, and
    either starts from round 0 with the ``--expect`` members or takes the state of members
    already training (``transfer`` says how it went). ``optimizer`` is the given one wrapped as
    the options say (a ``GossipOptimizer``); with ``--state-dir`` it checkpoints every
    ``--checkpoint-every`` steps. On leaving (an exception too) it stops gossiping after its
    last round, tells the members, writes a last checkpoint and closes the network.

    Under ``torchrun --standalone --nproc-per-node N`` the N processes are one machine, one
    member (``gossip.optim.local_group``): every rank makes a Session with the same options (rank r
    takes data on the ``--listen`` port + r); each backward pass averages the gradients over
    the ranks, each rank gossips its slice of the model, rank 0 keeps the membership and the
    checkpoints. Each rank trains on its own data: ``shard`` says which part.

    With ``shard=True`` (or ``--shard``) the machine's ranks shard the model with FSDP2 instead
    of each holding it whole: the Session calls ``fully_shard`` on the model's blocks and on the
    model (after joining the machine's process group; ``optimizer``, made on the model's
    parameters and not stepped yet, then holds the shards; a model made on the meta device is
    made on ``--device`` shard by shard), each rank gossips its own shard,
    takes it from the same rank of a running mesh, and checkpoints it (rank r > 0 in
    ``STATE_DIR/rank-r``).
    """

    def __init__(
        self,
        config: NodeConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        shard: bool = False,
    ) -> None:
        made = next(model.parameters()).device  # (meta: a model to make shard by shard)
        config, self.local_group = join_machine(
            replace(config, shard=config.shard or shard), None if made.type == "meta" else str(made)
        )
        self.config = config
        if config.shard:
            shard_model(model, optimizer, device=config.device)
        joined = member(config, model, self.local_group)
        self.node_id, self._checkpoint, self.entry = joined.node_id, joined.checkpoint, joined.entry
        self.peer = joined.peer
        self.optimizer = config.gossip_optimizer(
            optimizer, self.peer, local_group=self.local_group, model=model, shard=config.shard
        )
        self.optimizer.overlap_upload(model)  # (on a GPU: the next forward overlaps the upload)
        self.members: list[str] = []
        self.transfer: TransferStats | None = None
        self.resumed_from = self._checkpoint.path if self._checkpoint is not None else None
        self._checked_at = 0  # the step count after the last step (a checkpoint is due past a multiple)
        if config.state_dir is not None:
            self.optimizer.register_step_post_hook(lambda *_: self._checkpoint_when_due())

    @property
    def rank(self) -> int:
        """This node's (machine's) place among the members it started with."""
        return self.members.index(self.node_id)

    @property
    def shard(self) -> tuple[int, int]:
        """(index, count): this process's part of the data among every rank of every member it
        started with (a machine of N local ranks holds N consecutive parts)."""
        return data_shard(self.rank, len(self.members), self.local_group)

    def __enter__(self) -> Session:
        self.peer.start()
        try:
            self.members = self.entry.wait_for_members(self.peer, lambda: False, self.local_group)
            shared = share_cores(self.config, self.peer, self.members, self.local_group)
            if shared is not None:
                log.info("%s: %s", self.node_id, shared)
            self._checkpoint = resume(
                self.config, self._checkpoint, lambda c: restore_state(c, self.optimizer)
            )
            self.resumed_from = self._checkpoint.path if self._checkpoint is not None else None
            self.transfer = self.entry.come_in(self.peer, self.optimizer, self.members, lambda: False)
            self._checked_at = self.optimizer.step_count
        except BaseException:
            self.optimizer.close()
            self.peer.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(finish=kind is None)

    def checkpoint(self) -> Path:
        """Write a checkpoint to ``--state-dir`` now."""
        if self.config.state_dir is None:
            raise ValueError("checkpoints go to --state-dir: give the node one")
        return save_state(self.config.state_dir, self.optimizer.step_count, self.optimizer, self.node_id)

    def close(self, *, finish: bool = True) -> None:
        """Mix the final models once more with the neighbours' (``finish``:
        ``GossipOptimizer.finish``, not after an error), leave after this node's last round,
        write a last checkpoint, close the network."""
        try:
            if finish:
                self.optimizer.finish()
        finally:
            self.optimizer.close()
            self.peer.leave(after_round=self.optimizer.round - 1)
            try:
                if self.config.state_dir is not None:
                    self.checkpoint()
            finally:
                self.peer.close()

    def _checkpoint_when_due(self) -> None:
        before, self._checked_at = self._checked_at, self.optimizer.step_count
        if checkpoint_due(before, self._checked_at, self.config.checkpoint_every):
            try:
                self.checkpoint()
            except OSError as exc:  # (training goes on: the previous checkpoint is still whole)
                log.warning(
                    "%s: cannot write a checkpoint to %s: %s", self.node_id, self.config.state_dir, exc
                )
