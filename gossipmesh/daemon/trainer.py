"""The training loop of one node: local steps through the gossip optimizer, paced, recorded.

How a node comes in (with the mesh from round 0, or with the state of members that train) is
``gossipmesh.daemon.lifecycle``'s; the optimizer's ``step()`` answers joiners' state requests.
With a state folder the node checkpoints every few steps and when it stops, and a restarted
node resumes from its newest checkpoint that fits (then takes the members' state only if they
trained further). A checkpoint or ``--live-params`` copy that cannot be written (a full disk, a
directory in the way) is counted and tried again later (:class:`RetriedWrite`); training goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gossip.buffers.flat import host_vector
from gossip.buffers.shards import release, whole_parameters
from gossip.optim.local_group import LocalGroup
from gossip.state.fetch import TransferStats
from gossipmesh.config import NodeConfig
from gossipmesh.console import emit, progress_line, say
from gossipmesh.daemon.byzantine import ByzantinePeer
from gossipmesh.daemon.checkpoint import Checkpoint, checkpoint_due
from gossipmesh.daemon.lifecycle import restore_state, save_state, saved_count
from gossipmesh.daemon.local_ranks import data_shard
from gossipmesh.daemon.metrics import NodeMetrics
from gossipmesh.daemon.pacing import StepPacer
from gossipmesh.daemon.recorder import Recorder
from gossipmesh.report import Progress, TimelinePoint, write_array
from gossipmesh.tasks import Batches, Evaluation, Task
from p2p import LocalRankPeer, Peer
from p2p.security.ratelimit import QuietLog

_LOSS_SMOOTHING = 0.9
_TEXT_PROGRESS_EVERY_S = 1.0
WRITE_RETRY_S = 10.0  # a checkpoint or live copy that failed (disk full...) is tried again after this
LIVE_PARAMS_EVERY_S = 1.0  # --live-params: the least time between two copies
log = logging.getLogger(__name__)


class RetriedWrite:
    """A file the node writes again and again (checkpoints, live parameters): a write that
    fails is logged (once a minute at most) and tried again after ``WRITE_RETRY_S``, and training
    goes on (the previous file is still whole: every write replaces it atomically)."""

    def __init__(self, what: str, node_id: str, where: Path | None) -> None:
        self._what, self._node_id, self._where = what, node_id, where
        self._retry_at: float | None = None  # set while a failed write waits
        self._log = QuietLog(log, interval_s=60.0)

    def due(self, scheduled: bool) -> bool:
        """Whether to write now: as ``scheduled``, or, after a failure, once its retry is due."""
        if self._retry_at is not None:
            return time.monotonic() >= self._retry_at
        return scheduled

    def write(self, write: Callable[[], object]) -> bool:
        """Run ``write``; False (logged, retried later) if the disk refused it."""
        try:
            write()
        except OSError as exc:
            self._retry_at = time.monotonic() + WRITE_RETRY_S
            self._log.warning(
                self._what,
                "%s: cannot write %s to %s (%s); training goes on, retrying every %g s",
                self._node_id,
                self._what,
                self._where,
                exc,
                WRITE_RETRY_S,
            )
            return False
        self._retry_at = None
        return True


class Trainer:
    """Runs one node's training and keeps its progress (steps, timeline, final model)."""

    def __init__(
        self,
        config: NodeConfig,
        task: Task,
        model: torch.nn.Module,
        peer: Peer | LocalRankPeer,
        rank: int,
        clock: Callable[[], float],
        local_optimizer: torch.optim.Optimizer,
        metrics: NodeMetrics | None = None,
        local_group: LocalGroup | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.model = model
        self.peer = peer
        self.rank = rank
        self.local_group = local_group
        self.clock = clock
        self.progress = Progress()
        self.train_loss = math.nan
        self.lock = threading.Lock()
        network = peer if config.byzantine is None else ByzantinePeer(peer, config.byzantine)
        self.optimizer = config.gossip_optimizer(
            local_optimizer, network, lock=self.lock, local_group=local_group, model=model, shard=config.shard
        )
        # a sharded model's evaluation is a collective: every rank evaluates when rank 0's point is due
        self._sharded = local_group if config.shard else None
        self.optimizer.overlap_upload(model)  # (on a GPU: the next forward overlaps the upload)
        self.recorder = Recorder(
            evaluate=self._evaluate,
            progress=self._progress,
            lock=self.lock,
            clock=clock,
            interval=config.eval_interval,
            on_point=self._show,
        )
        self._last_text = -math.inf
        self.metrics = metrics
        if metrics is not None:
            metrics.training = self
        self._sampler_at: tuple[torch.Tensor, int] | None = None  # where a resumed node's data left off
        self._data_batches_before = 0  # batches a machine's ranks drew in its lives before this one
        self._batches: Batches | None = None
        self._checkpoints = RetriedWrite("a checkpoint", peer.node_id, config.state_dir)
        self._live_params = RetriedWrite("the live parameters", peer.node_id, config.live_params)
        self._live_params_at = -math.inf  # when the next --live-params copy is due

    @property
    def steps(self) -> int:
        return self.progress.steps

    @property
    def data_batches(self) -> int:
        """Batches each rank of this machine has drawn from its shard, its earlier lives included
        (all ranks draw one a step, together)."""
        return self._data_batches_before + (self._batches.drawn if self._batches is not None else 0)

    @property
    def evaluation(self) -> tuple[float, float] | None:
        """Held-out (loss, accuracy) at the last timeline point."""
        timeline = self.recorder.timeline
        return (timeline[-1].loss, timeline[-1].accuracy) if timeline else None

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint of this node: model, optimizer, counters, RNG, data order
        (checked whole first: what does not fit raises before anything changed)."""
        counters = checkpoint.counters
        pass_start = torch.from_numpy(checkpoint.tensors["sampler.pass_start"].copy())
        used, batches = saved_count(counters, "sampler_used"), saved_count(counters, "data_batches", 0)
        restore_state(checkpoint, self.optimizer)
        self.progress.steps = self.optimizer.step_count
        self._sampler_at = (pass_start, used)
        self._data_batches_before = batches

    def checkpoint(self) -> None:
        """Write a checkpoint to the state folder (see ``gossipmesh.daemon.lifecycle.save_state``)."""
        assert self.config.state_dir is not None and self._batches is not None
        pass_start, used = self._batches.position()
        save_state(
            self.config.state_dir,
            self.progress.steps,
            self.optimizer,
            self.peer.node_id,
            tensors={"sampler.pass_start": pass_start.numpy()},
            counters={"sampler_used": used, "data_batches": self.data_batches},
        )

    def came_in(self, transfer: TransferStats | None) -> None:
        """This node took a running mesh's state (``transfer``), resumed, or began: it goes on
        from its optimizer's step count (on a machine of local ranks, rank 0's)."""
        self.progress.steps = self.optimizer.step_count
        if transfer is None:
            return
        self.progress.state_transfer = transfer.summary()
        say(
            self.config.progress,
            f"{self.peer.node_id} took the state of {', '.join(transfer.chunks)} ({transfer.bytes / 1e6:.1f} "
            f"MB in {transfer.seconds:.2f} s, {transfer.mb_per_s:.0f} MB/s); trains from round "
            f"{self.optimizer.round}",
        )

    def run(self, stop: threading.Event) -> None:
        config, progress = self.config, self.progress
        members = max(len(self.peer.members()), self.rank + 1)  # (a joiner's mesh may be ending)
        group = self.local_group
        shard_index, shards = data_shard(self.rank, members, group)  # each rank of each machine its own
        shard = self.task.shard(shard_index, shards, partition=config.partition, seed=config.seed)
        progress.shard = shard.describe(config.partition)
        pacer = StepPacer(config.compute_ms, config.slowdown)
        budget = config.steps  # (None: until --duration, or until stopped)
        self.optimizer.step_budget = budget
        # --duration, on the report clock (a late joiner of a mesh stops when the others do), ends
        # at a round: with local steps, a model part way into its H steps holds what its own shard
        # alone pulled it to, far from the mesh's for a node whose neighbours pass it over
        deadline = config.duration if config.duration else math.inf
        progress.t_first_step = round(self.clock(), 3)
        self._batches = Batches(
            shard, config.batch_size, seed=config.seed + shard_index, resume=self._sampler_at
        )
        if group is not None:  # the other ranks go on from rank 0's count (with --shard: their own)
            before = group.share_int(self._data_batches_before if group.rank == 0 else None)
            if group.rank > 0 and self._sampler_at is None:
                self._batches.skip(before)
            self._data_batches_before = before
        checkpoints = config.state_dir is not None
        records = group is None or group.rank == 0  # (the other ranks hold the same model)
        if records and self._sharded is None:
            self.recorder.start()
        try:
            for inputs, targets in self._batches:
                done = (
                    stop.is_set()
                    or (budget is not None and progress.steps >= budget)
                    or (self.clock() >= deadline and self.optimizer.steps_since_round == 0)
                )
                if group is not None:
                    done = group.agree(done)  # the ranks of a machine stop at the same step
                if done:
                    break
                started = time.monotonic()
                inputs, targets = inputs.to(config.device), targets.to(config.device)
                with self._autocast():
                    loss = self.task.loss(self.model, inputs, targets)
                self.optimizer.zero_grad()
                loss.backward()
                pacer.finish_step(started)
                self.optimizer.step()  # (it answers newcomers' state requests too)
                before, progress.steps = progress.steps, self.optimizer.step_count  # (see _mix)
                self._smooth(loss.item())
                if self.metrics is not None:
                    self._observe(self.metrics)
                if checkpoints and self._checkpoints.due(
                    checkpoint_due(before, progress.steps, config.checkpoint_every)
                ):
                    self._try_checkpoint()
                if self._sharded is not None and self._sharded.agree(records and self.recorder.due()):
                    self._record(records)
            # at the run's planned end (its budget or --duration), which its neighbours reach
            # too, the final models mixed once more (Averager.finish); not when told to stop
            # (a leave, a signal), where they train on and would send no final model to wait for
            stopped = stop.is_set()
            if not (group.agree(stopped) if group is not None else stopped):
                self.optimizer.finish()
        finally:
            self.optimizer.close()
            self.peer.leave(after_round=self.optimizer.round - 1)
            if checkpoints:
                self._try_checkpoint()
            if records:
                final = self.recorder.stop()
                progress.timeline = self.recorder.timeline
                progress.final = {"loss": final.loss, "accuracy": final.accuracy}
            elif self._sharded is not None:  # (rank 0's last point gathers this rank's shards)
                self._record(records)

    def _record(self, records: bool) -> None:
        """A timeline point of a sharded model, on every rank (rank 0 ``records`` it)."""
        if records:
            self.recorder.record()
        else:
            with self.lock:
                self._evaluate()

    def _autocast(self) -> AbstractContextManager[object]:
        """Forward passes of a model narrower than float32 run under autocast (``--dtype``)."""
        return self.config.dtype.autocast(torch.device(self.config.device))

    def _evaluate(self) -> Evaluation:
        """A timeline point's evaluation (under the model lock); with ``--live-params``, a copy
        of the parameters too, at most every ``LIVE_PARAMS_EVERY_S``."""
        live = self.config.live_params
        copy = live is not None and self._live_params.due(time.monotonic() >= self._live_params_at)
        if self._sharded is not None:  # (gathering the shards is a collective: all ranks or none)
            copy = self._sharded.agree(copy)
        if copy:
            params = host_vector(whole_parameters(self.model))
            if live is not None and self._live_params.write(lambda: write_array(live, params, sync=False)):
                self._live_params_at = time.monotonic() + LIVE_PARAMS_EVERY_S
            elif live is not None:
                self.progress.live_params_failures += 1
        with self._autocast():
            evaluation = self.task.evaluate(self.model)
        release(self.model)
        return evaluation

    def _try_checkpoint(self) -> None:
        if not self._checkpoints.write(self.checkpoint):
            self.progress.checkpoint_failures += 1

    def _smooth(self, loss: float) -> None:
        if math.isnan(self.train_loss):
            self.train_loss = loss
        else:
            self.train_loss = _LOSS_SMOOTHING * self.train_loss + (1 - _LOSS_SMOOTHING) * loss

    def _observe(self, metrics: NodeMetrics) -> None:
        metrics.beat()
        if self.optimizer.round_ran:
            metrics.observe_round(self.optimizer.phases.last)

    def _progress(self) -> dict[str, Any]:
        return {
            "step": self.progress.steps,
            "batches": self.data_batches,
            "round": self.optimizer.round,
            "train_loss": self.train_loss,
            "bytes_sent": self.peer.stats.bytes_sent,
            "consensus": self.optimizer.consensus_estimate,
        }

    def _show(self, point: TimelinePoint) -> None:
        row = {
            "id": self.peer.node_id,
            "rank": self.rank,
            **asdict(point),
            "bytes_received": self.peer.stats.bytes_received,
            "peers": max(len(self.peer.members()) - 1, 0),  # after leaving, this node is not one
        }
        if self._sharded is not None:  # what rank 0 holds of the model (the others: about as much)
            footprint = self.optimizer.footprint()
            row["shard_bytes"] = footprint["parameter_bytes"] + footprint["optimizer_state_bytes"]
        if self.config.progress == "json":
            emit(self.config.progress, {"event": "point", **row})
        elif self.config.progress == "text" and point.t - self._last_text >= _TEXT_PROGRESS_EVERY_S:
            self._last_text = point.t
            say(self.config.progress, f"[{point.t:7.2f}s] {progress_line(row)}", event="progress", **row)
