"""The training-loop wrapper: a local optimizer step, then a gossip round every few steps.

:class:`GossipOptimizer` is a ``torch.optim.Optimizer`` whose parameter groups and state are the
wrapped optimizer's own, so learning-rate schedulers, per-group options, ``GradScaler``, gradient
clipping and trainers that take an optimizer (Hugging Face's ``Trainer(optimizers=...)``) drive
it as they drive any torch optimizer; its ``state_dict`` is the wrapped one's plus a ``"gossip"``
entry (the counters and the outer step's buffers).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from gossip.algorithms.averager import FINAL_WAIT_S, RoundStats
from gossip.algorithms.registry import AUTO, Algorithm
from gossip.algorithms.robust import RobustRule
from gossip.buffers.arrays import from_torch, shares_memory
from gossip.buffers.flat import FlatParameters
from gossip.buffers.shards import Shards, is_sharded, local_tensor
from gossip.compression import AUTO_LADDER, AutoCodec, Codec
from gossip.consensus import relative_distance
from gossip.network import PeerNetwork
from gossip.optim.local_group import BackwardAveraging, LocalGroup
from gossip.optim.momentum_mixing import momentum_buffers, rebind
from gossip.optim.outer import MIN_LOCAL_STEPS, OuterNesterov
from gossip.optim.quasi_global import QuasiGlobalMomentum
from gossip.phases import PhaseTimer, TimedPeer
from gossip.state.fetch import TransferStats, fetch_state
from gossip.state.live import LiveState, StateWriter
from gossip.state.manifest import (
    BUFFER_PREFIX,
    SCALAR_PREFIX,
    Discard,
    Layout,
    Manifest,
    Snapshot,
    StateSink,
    StateTransferError,
    check_fit,
)
from gossip.state.server import StateServer
from gossip.tuning.agreement import AgreeingPeer
from gossip.tuning.auto_codec import CodecAgreement
from gossip.tuning.auto_period import PeriodAgreement
from topologies import Topology

DPSGD_ALGORITHM = Algorithm("dpsgd")
GOSSIP_STATE = "gossip"  # the key of the gossip state in GossipOptimizer.state_dict()
JOIN_LEAD_S = 0.3  # how far ahead a joiner starts: time for the mesh to hear of it
# the fastest a mesh runs rounds, as a joiner believes a state's rounds_per_s: a round is a
# message to each neighbour and back, more than a millisecond even on loopback
MAX_ROUNDS_PER_S = 1000.0
CONSENSUS_EVERY = 10  # local steps between two consensus estimates (at least: the next round)
CONSENSUS_SAMPLE = 1 << 18  # parameters an estimate compares at most (evenly strided): 1 MB, not a model


@dataclass(frozen=True)
class GossipStatistics:
    """A node's gossip so far: what its run report and its metrics show."""

    round: int  # the next gossip round (for adpsgd: the model version)
    rounds_per_s: float
    fallback_rounds: int  # rounds averaged on the fallback graph (see ``topologies.members``)
    staleness: dict[str, float]  # of the messages mixed in: mean, max, accepted, dropped
    rejected: dict[str, int]  # malformed messages, by reason
    dropped: dict[str, int]  # well-formed ones not used (stale, too early...), by reason
    phase_seconds: dict[str, float]  # totals per phase (``gossip.phases``)
    consensus: float | None  # the latest consensus estimate (see GossipOptimizer)
    local_steps_per_epoch: list[tuple[int, int]]  # with "auto": (first round of an epoch, its H)
    codec_per_epoch: list[tuple[int, str]]  # with compression=auto: (first round of an epoch, its codec)


def averaged_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """``model``'s buffers that gossip averages: the floating-point ones of its ``state_dict``
    that hold finite values (one holding -inf or NaN is a mask or a sentinel, not a statistic,
    and no message carrying it would be mixed in)."""
    return [
        buffer
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.is_floating_point()
        and name not in module._non_persistent_buffers_set
        and bool(torch.isfinite(buffer).all())
    ]


def _shards(params: list[torch.Tensor], model: torch.nn.Module | None, group: LocalGroup | None) -> Shards:
    """The local shards of ``params`` (of ``model``, sharded over ``group``'s ranks); ValueError
    saying what is missing."""
    if group is None or model is None:
        raise ValueError(
            "shard=True shards the model over a machine's local ranks: give local_group (the "
            "machine's ranks, which fully_shard sharded the model over) and model (the "
            "fully_shard-ed module)"
        )
    return Shards.of(model, params, group.size)


def saved_step_count(saved: Mapping[str, Any]) -> int:
    """The optimizer steps a saved state had taken (states of gossipmesh 0.1 name them
    ``local_steps``)."""
    return int(saved.get("steps", saved.get("local_steps", 0)))


class GossipOptimizer(torch.optim.Optimizer):
    """A torch optimizer for a decentralized mesh: the wrapped optimizer's step, then a gossip
    round every ``average_every`` steps::

        opt = GossipOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), peer=peer)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        loss.backward(); opt.step(); scheduler.step(); opt.zero_grad()

    ``param_groups`` and ``state`` are the wrapped optimizer's (a scheduler's learning rate is
    the one the local step uses); parameters cannot be added after construction, since they
    live in the flat buffer gossip averages.

    ``phases`` tells where the time of each round went (see ``gossip.phases``), and
    ``consensus_estimate`` how far apart this node and its neighbours are: the relative change
    of the model by mixing, ``||x after - x before|| / ||x||`` (before an outer step, which
    moves it too), measured in the first round ``CONSENSUS_EVERY`` steps after the last, on an
    evenly strided sample of at most ``CONSENSUS_SAMPLE`` parameters (0 once the nodes agree;
    None before the first measurement).

    Args:
        optimizer: the local optimizer; its parameters are moved into one flat buffer.
        peer: the node's network (``p2p.Peer``).
        algorithm: the averaging algorithm (``Algorithm.parse("sgp:overlap=1")``; see
            ``gossip.algorithms.registry``).
        topology: the graph to average on (``Topology.parse("random-regular:degree=4")``);
            None: the algorithm's usual one (``one-peer-exponential`` for sgp, ``ring`` otherwise).
        average_every: local steps between gossip rounds (H); ``"auto"``: chosen by the mesh
            from measured step and round times, one H per epoch of rounds
            (``gossip.tuning.auto_period``; not with ``adpsgd`` or ``overlap``, which hide a round's cost).
        compression: the codec for what is sent (``Codec.parse("int8")``); None: none. Only
            an algorithm that compresses (choco) takes one. ``Codec.parse("auto")``: the mesh
            agrees on a dense codec per epoch from measured round times (``gossip.tuning.auto_codec``).
        outer_lr: with a value, local-steps training as DiLoCo: every H steps the gossip-mixed
            change is applied by an outer Nesterov step with this learning rate
            (``gossip.optim.outer``); None: the mixed parameters are taken as they are.
        outer_momentum: the outer step's Nesterov momentum.
        round_timeout: the longest a round waits for a neighbour, in seconds.
        lock: held while parameters are written (local step and mixing), so another thread can
            evaluate the model consistently; None: a lock of its own.
        robust: a Byzantine-robust mixing rule (``RobustRule.parse("clip:b=1")``), dpsgd only;
            None: the plain weighted mean.
        quasi_global_momentum: β of a momentum step on the model's movement, mixing included,
            after each local step (``gossip.optim.quasi_global``; give the local optimizer no momentum of
            its own); 0: none. Not with an outer step, which has a momentum of its own.
        mix_momentum: mix the wrapped SGD's momentum buffers along with the parameters
            (``gossip.optim.momentum_mixing``; every message carries both). Every node of the mesh
            must say the same. Not with an outer step, quasi-global momentum or local ranks.
        staged: mix a host copy of the parameters, copied from the device before a round and
            back after it (before and after every step with a background exchanger); None: when
            the model is not on the CPU (see ``gossip.buffers.flat``). CHOCO without an outer step
            mixes the model's own memory instead (``mixes_in_place``: cupy kernels on a CUDA
            device, see ``gossip.buffers.arrays``), falling back to the host copy without cupy.
        local_group: this process is one local rank of a machine of several
            (``gossip.optim.local_group``): each backward pass ends by averaging the gradients over
            the machine's ranks, as DDP's does (do not wrap the model in DDP as well), and each
            rank gossips its slice of the parameters through ``peer``: local rank 0's
            ``p2p.Peer``, the others' ``p2p.LocalRankPeer``. With ``average_every="auto"``
            rank 0 takes part in the mesh's agreement and the others take its H.
        model: the module the parameters belong to: its floating-point buffers in the
            ``state_dict`` (BatchNorm's running statistics) are averaged with the parameters
            and travel with them to a joiner, as DDP broadcasts them; integer buffers
            (``num_batches_tracked``) and non-persistent ones stay local. None: parameters only.
        average_buffers: False keeps ``model``'s buffers local too.
        shard: the model is sharded over the machine's local ranks with torch's FSDP2
            (``fully_shard(model)`` on ``local_group``'s ranks, before wrapping its optimizer;
            ``model`` is that module): the flat buffer holds this rank's shard of every
            parameter, in place (``gossip.buffers.shards``), FSDP's reduce-scatter averages the
            gradients, and the rank gossips its whole shard (and the optimizer state of it, to
            a joiner) with the same rank of the other machines; nothing is all-gathered for it.

    Options that do not go together (a codec for an algorithm that sends whole models...)
    raise ``gossip.IncompatibleOptionsError`` (``Algorithm.check``, which the command line's
    checks call too).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: PeerNetwork,
        algorithm: Algorithm = DPSGD_ALGORITHM,
        topology: Topology | None = None,
        average_every: int | Literal["auto"] = 1,
        compression: Codec | None = None,
        outer_lr: float | None = None,
        outer_momentum: float = 0.9,
        round_timeout: float = 2.0,
        lock: AbstractContextManager[object] | None = None,
        robust: RobustRule | None = None,
        staged: bool | None = None,
        quasi_global_momentum: float = 0.0,
        mix_momentum: bool = False,
        local_group: LocalGroup | None = None,
        model: torch.nn.Module | None = None,
        average_buffers: bool = True,
        shard: bool = False,
    ) -> None:
        if average_every != AUTO and not (isinstance(average_every, int) and average_every >= 1):
            raise ValueError(f"average_every must be >= 1 or 'auto', got {average_every!r}")
        algorithm.check(
            topology=topology,
            codec=compression,
            robust=robust,
            average_every=average_every,
            outer_step=outer_lr is not None,
            quasi_global_momentum=quasi_global_momentum,
            mix_momentum=mix_momentum,
            local_ranks=local_group is not None,
        )
        if local_group is not None:
            local_group.check_network(peer)
        self.local_group = local_group
        self.shard = shard
        super().__init__(optimizer.param_groups, optimizer.defaults)  # torch's hooks and step profiling
        self.param_groups = optimizer.param_groups  # the same groups and state as the wrapped one
        self.state = optimizer.state
        self.optimizer = optimizer
        self.peer = peer
        self.average_every = average_every
        min_h = MIN_LOCAL_STEPS if outer_lr is not None else 1
        # with "auto" the machine's H is its local rank 0's, handed to the others after each round
        decides = average_every == AUTO and (local_group is None or local_group.rank == 0)
        self.period_agreement = PeriodAgreement(min_h=min_h) if decides else None
        self._machine_h = min_h
        self._steps_since_round = 0
        self._round_ran = False
        self._last_step_end: float | None = None
        self.step_count = 0  # the mesh's: with the steps skipped to catch up, or taken in by joining
        self.steps_skipped = 0
        # the step count training ends at, where known (the daemon's --steps): see _mix
        self.step_budget: int | None = None
        self.final_round: RoundStats | None = None  # the final exchange's (finish)
        self.last_round: RoundStats | None = None
        self.phases = PhaseTimer(peer.now)
        self.consensus_estimate: float | None = None
        self._before_mixing: np.ndarray | None = None
        self._steps_since_sample = 0
        self._overlapping = False  # forward pre-hooks wait for the upload (overlap_upload)
        # one lock for the local step and the mixing: a background exchanger mixes at any time
        self._lock = lock if lock is not None else threading.Lock()
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        shards = _shards(self._params, model, local_group) if shard else None
        if shards is None and is_sharded(self._params):
            raise ValueError(
                "the parameters are DTensors (a fully_shard-ed model): pass shard=True, with the "
                "machine's local_group and the model"
            )
        replicated = local_group if shards is None else None  # DDP inside the machine
        self._gradients = BackwardAveraging(replicated, self._params) if replicated is not None else None
        # with mix_momentum, SGD's buffers are views of the vector gossip mixes, after the parameters
        self._mixed_momentum = momentum_buffers(optimizer, self._params) if mix_momentum else []
        buffers = averaged_buffers(model) if model is not None and average_buffers else []
        self.flat = FlatParameters(
            shards.local if shards is not None else self._params,
            buffers=buffers,
            extras=self._mixed_momentum,
            staged=staged,
            tail=shards.tail if shards is not None else 0,
        )
        if shards is not None:
            shards.bind()
        # CHOCO on a staged model mixes the model's own memory (on a GPU: cupy kernels on the
        # device, only the encoded frames staged); the outer step and the others need the host copy
        buckets = self.flat.buckets
        self.mixes_in_place = (
            local_group is None
            and self.flat.staged
            and algorithm.compresses
            and outer_lr is None
            and len(buckets) == 1
            and buckets[0].dtype == torch.float32
            and shares_memory(buckets[0])
        )
        timed = TimedPeer(peer, self.phases)
        self.codec_agreement: CodecAgreement | None = None
        if isinstance(compression, AutoCodec):  # the mesh agrees on the codec of each epoch
            self.codec_agreement = CodecAgreement()
            compression = compression.bound(self.codec_agreement.value_for)
        agreements = [a for a in (self.period_agreement, self.codec_agreement) if a is not None]
        if self.mixes_in_place:
            mixed, layout = from_torch(buckets[0]), None
        elif replicated is not None:  # this rank's slice (a view: mixing writes the vector)
            lo, hi = replicated.bounds(self.flat.array.size)[replicated.rank]
            mixed, layout = self.flat.array[lo:hi], self.flat.layout.slice(lo, hi)
        else:
            mixed, layout = self.flat.array, self.flat.layout
        agreeing = AgreeingPeer(timed, agreements) if agreements else None
        self.averager = algorithm.build(
            agreeing or timed,
            mixed,
            topology=topology,
            round_timeout=round_timeout,
            lock=self._lock,
            codec=compression,
            robust=robust,
            layout=layout,
        )
        if agreeing is not None:  # (proposals only from messages the algorithm took in)
            self.averager.on_accepted = agreeing.accepted
        self.outer = (
            OuterNesterov(self.flat.array, lr=outer_lr, momentum=outer_momentum)
            if outer_lr is not None
            else None
        )
        self.momentum = (
            QuasiGlobalMomentum(self.flat.param_segments, quasi_global_momentum)
            if quasi_global_momentum
            else None
        )
        self._rounds_at_start = 0
        self._started: float | None = None
        self._state = LiveState(
            self.flat,
            self._params,
            optimizer,
            self._lock,
            self._counters,
            background=self.averager.mixes_in_background,
        )
        self._state_server = StateServer(peer, self._state)
        self.last_transfer: TransferStats | None = None  # how this node's state arrived, if it joined

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """The wrapped optimizer's step (with ``closure``, as torch's), then a gossip round when
        one is due; returns what the wrapped step returned."""
        if self._started is None:
            self._started = self.peer.now()
            self._state_server.start()  # (before the first round, which may wait seconds for the others)
        if self._gradients is not None:  # one replica: every rank takes the mean gradient
            if closure is not None:
                with torch.enable_grad():
                    closure_loss = closure()
                closure = lambda: closure_loss  # noqa: E731 - the step returns what it returned
            self._gradients.before_step()
        background = self.averager.mixes_in_background
        with self._lock:
            self.flat.wait_for_upload()  # (what no forward pass waited for: the step writes it)
            if background:
                self.flat.copy_to_device()  # what the exchanger mixed in since the last step
            self._estimate_consensus()
            if self.momentum is not None:
                self.momentum.before_step()
            loss = self.optimizer.step(closure)
            if self.momentum is not None:
                self.momentum.after_step()
            self.step_count += 1
            self._steps_since_round += 1
            round_due = self._steps_since_round >= self.steps_per_round
            self._steps_since_sample += 1
            sampled = round_due and self._steps_since_sample >= CONSENSUS_EVERY
            if sampled or ((round_due or background) and not self.mixes_in_place):
                self.flat.copy_to_host()
            if sampled:
                self._before_mixing = self._consensus_sample().copy()
                self._steps_since_sample = 0
        if self.period_agreement is not None and self._last_step_end is not None:
            self.period_agreement.observe(step_s=self.peer.now() - self._last_step_end)
        self._round_ran = round_due
        if round_due:
            round_started = self.peer.now()
            with self.phases.round():
                self._gossip()
            self._steps_since_round = 0
            if self.period_agreement is not None:
                self.period_agreement.observe(round_s=self.peer.now() - round_started)
            if self.codec_agreement is not None:
                self.codec_agreement.observe(self.averager.round - 1, self.phases.last)
        self._last_step_end = self.peer.now()
        return loss

    @property
    def steps_per_round(self) -> int:
        """H before the next round: ``average_every``, or the mesh's agreed one with ``"auto"``."""
        agreement = self.period_agreement
        if agreement is not None:
            return agreement.value_for(self.averager.round)
        return self._machine_h if self.average_every == AUTO else int(self.average_every)

    @property
    def steps_since_round(self) -> int:
        """Local steps taken since the last gossip round (0: the model is as that round left it)."""
        return self._steps_since_round

    @property
    def round_ran(self) -> bool:
        """Whether the last :meth:`step` ran a gossip round."""
        return self._round_ran

    def _gossip(self) -> None:
        """A gossip round, with the outer step around it in local-steps training: after the
        mixing; or, when the algorithm mixes a round late, before it, so the new anchor is what
        goes out and mixing corrects the anchor without passing through the outer momentum
        (momentum on a one-round-old correction diverges). Either way the outer step is held
        after a round that mixed too little (``OuterNesterov.after_mixing``): before the mixing,
        that is the last round; and on a round that skipped ahead to catch up with the mesh."""
        outer, params = self.outer, self.flat.array
        if self.local_group is not None:
            self.local_group.share_view(self.peer)
        if outer is not None and self.averager.overlap:
            with self._lock:
                last = self.last_round
                outer.after_mixing(params, last.expected if last else 0, last.arrived if last else 0)
            self._mix()
            with self._lock:
                outer.move_anchor(params)
                self._upload()
            return
        caught_up = self._mix()
        with self._lock:
            if outer is not None:
                self._estimate_consensus(from_device=self.mixes_in_place)  # (before it moves them)
                mixed = self.last_round
                if mixed is None:  # an algorithm that mixes in the background: no round to judge
                    outer.step(params)
                else:
                    outer.after_mixing(params, mixed.expected, mixed.arrived, caught_up=caught_up)
            if not self.mixes_in_place:
                self._upload()

    def _mix(self) -> bool:
        """The algorithm's round; on a machine of local ranks, then every rank's mixed slice
        to the others, so all hold the same parameters again. Whether the round skipped ahead
        to catch up with the mesh: the step count then moves on by the skipped rounds' steps, as
        a joiner's takes the mesh's, so a straggler's step budget ends with the mesh's rounds
        (it took fewer steps of its own) rather than alone, after its neighbours left."""
        start = self.averager.round
        if self.step_budget is not None:  # (a skip never moves the count past the budget)
            left = max(0, self.step_budget - self.step_count)
            self.averager.skip_limit = start + left // self.steps_per_round
        self.last_round = self.averager.after_step()
        skipped = self.averager.round - start - 1
        if skipped > 0:
            self.steps_skipped += skipped * self.steps_per_round
            self.step_count += skipped * self.steps_per_round
        self._share_on_machine()
        group = self.local_group
        if group is not None and self.average_every == AUTO:  # every rank steps to rank 0's H
            agreement = self.period_agreement
            h = agreement.value_for(self.averager.round) if agreement is not None else None
            self._machine_h = group.share_int(h)
        return skipped > 0

    def _share_on_machine(self) -> None:
        """On a machine of local ranks (not sharded), every rank's mixed slice to the others."""
        if self.local_group is not None and not self.shard:
            with self._lock:
                self.local_group.share_slices(self.flat.array)

    def finish(self, wait_s: float = FINAL_WAIT_S) -> RoundStats:
        """Once training ended (before :meth:`close`), mix the final models once with the
        neighbours', waiting for each (``Averager.finish``): the models a run leaves agree.
        Background exchanges stop first. A :class:`~gossipmesh.daemon.lifecycle.Session` and
        the daemon call it; call it in a loop of your own (on every local rank). Once: a
        second call returns the first's figures."""
        if self.final_round is not None:
            return self.final_round
        self.averager.close()
        if not self.mixes_in_place:
            with self._lock:
                self.flat.copy_to_host()
        self.final_round = self.averager.finish(wait_s)  # (it takes the lock to write)
        self._share_on_machine()
        with self._lock:
            if self.outer is not None:
                self.outer.move_anchor(self.flat.array)
            if not self.mixes_in_place:
                self.flat.copy_to_device()
        return self.final_round

    def _upload(self) -> None:
        """Queue the mixed parameters' upload (the host goes on; on a GPU the next forward pass
        waits for it on the device: all of it, or module by module after :meth:`overlap_upload`).
        Nothing writes the host copy before the next step's ``copy_to_host``, which waits."""
        self.flat.copy_to_device(blocking=False)
        if not self._overlapping:
            self.flat.wait_for_upload()

    def overlap_upload(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module] | None = None) -> None:
        """Let the next forward pass of ``model`` start while the mixed parameters still upload
        to the device, each block (``blocks``; None: the items of the model's largest
        ModuleList or Sequential) waiting only for its own parameters (forward pre-hooks, kept
        for the optimizer's life; see ``gossip.buffers.staging`` for what this asks of the model). Only
        a model on a GPU uploads in the background; elsewhere, and for a sharded model (FSDP
        gathers a block from its shards before the block's hooks run), this does nothing."""
        overlaps = self.flat.uploads_in_background and not self.mixes_in_place and not self.shard
        if overlaps and not self._overlapping:
            self.flat.overlap_upload(model, blocks)
            self._overlapping = True

    def _estimate_consensus(self, *, from_device: bool = True) -> None:
        """How far mixing (in the round, or in the background since) moved the model from its
        copy taken after the last sampled local step: before the next local step, or, with an
        outer step, between mixing and the outer step (``from_device``: the device has the
        newest parameters, as it has before a local step in every mode)."""
        if self._before_mixing is not None:
            if from_device:
                self.flat.copy_to_host()
            self.consensus_estimate = relative_distance(self._consensus_sample(), self._before_mixing)
            self._before_mixing = None

    def _consensus_sample(self) -> np.ndarray:
        """The parameters the consensus estimate compares: every k-th, at most CONSENSUS_SAMPLE."""
        params = self.flat.param_array
        return params[:: max(1, params.size // CONSENSUS_SAMPLE)]

    def close(self) -> None:
        """Stop the algorithm's background work and answering newcomers (call when training ends)."""
        self.averager.close()
        self._state_server.close()
        if self._gradients is not None:
            self._gradients.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "flat"):  # (torch's own __init__ adds the wrapped groups)
            raise ValueError(
                "a GossipOptimizer averages the parameters it was built with; give the wrapped "
                "optimizer every parameter group before wrapping it"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, with the gossip state under ``"gossip"``: the
        local-step and round counters and, with an outer step, its anchor and momentum."""
        state = super().state_dict()  # the wrapped optimizer's groups and state (shared)
        gossip: dict[str, Any] = {"steps": self.step_count, "round": self.averager.round}
        if self.outer is not None:
            gossip["outer_anchor"] = torch.from_numpy(self.outer.anchor.copy())
            gossip["outer_velocity"] = torch.from_numpy(self.outer.velocity.copy())
        if self.momentum is not None:
            gossip["quasi_global_velocity"] = [v.detach().cpu().clone() for v in self.momentum.velocity]
        state[GOSSIP_STATE] = gossip
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (load the model's own state dict first: the parameters
        come from the model). The node continues from the saved round; a state dict of the
        wrapped optimizer alone (no ``"gossip"``) keeps the counters as they are."""
        state = dict(state_dict)
        gossip = state.pop(GOSSIP_STATE, None)
        super().load_state_dict(state)
        # torch made new group and state objects: the wrapped optimizer takes them (and its defaults)
        self.optimizer.__setstate__({"state": self.state, "param_groups": self.param_groups})
        with self._lock:
            if self._mixed_momentum:  # the loaded buffers into the vector gossip mixes
                rebind(self.optimizer, self._params, self._mixed_momentum)
            self.flat.copy_to_host()
            if gossip is None:
                return
            self.step_count = saved_step_count(gossip)
            fixed = self.average_every != AUTO
            self._steps_since_round = self.step_count % self.steps_per_round if fixed else 0
            self.averager.restart(int(gossip["round"]))
            self._rounds_at_start = self.averager.round
            if self.outer is not None:
                self.outer.reset(self.flat.array)
                if "outer_anchor" in gossip:
                    np.copyto(self.outer.anchor, gossip["outer_anchor"].numpy())
                    np.copyto(self.outer.velocity, gossip["outer_velocity"].numpy())
            if self.momentum is not None:
                self.momentum.restart()
                if "quasi_global_velocity" in gossip:
                    for velocity, saved in zip(
                        self.momentum.velocity, gossip["quasi_global_velocity"], strict=True
                    ):
                        velocity.copy_(saved)

    @property
    def round(self) -> int:
        """The next gossip round (for adpsgd: the model version); a node that stops after its
        last round leaves with ``peer.leave(after_round=optimizer.round - 1)``."""
        return self.averager.round

    def _own_report(self, averaged: dict[str, float]) -> dict[str, float]:
        """The counters kept here: with an outer step, the rounds that did not take it (mixed
        too little, or caught up); where rounds are skipped (``averaged``'s ``rounds_skipped``),
        the steps the step count moved on by with them."""
        figures: dict[str, float] = {}
        if self.outer is not None:
            figures["outer_rounds_held"] = self.outer.rounds_held
        if "rounds_skipped" in averaged:
            figures["steps_skipped"] = self.steps_skipped
        if self.final_round is not None:
            figures["final_expected"] = self.final_round.expected
            figures["final_mixed"] = self.final_round.arrived
        return figures

    def statistics(self) -> GossipStatistics:
        """This node's gossip so far (rounds, staleness, rejections, where the time went)."""
        averager = self.averager
        averaged = averager.report()
        return GossipStatistics(
            round=averager.round,
            rounds_per_s=self.rounds_per_s,
            fallback_rounds=averager.fallback_rounds,
            staleness={**averaged, **self._own_report(averaged)},
            rejected=dict(averager.rejected),
            dropped=dict(averager.dropped),
            phase_seconds={phase: round(s, 4) for phase, s in self.phases.totals.items()},
            consensus=self.consensus_estimate,
            local_steps_per_epoch=list(self.period_agreement.history if self.period_agreement else []),
            codec_per_epoch=[
                (first, str(AUTO_LADDER[level]))
                for first, level in (self.codec_agreement.history if self.codec_agreement else [])
            ],
        )

    def footprint(self) -> dict[str, int]:
        """What this process holds of the model (with ``shard``: of its shard): ``parameters``,
        their bytes, and the bytes of the wrapped optimizer's state (its tensors' here)."""
        local = [local_tensor(p) for p in self._params]
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {
            "parameters": sum(t.numel() for t in local),
            "parameter_bytes": sum(t.numel() * t.element_size() for t in local),
            "optimizer_state_bytes": sum(local_tensor(v).numel() * v.element_size() for v in state),
        }

    @property
    def rounds_per_s(self) -> float:
        """This node's gossip rate so far (0 before its first round)."""
        if self._started is None:
            return 0.0
        return (self.averager.round - self._rounds_at_start) / max(self.peer.now() - self._started, 1e-6)

    # -- joining a running mesh ---------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The training state a newcomer needs (parameters, optimizer buffers, counters), whole:
        a checkpoint's. Newcomers are served from the live state, a chunk at a time."""
        return self._state.snapshot()

    def _counters(self) -> dict[str, float]:
        return {
            "steps": self.step_count,
            "round": self.averager.round,
            "rounds_per_s": round(self.rounds_per_s, 3),
        }

    def restore(self, snapshot: Snapshot) -> None:
        """Load a snapshot from another node (validated against this model first)."""
        reference = self.flat.model_array  # (its "params": the parameters, then the buffers)
        self._check_fit((name, array.dtype, array.shape) for name, array in snapshot.tensors.items())
        with self._lock:
            self.flat.copy_to_host()  # (waits for an upload still reading the host copy)
            np.copyto(reference, snapshot.tensors["params"])
            for name, array in snapshot.tensors.items():
                if name.startswith(BUFFER_PREFIX):
                    self._load_optimizer_buffer(name.removeprefix(BUFFER_PREFIX), array)
            scalars = {n: a for n, a in snapshot.tensors.items() if n.startswith(SCALAR_PREFIX)}
            self._loaded(scalars)
        self.step_count = saved_step_count(snapshot.counters)

    def _loaded(self, scalars: Mapping[str, np.ndarray]) -> None:
        """After a state's parameters (in the host copy) and optimizer buffers were loaded, under
        the lock: the parameters to the device, the one-value entries as the optimizer keeps
        them, the momentum (mixed or about to be) anew."""
        self.flat.copy_to_device()
        if self.momentum is not None:
            self.momentum.restart()
        for name, values in scalars.items():
            self._load_optimizer_scalar(name.removeprefix(SCALAR_PREFIX), values)
        if self._mixed_momentum:
            rebind(self.optimizer, self._params, self._mixed_momentum)
            self.flat.copy_to_host()

    def share_state(self) -> None:
        """Give every local rank local rank 0's training state and round (a collective: call it
        on all ranks after rank 0 joined a running mesh with :meth:`join_from`). With
        ``shard``, every rank holds the state of its own shard (taken with :meth:`join_from` on
        every rank, or its own checkpoint's): only rank 0's step count and round go over."""
        group = self.local_group
        if group is None:
            raise ValueError("share_state is for a GossipOptimizer with a local_group")
        if self.shard:
            first_round = group.share_int(self.averager.round if group.rank == 0 else None)
            steps = group.share_int(self.step_count if group.rank == 0 else None)
            if group.rank > 0:
                self.step_count = steps
                self._start_at(first_round)
            return
        snapshot = group.share_snapshot(self.snapshot() if group.rank == 0 else None)
        if group.rank == 0:
            return
        self.restore(snapshot)
        self._start_at(int(snapshot.counters.get("round", 0)))

    def _start_at(self, first_round: int) -> None:
        """Take part in gossip from round ``first_round`` on (the outer step anchored at the
        parameters now)."""
        self.averager.restart(first_round)
        if self.outer is not None:
            self.outer.reset(self.flat.array)
        self._rounds_at_start = first_round

    def serve_state(self, wait: float = 0.0) -> int:
        """Answer newcomers' state requests waiting in the inbox (the first for up to ``wait``
        s), within ``gossip.state.server``'s limits; :meth:`step` does this by itself."""
        return self._state_server.serve(wait)

    def join_from(
        self,
        sources: Sequence[str],
        *,
        timeout: float,
        patience_s: float = math.inf,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> int:
        """Take the state of ``sources`` (chunks from all of them at once) unless this node
        has trained at least as far (one resumed from its own checkpoint), start a few rounds
        ahead (time for the mesh to hear: ``JOIN_LEAD_S`` at the sources' rate of rounds, at
        most ``MAX_ROUNDS_PER_S``), announce that round and return it. Raises
        StateTransferError (see ``gossip.state.fetch`` for ``patience_s`` and ``cancelled``);
        :attr:`last_transfer` says how it went.

        With ``shard`` every local rank calls it (a collective), with the same ``sources``: rank
        r takes its shard from rank r of each source; the try fails on every rank when one
        rank's does (the ranks take rank 0's counters after it, with :meth:`share_state`).

        The state's chunks are written straight into the model and the optimizer's buffers as
        they arrive (``gossip.state.live.StateWriter``): no copy of the state is held."""
        max_bytes = 4 * self.flat.array.nbytes + (1 << 16)
        writer: StateWriter | None = None

        def into_model(manifest: Manifest) -> StateSink:
            """The chunks straight into the model and optimizer, unless this node has trained
            as far (then they are read and let go)."""
            nonlocal writer
            if saved_step_count(manifest.counters) <= self.step_count:
                return Discard()
            writer = StateWriter(self.flat, self._params, self.optimizer, self._lock, manifest.entries)
            return writer

        group = self.local_group if self.shard else None  # (each rank takes its own shard)
        try:
            snapshot, self.last_transfer = fetch_state(
                self.peer,
                sources,
                timeout=timeout,
                max_bytes=max_bytes,
                patience_s=patience_s,
                cancelled=cancelled,
                fits=lambda manifest: self._check_fit((e.name, e.dtype, e.shape) for e in manifest.entries),
                sink=into_model,
            )
        except StateTransferError:
            if group is not None:
                group.agree(True)  # (the others' try ends with this one)
            raise
        if group is not None and group.agree(False):
            raise StateTransferError(f"another local rank took no state from {', '.join(sources)}")
        if writer is not None:
            with self._lock:
                self._loaded(writer.scalars)
            self.step_count = saved_step_count(snapshot.counters)
        rate = min(snapshot.counters.get("rounds_per_s", 0.0), MAX_ROUNDS_PER_S)
        lead = math.ceil(rate * JOIN_LEAD_S) + 2
        first_round = int(snapshot.counters.get("round", 0)) + lead
        self._start_at(first_round)
        self.peer.start_at_round(first_round)
        return first_round

    def _check_fit(self, layout: Layout) -> None:
        """Raise StateTransferError unless a state of ``layout`` fits this model."""
        check_fit(layout, self.flat.model_array, self.flat.param_array, len(self._params))

    def _load_optimizer_scalar(self, key: str, values: np.ndarray) -> None:
        """One value a parameter (Adam's step count), as torch's optimizers keep it: a 0-d
        tensor of the scalar dtype, on the parameter's device where the step runs there."""
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        on_device = {
            id(p) for g in self.param_groups if g.get("capturable") or g.get("fused") for p in g["params"]
        }
        for param, value in zip(self._params, values.tolist(), strict=True):
            device = param.device if id(param) in on_device else torch.device("cpu")
            self.optimizer.state[param][key] = torch.tensor(value, dtype=scalar_dtype, device=device)

    def _load_optimizer_buffer(self, key: str, flat: np.ndarray) -> None:
        """Each parameter's part of ``flat`` into its buffer ``key`` (made like the parameter,
        a DTensor for a shard, where it has none or one of another shape)."""
        offset = 0
        for param in self._params:
            state = self.optimizer.state[param]
            buffer = state.get(key)
            if not isinstance(buffer, torch.Tensor) or buffer.shape != param.shape:
                buffer = state[key] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            local = local_tensor(buffer)
            local.copy_(torch.from_numpy(flat[offset : offset + local.numel()]).view_as(local))
            offset += local.numel()
