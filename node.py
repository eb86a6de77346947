"""The gossipmesh daemon: config -> wiring (peer, task, model, trainer) -> training loop ->
graceful stop (leave the mesh, write the report); and the ``gossipmesh`` console entry point.

``gossipmesh node`` runs :func:`run_node`; the other commands (``mesh``, ``simulate``,
``topology``, ``report``, ``keygen``) are ``gossipmesh.cli``'s. ``python node.py ...`` is
``gossipmesh ...``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gossipmesh import logs
from gossipmesh.cli import main as cli_main
from gossipmesh.cli.main import user_errors
from gossipmesh.config import ConfigError, NodeConfig, summary
from gossipmesh.console import emit, say
from gossipmesh.report import NodeRecord, Progress, build_report, node_record, write_array, write_json

if TYPE_CHECKING:
    import numpy as np
    import torch

    from p2p import LocalRankPeer, Peer

log = logging.getLogger(logs.NODE_LOGGER)


def run_node(config: NodeConfig, stop: threading.Event) -> NodeRecord:
    """Run one daemon until its steps or duration are spent or ``stop`` is set.

    The report (and the final parameters, if asked) are written whatever happens once the
    node's network is made (a node that cannot bind its port reports that too). Raises
    TransportError / AddressError / TopologyError / StatusServerError for what the user must fix.
    """
    # the daemon's modules import torch (seconds): here, once a node trains, so that every other
    # command and every config error answers at once
    import torch

    from gossip.buffers.flat import host_vector
    from gossip.buffers.shards import shard_model, whole_parameters
    from gossipmesh.daemon.lifecycle import join_machine, member, resume, share_cores
    from gossipmesh.daemon.local_ranks import gather_rank_records
    from gossipmesh.daemon.metrics import NodeMetrics
    from gossipmesh.daemon.status_server import StatusServer
    from gossipmesh.daemon.trainer import Trainer
    from p2p import Peer
    from p2p.security.curve import insecure_warning

    origin = config.clock_origin if config.clock_origin is not None else time.time()

    def clock() -> float:
        """The report clock: seconds since the mesh (or this lone node) started."""
        return time.time() - origin

    if config.threads:
        torch.set_num_threads(config.threads)
    config, group = join_machine(config)
    task = config.task.make()
    model = config.dtype.apply(task.model(config.seed)).to(config.device)
    if config.shard:  # (FSDP2 over the machine's ranks, before the optimizer takes the shards)
        shard_model(model)
    # (torch's first optimizer imports for seconds: before joining, not between joining a running
    # mesh and taking its state, while the mesh may end)
    local_optimizer = config.local_optimizer(model)
    if config.insecure:
        say(config.progress, f"WARNING: {insecure_warning()}")
    joined = member(config, model, group, clock)
    node_id, checkpoint, entry, peer = joined.node_id, joined.checkpoint, joined.entry, joined.peer
    peer.transport.on_failure = lambda _: stop.set()  # a node whose network died must not train on
    metrics = NodeMetrics(stale_after_s=config.startup_timeout + 10 * config.round_timeout)
    metrics.peer = peer if isinstance(peer, Peer) else None  # (a machine's rank 0 serves metrics)
    status: StatusServer | None = None
    trainer: Trainer | None = None
    rank, outcome, error = -1, "failed", None
    when: dict[str, Any] = {}  # resumed_from, t_joined
    # what --save-params writes: the model's parameters (a sharded model's once gathered)
    whole: torch.nn.Module | np.ndarray | None = None if config.shard else model

    def cancelled() -> bool:
        metrics.beat()  # waiting for peers is the daemon's loop making progress
        return stop.is_set()

    started = time.monotonic()
    try:
        peer.start()  # (a network thread that dies while it starts still leaves a report)
        where = (  # (a --no-listen node's address names its inbound route, not a port)
            f"dialing out only (--no-listen), through {', '.join(config.bootstrap)}"
            if config.no_listen
            else f"listening on {peer.address}"
        )
        say(config.progress, f"{node_id} {where}", event="listening", address=peer.address)
        if config.metrics_port is not None:
            status = StatusServer(metrics, config.metrics_port, config.metrics_host)
            say(config.progress, f"{node_id} metrics on :{status.port}/metrics", metrics_port=status.port)
        ordered = entry.wait_for_members(peer, cancelled, group)
        shared = share_cores(config, peer, ordered, group)
        if shared is not None:
            say(config.progress, f"{node_id}: {shared}")
        rank = ordered.index(node_id)
        config.graph.graph(len(ordered))  # fail now if the topology is undefined for this mesh
        emit(config.progress, {"event": "ready", "id": node_id, "rank": rank, "members": ordered})
        trainer = Trainer(
            config,
            task,
            model,
            peer,
            rank,
            clock,
            local_optimizer,
            metrics,
            local_group=group,
        )
        checkpoint = resume(config, checkpoint, trainer.resume)
        if checkpoint is not None:
            when["resumed_from"] = str(checkpoint.path)
            say(config.progress, f"{node_id} resumed from {checkpoint.path} (step {trainer.steps})")
        transfer = entry.come_in(peer, trainer.optimizer, ordered, cancelled)
        trainer.came_in(transfer)
        if transfer is not None:
            when["t_joined"] = round(clock(), 3)
        if group is not None or not stop.is_set():  # (a machine's ranks agree on stopping in run)
            trainer.run(stop)
        peer.transport.check_running()  # a network that died stopped training: that is a failure
        if group is not None:
            gathered = host_vector(whole_parameters(model))  # (with --shard: a collective)
            whole = gathered
            mine = trainer.optimizer.flat.model_array if config.shard else gathered
            when["local_ranks"] = gather_rank_records(
                group, peer, trainer.steps, trainer.data_batches, mine, trainer.optimizer.footprint()
            )
        outcome = "finished"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, user_errors()):
            raise
        log.exception("training failed")
    finally:
        metrics.leaving()
        peer.close()
        if status is not None:
            status.close()
        record = node_record(
            id=node_id,
            rank=rank,
            address=peer.address,
            status=outcome,
            device=config.device,
            progress=trainer.progress if trainer is not None else Progress(),
            gossip=trainer.optimizer.statistics() if trainer is not None else None,
            network=peer.stats,
            error=error,
            **when,
        )
        _save(config, record, whole, peer, time.monotonic() - started)
    return record


def _save(
    config: NodeConfig,
    record: NodeRecord,
    whole: torch.nn.Module | np.ndarray | None,
    peer: Peer | LocalRankPeer,
    wall_time_s: float,
) -> None:
    """The report first (it says what happened, whatever fails after it), then the parameters
    of the model ``whole`` (or gathered already; None: a sharded machine that failed, whose
    shards cannot be gathered)."""
    import torch

    from gossip.buffers.flat import host_vector
    from p2p import Peer

    if config.report is not None:
        report = build_report(
            wall_time_s=round(wall_time_s, 3),
            config=summary(config),
            nodes=[asdict(record)],
            consensus_distance=0.0,
            membership_events=peer.membership.events if isinstance(peer, Peer) else [],
        )
        write_json(config.report, report)
    if config.save_params is not None and whole is not None:
        params = host_vector(whole.parameters()) if isinstance(whole, torch.nn.Module) else whole
        write_array(config.save_params, params)


# -- command line ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``gossipmesh ARGV``; each node of a local mesh runs this too."""
    return cli_main(argv, run_node=node_command, node_main=main)


def node_command(config: NodeConfig) -> int:
    """``gossipmesh node``: run the daemon until done or signalled (a second signal stops it now)."""
    from gossipmesh.daemon.local_ranks import RankPlace, supervise  # (torch.distributed)

    logs.configure(config.log_format)
    if config.clock_origin is None:  # a lone node's report counts from its launch (t_first_step)
        config = replace(config, clock_origin=_process_start())
    place = RankPlace.from_environment()
    if place is None and config.local_ranks > 1:  # this process supervises the machine's ranks
        return supervise(config.local_ranks, lambda: node_command(config))
    if place is not None and config.local_ranks not in (1, place.size):
        raise ConfigError(
            f"--local-ranks {config.local_ranks}, but LOCAL_WORLD_SIZE={place.size} (torchrun's "
            "--nproc-per-node): give one of them"
        )
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        log.info("%s: finishing the current step", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    record = run_node(config, stop)
    if record.status == "failed":
        log.error("gossipmesh: node failed: %s", record.error)
        return 1
    final = record.final
    say(
        config.progress,
        f"{record.id} finished: {record.steps} steps, held-out accuracy "
        f"{final.get('accuracy', math.nan):.3f}, loss {final.get('loss', math.nan):.4f}",
    )
    return 0


def _process_start() -> float:
    """When this process started, on the wall clock (from /proc; elsewhere: now), so that the
    interpreter's start and the imports count in the report's times."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.time()


def cli() -> None:
    """The console entry point: ``main``, then exit without tearing down the interpreter.

    Everything the run owns (report, sockets) is closed by then; skipping the interpreter's
    teardown of torch saves ~2 s per process, which adds up in a mesh on few cores.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
