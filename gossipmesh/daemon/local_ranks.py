"""A machine of several local ranks run by the daemon itself: ``gossipmesh node --local-ranks N``.

The command becomes the machine's supervisor, as ``torchrun``'s agent is: it forks one rank
process per device with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), passes SIGINT / SIGTERM on to them,
and when one rank fails it stops the others (rank 0 then leaves the mesh: the machine goes out
cleanly and the other machines go on). A rank dies with its supervisor (a machine that
crashes is detected as dead). Under torchrun each rank runs ``gossipmesh node`` directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, Protocol

import msgpack
import numpy as np
import torch.distributed as dist

from gossip.optim.local_group import LocalGroup
from gossipmesh.config import ConfigError, NodeConfig
from gossipmesh.logs import NODE_LOGGER
from p2p import TransportStats
from p2p.address import free_ports, split_endpoint

log = logging.getLogger(NODE_LOGGER)
_PR_SET_PDEATHSIG = 1


class Ranked(Protocol):
    """A local rank's network (``p2p.Peer`` or ``p2p.LocalRankPeer``), as its record reads it."""

    @property
    def address(self) -> str: ...
    @property
    def stats(self) -> TransportStats: ...


@dataclass(frozen=True)
class RankPlace:
    """Where this process is among its machine's ranks (from torchrun's environment)."""

    local_rank: int
    size: int

    @classmethod
    def from_environment(cls) -> RankPlace | None:
        """This process's place, or None when it is a machine of one rank. Raises ConfigError
        for a torchrun spanning several machines (the mesh, not torchrun, joins machines)."""
        try:
            size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            world = int(os.environ.get("WORLD_SIZE", str(size)))
            local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        except ValueError as exc:
            raise ConfigError(f"torchrun's environment: {exc}") from None
        if size <= 1:
            return None
        if world != size:
            raise ConfigError(
                f"WORLD_SIZE={world} but LOCAL_WORLD_SIZE={size}: start torchrun on each machine "
                "with --standalone (one machine's ranks); the gossip mesh joins the machines"
            )
        return cls(local_rank, size)


def collective_timeout(config: NodeConfig) -> float:
    """How long a local rank waits in a collective: rank 0 may be joining the mesh meanwhile."""
    return 2 * config.startup_timeout + 60 * config.round_timeout


def join_local_group(device: str, timeout_s: float) -> LocalGroup:
    """The machine's process group (gloo; nccl for a CUDA model), waiting up to ``timeout_s``
    for any collective: rank 0 may wait that long for the mesh while the others wait for it."""
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return LocalGroup.from_environment()


def data_shard(rank: int, members: int, group: LocalGroup | None) -> tuple[int, int]:
    """(index, count) of this process's part of the data: the member of place ``rank`` among
    ``members`` holds one part per local rank (``group``), consecutive."""
    ranks, local_rank = (1, 0) if group is None else (group.size, group.rank)
    return rank * ranks + local_rank, members * ranks


def rank_endpoint(endpoint: str, local_rank: int) -> str:
    """Local rank r's address: the host of ``endpoint``, its port + r (port 0 stays any)."""
    host, port = split_endpoint(endpoint)
    return f"tcp://{host}:{port + local_rank if port else 0}"


def share_members(group: LocalGroup, ordered: list[str] | None) -> list[str]:
    """Rank 0's ordered member list on every rank (the others pass None)."""
    data = msgpack.packb(ordered) if ordered is not None else None
    shared = msgpack.unpackb(group.share_bytes(data))
    if not isinstance(shared, list) or not all(isinstance(m, str) for m in shared):
        raise ValueError("local rank 0 shared no member list")
    return shared


def gather_rank_records(
    group: LocalGroup,
    network: Ranked,
    steps: int,
    data_batches: int,
    params: np.ndarray,
    footprint: Mapping[str, int],
) -> list[dict[str, Any]]:
    """Every rank's entry of the machine's record (``NodeRecord.local_ranks``; a collective);
    ``params_digest`` tells whether the ranks ended with bitwise-equal parameters (``params``:
    the model's, or with ``--shard`` the rank's shard), ``data_batches`` how far each rank is
    in its shard's order (over the machine's lives), the ``footprint`` what the rank holds
    (``GossipOptimizer.footprint``: parameters, their bytes, the optimizer state's bytes)."""
    mine = {
        **footprint,
        "local_rank": group.rank,
        "address": network.address,
        "steps": steps,
        "data_batches": data_batches,
        "bytes_sent": network.stats.bytes_sent,
        "bytes_received": network.stats.bytes_received,
        "bytes_local": group.bytes_local,
        "params_digest": hashlib.blake2b(params.tobytes(), digest_size=16).hexdigest(),
    }
    return [json.loads(entry) for entry in group.all_gather_bytes(json.dumps(mine).encode())]


def supervise(size: int, run_rank: Callable[[], int]) -> int:
    """Fork ``size`` rank processes, each running ``run_rank()`` with its torchrun environment;
    returns 0 when all finished, else the first failure's exit code."""
    (port,) = free_ports(1)
    pids: dict[int, int] = {}
    for rank in range(size):
        pid = os.fork()
        if pid == 0:
            _rank_child(rank, size, port, run_rank)
        pids[pid] = rank

    def forward(signum: int, _frame: FrameType | None) -> None:
        for pid in pids:
            _signal(pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        while pids:
            pid, status = os.wait()
            rank = pids.pop(pid, -1)
            exit_code = os.waitstatus_to_exitcode(status)
            if rank < 0 or exit_code == 0:
                continue
            log.error("local rank %d exited with %d; stopping the machine's other ranks", rank, exit_code)
            if code == 0:
                code = exit_code if exit_code > 0 else 128 - exit_code
                for other in pids:
                    _signal(other, signal.SIGTERM)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code


def _rank_child(rank: int, size: int, port: int, run_rank: Callable[[], int]) -> None:
    """The body of one forked rank; never returns."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the supervisor
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor, which passes it on once
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_WORLD_SIZE=str(size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        code = run_rank()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
