"""One typed config per command, made of option groups; every field is an option of
``gossipmesh.config.options`` and holds a parsed value (an ``Algorithm``, a ``Topology``, a
``Codec``...), never the text it came from.

A group checks what its options say together in ``__post_init__`` (each value was checked on its
own when it was read), raising :class:`ConfigError`; the rules about which algorithm goes with
which graph, codec and robust rule live with the algorithms (``gossip.Algorithm.check``, raising
``IncompatibleOptionsError``, which ``gossipmesh.config.load`` reports as a ConfigError).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from gossip import Algorithm, Codec, IncompatibleOptionsError, PeerNetwork, RobustRule
from gossip.algorithms.registry import AUTO, choose_algorithm, choose_local_steps
from gossipmesh.config import options as o
from gossipmesh.config.values import ChaosAction, Corruption, ForRank, Link, schedule, uplink_mbps
from gossipmesh.sim.allreduce import RingAllreduce
from gossipmesh.sim.links import Partition
from gossipmesh.sim.scenario import Stragglers
from gossipmesh.tasks import DataPartition, Precision, TaskRef
from topologies import Topology, TopologyError

if TYPE_CHECKING:  # (configs are read and checked before a command knows it trains: no torch here)
    import torch

    from gossip import GossipOptimizer

#: GossipOptimizer's arguments that a command line spells otherwise (the rest: ``--name``)
#: the library's arguments its messages name (``compression=int8``, ``trusted=``), and the flags
#: that set them: GossipOptimizer's, Peer's and its keys'
FLAG_OF_ARGUMENT = {
    **{
        name: o.flag(name)
        for name in (
            *("algorithm", "topology", "compression", "robust", "average_every", "outer_momentum"),
            *("quasi_global_momentum", "mix_momentum", "bootstrap", "listen", "advertise", "expect"),
            *("keys", "trusted", "name"),
        )
    },
    "outer_lr": "--local-steps",  # the outer step is what --local-steps gives
    "local_group": "--local-ranks",
    "timeout": "--startup-timeout",  # Peer.wait_ready's
    "node_id": "--id",
}
_ARGUMENT = re.compile(rf"\b({'|'.join(FLAG_OF_ARGUMENT)})=((?:[^\s;,()]*[^\s;,():])?)")


def in_flags(message: str, renamed: Mapping[str, str] | None = None) -> str:
    """A message of the library in the command line's words: the arguments it names
    (``name=value``, ``name=``) become the flags that set them (``--name value``, ``--name``);
    ``renamed``: flags that differ for this command's options."""

    def flag_of(match: re.Match[str]) -> str:
        name, value = match[1], match[2]
        spelt = (renamed or {}).get(name, FLAG_OF_ARGUMENT[name])
        return f"{spelt} {value}" if value else spelt

    return _ARGUMENT.sub(flag_of, message)


DEFAULT_STEPS = 600  # a local test mesh's steps per node when given neither --steps nor --duration
MAX_MESH_NODES = 256


SHARD_NEEDS_RANKS = (
    "shards the model over a machine's local ranks: give --local-ranks N (N >= 2), or run the "
    "node under torchrun --standalone --nproc-per-node N"
)


class ConfigError(ValueError):
    """Bad configuration; the message names the option and what to pass instead."""


def check(ok: bool, flag: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}: {problem}")


def check_link_ranks(caps: Sequence[Link], total: int) -> None:
    """--link RANK:MBPS names one of the ``total`` nodes (joiners included)."""
    for cap in caps:
        problem = f"'{cap}': rank {cap.rank} is not in 0..{total - 1}"
        check(cap.rank is None or cap.rank < total, "--link", problem)


@dataclass(frozen=True)
class Options:
    """The base of every config: ``title`` heads its options in ``--help``."""

    title: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        """Checks of options together (subclasses extend it, calling super first)."""


@dataclass(frozen=True)
class LocalSGD(Options):
    title: ClassVar[str] = "local optimizer"

    lr: float = o.LR.field()
    momentum: float = o.MOMENTUM.field()
    batch_size: int = o.BATCH_SIZE.field()
    reference_batch: int = o.REFERENCE_BATCH.field()

    def local_optimizer(self, model: torch.nn.Module) -> torch.optim.SGD:
        """SGD with ``lr`` scaled to the batch size, so a step takes the same step per example."""
        import torch

        lr = self.lr * self.batch_size / self.reference_batch
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=self.momentum)


@dataclass(frozen=True)
class Averaging(Options):
    title: ClassVar[str] = "averaging"

    algorithm: Algorithm = o.ALGORITHM.field()
    topology: Topology | None = o.TOPOLOGY.field()
    compression: Codec = o.COMPRESSION.field()
    robust: RobustRule | None = o.ROBUST.field()
    round_timeout: float = o.ROUND_TIMEOUT.field()
    average_every: int | Literal["auto"] = o.AVERAGE_EVERY.field()
    local_steps: int | Literal["auto"] | None = o.LOCAL_STEPS.field()
    outer_lr: float = o.OUTER_LR.field()
    outer_momentum: float = o.OUTER_MOMENTUM.field()
    quasi_global_momentum: float = o.QUASI_GLOBAL_MOMENTUM.field()
    mix_momentum: bool = o.MIX_MOMENTUM.field()
    no_average_buffers: bool = o.NO_AVERAGE_BUFFERS.field()
    mix_in_place: bool = o.MIX_IN_PLACE.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.local_steps is None or self.average_every == 1,
            "--local-steps",
            "give --local-steps (with the outer step) or --average-every (without), not both",
        )
        options: dict[str, Any] = {
            "topology": self.topology,
            "codec": self.compression,
            "robust": self.robust,
            "average_every": self.local_steps or self.average_every,
            "outer_step": self.local_steps is not None,
            "quasi_global_momentum": self.quasi_global_momentum,
            "mix_momentum": self.mix_momentum,
            "local_ranks": getattr(self, "local_ranks", 1) > 1,
        }
        try:
            if str(self.algorithm) == AUTO:  # (parsed as text: from here on, the one chosen)
                if local_steps := choose_local_steps(**options):
                    object.__setattr__(self, "local_steps", local_steps)
                    options.update(average_every=local_steps, outer_step=True)
                object.__setattr__(self, "algorithm", choose_algorithm(**options))
            if isinstance(self.algorithm, Algorithm):  # (the simulator's allreduce is a time model)
                self.algorithm.check(**options)
        except IncompatibleOptionsError as exc:
            raise ConfigError(self.in_flags(str(exc))) from None
        check(
            not (self.mix_in_place and isinstance(self.algorithm, Algorithm) and self.algorithm.compresses),
            "--mix-in-place",
            f"{self.algorithm}'s codecs work on float32 values: leave out --mix-in-place",
        )

    def in_flags(self, message: str) -> str:
        """A message of the library in these options' words (see :func:`in_flags`)."""
        return in_flags(message, {"average_every": "--local-steps"} if self.local_steps else None)

    @property
    def averaging(self) -> str:
        """The algorithm and how often it averages, in words (``dpsgd, a round every 10 local
        steps with an outer step``)."""
        every = self.local_steps or self.average_every
        period = {1: "", AUTO: ", a round every H local steps the mesh agrees on"}.get(
            every, f", a round every {every} local steps"
        )
        return f"{self.algorithm}{period}{' with an outer step' if self.local_steps else ''}"

    @property
    def graph(self) -> Topology:
        """The topology to average on (the algorithm's usual one when none was given)."""
        return self.topology or self.algorithm.default_topology

    def gossip_optimizer(
        self, optimizer: torch.optim.Optimizer, peer: PeerNetwork, **options: Any
    ) -> GossipOptimizer:
        """``optimizer`` wrapped to average as these options say (``options``: the rest of
        GossipOptimizer's arguments, e.g. ``lock``, and ``model``, whose buffers it averages)."""
        from gossip import GossipOptimizer

        return GossipOptimizer(
            optimizer,
            peer=peer,
            algorithm=self.algorithm,
            topology=self.graph,
            average_every=self.local_steps or self.average_every,
            compression=self.compression,
            outer_lr=self.outer_lr if self.local_steps else None,
            outer_momentum=self.outer_momentum,
            round_timeout=self.round_timeout,
            robust=self.robust,
            quasi_global_momentum=self.quasi_global_momentum,
            mix_momentum=self.mix_momentum,
            average_buffers=not self.no_average_buffers,
            staged=False if self.mix_in_place else None,
            **options,
        )


@dataclass(frozen=True)
class AveragedSGD(Averaging, LocalSGD):
    """Local SGD steps averaged by gossip: what a node trains with, and a simulated node."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            not self.mix_momentum or self.momentum > 0, "--mix-momentum", "there is no --momentum to mix (0)"
        )


@dataclass(frozen=True)
class TrainConfig(AveragedSGD):
    """What every node of a mesh trains and how it averages (the mesh forwards these)."""

    title: ClassVar[str] = "training"

    task: TaskRef = o.TASK.field()
    partition: DataPartition = o.PARTITION.field()
    steps: int | None = o.STEPS.field()
    duration: float | None = o.DURATION.field()
    seed: int = o.SEED.field()
    compute_ms: float = o.COMPUTE_MS.field()
    startup_timeout: float = o.STARTUP_TIMEOUT.field()
    eval_interval: float = o.EVAL_INTERVAL.field()
    profile: str = o.PROFILE.field()
    max_send_mbps: float | None = o.MAX_SEND_MBPS.field()
    streams: int = o.STREAMS.field()
    device: str = o.DEVICE.field()
    dtype: Precision = o.DTYPE.field()
    local_ranks: int = o.LOCAL_RANKS.field()
    shard: bool = o.SHARD.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.steps is None or self.duration is None, "--steps", "give --steps or --duration, not both")
        check(
            not self.shard or self.dtype.name != "mixed",
            "--shard",
            "FSDP shards a model of one dtype: give --dtype float32, bfloat16 or float16",
        )


@dataclass(frozen=True)
class NodeConfig(TrainConfig):
    """One daemon."""

    title: ClassVar[str] = "node"

    listen: str = o.LISTEN.field()
    no_listen: bool = o.NO_LISTEN.field()
    advertise: str | None = o.ADVERTISE.field()
    bootstrap: tuple[str, ...] = o.BOOTSTRAP.field()
    id: str | None = o.ID.field()
    beacon: int = o.BEACON.field()
    mesh_name: str = o.MESH_NAME.field()
    expect: int = o.EXPECT.field()
    keys: Path | None = o.KEYS.field()
    trusted: Path | None = o.TRUSTED.field()
    insecure: bool = o.INSECURE.field()
    state_dir: Path | None = o.STATE_DIR.field()
    checkpoint_every: int = o.CHECKPOINT_EVERY.field()
    byzantine: Corruption | None = o.BYZANTINE.field()
    report: Path | None = o.REPORT.field()
    save_params: Path | None = o.SAVE_PARAMS.field()
    live_params: Path | None = o.LIVE_PARAMS.field()
    slowdown: float = o.SLOWDOWN.field()
    threads: int = o.THREADS.field()
    progress: str = o.PROGRESS.field()
    clock_origin: float | None = o.CLOCK_ORIGIN.field()
    metrics_port: int | None = o.METRICS_PORT.field()
    metrics_host: str = o.METRICS_HOST.field()
    log_format: str = o.LOG_FORMAT.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        folders = (self.keys is not None, self.trusted is not None)
        if self.insecure and any(folders):
            raise ConfigError("--insecure: give --insecure or --keys/--trusted, not both")
        if not (self.insecure or all(folders)):
            raise ConfigError(
                "--keys: a node needs --keys DIR and --trusted DIR (make a key pair with: gossipmesh keygen "
                "DIR, and put every node's public .key in the trusted folder), or --insecure to run "
                "without encryption and authentication"
            )
        if self.no_listen:
            check(
                bool(self.bootstrap),
                "--no-listen",
                "a node that accepts no connection joins through --bootstrap",
            )
            check(
                not self.beacon, "--no-listen", "no member could dial a node found by --beacon: drop --beacon"
            )
            check(self.advertise is None, "--no-listen", "there is no address to --advertise")
            check(self.local_ranks == 1, "--no-listen", "local ranks are dialed by the other machines' ranks")


@dataclass(frozen=True)
class MeshConfig(TrainConfig):
    """A local test mesh: N daemons as separate processes, on 127.0.0.1 or on namespace hosts."""

    title: ClassVar[str] = "mesh"

    nodes: int = o.NODES.field()
    steps: int | None = o.MESH_STEPS.field()
    slowdown: tuple[ForRank[float], ...] = o.MESH_SLOWDOWN.field()
    node_batch: tuple[ForRank[int], ...] = o.NODE_BATCH.field()
    node_device: tuple[ForRank[str], ...] = o.NODE_DEVICE.field()
    byzantine: tuple[ForRank[Corruption], ...] = o.MESH_BYZANTINE.field()
    kill: tuple[ChaosAction, ...] = o.KILL.field()
    leave: tuple[ChaosAction, ...] = o.LEAVE.field()
    join: tuple[ChaosAction, ...] = o.JOIN.field()
    pause: tuple[ChaosAction, ...] = o.PAUSE.field()
    insecure: bool = o.MESH_INSECURE.field()
    report: Path | None = o.MESH_REPORT.field()
    run_dir: Path | None = o.RUN_DIR.field()
    plot: str = o.PLOT.field()
    metrics_port: int | None = o.MESH_METRICS_PORT.field()
    hosts: str = o.HOSTS.field()
    link: tuple[Link, ...] = o.LINK.field()
    no_listen: tuple[int, ...] = o.MESH_NO_LISTEN.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.nodes <= MAX_MESH_NODES, "--nodes", f"must be in 1..{MAX_MESH_NODES}, got {self.nodes}")
        check(not self.shard or self.local_ranks > 1, "--shard", SHARD_NEEDS_RANKS)
        try:  # the graph must exist for this node count (a hypercube needs a power of two...)
            self.graph.graph(self.nodes)
        except TopologyError as exc:
            raise ConfigError(f"--topology {self.graph} with --nodes {self.nodes}: {exc}") from None
        for name in ("slowdown", "node_batch", "node_device", "byzantine"):
            for entry in getattr(self, name):
                check(
                    entry.rank < self.nodes,
                    o.flag(name),
                    f"'{entry}': rank {entry.rank} is not in 0..{self.nodes - 1}",
                )
        total = self.nodes + sum(action.count for action in self.join)
        for action in (*self.kill, *self.leave, *self.pause):
            check(action.rank < total, action.flag, f"rank {action.rank} is not in 0..{total - 1}")
        if self.metrics_port is not None:
            last = 65535 - (total - 1)
            check(self.metrics_port <= last, "--metrics-port", f"must be in 1..{last} for {total} nodes")
            check(self.hosts == "local", "--metrics-port", "serves on 127.0.0.1: use it with --hosts local")
        check(
            not self.link or self.hosts == "netns",
            "--link",
            "limits namespace hosts' links: add --hosts netns",
        )
        check_link_ranks(self.link, total)

        for rank in self.no_listen:
            check(
                rank < total,
                "--no-listen",
                f"rank {rank} is not in 1..{total - 1} (rank 0 is every node's bootstrap)",
            )

    def bounded(self) -> MeshConfig:
        """This mesh with the steps its nodes run: --steps, else DEFAULT_STEPS unless --duration
        bounds the run (a test mesh ends by itself; a lone daemon runs until stopped)."""
        if self.steps is not None or self.duration is not None:
            return self
        return replace(self, steps=DEFAULT_STEPS)

    def uplink_mbps(self, rank: int) -> float | None:
        """Node ``rank``'s uplink cap (--link): its own, else the one of every node, else none."""
        return uplink_mbps(self.link, rank)

    def chaos(self) -> list[ChaosAction]:
        """The --kill / --leave / --pause / --join schedule, in time order."""
        return schedule((*self.kill, *self.leave, *self.join, *self.pause))

    def by_rank(self, name: str) -> dict[int, Any]:
        """The RANK:VALUE entries of option ``name`` (slowdown, node_batch...), by rank."""
        return {entry.rank: entry.value for entry in getattr(self, name)}


@dataclass(frozen=True)
class SimulateConfig(AveragedSGD):
    """``gossipmesh simulate``: a mesh of N nodes running the real averaging code in virtual time."""

    title: ClassVar[str] = "simulation"

    nodes: int = o.NODES.field(default=64)
    # a gossip algorithm, or the ring-allreduce time model to compare with
    algorithm: Algorithm | RingAllreduce = o.SIMULATED_ALGORITHM.field()  # type: ignore[assignment]
    model_size: int | None = o.MODEL_SIZE.field()
    task: TaskRef | None = o.SIMULATED_TASK.field()
    straggler: Stragglers | None = o.STRAGGLER.field()
    latency: float = o.LATENCY.field()
    bandwidth: float = o.BANDWIDTH.field()
    link: tuple[Link, ...] = o.SIMULATED_LINK.field()
    rounds: int = o.ROUNDS.field()
    # a simulated step costs only virtual time: 100 ms stands for an accelerator's step, where a
    # real node's --compute-ms pads a step that already takes its own time
    compute_ms: float = o.COMPUTE_MS.field(default=100.0)
    jitter: float = o.JITTER.field()
    loss: float = o.LOSS.field()
    crash: tuple[tuple[float, float], ...] = o.CRASH.field()
    join: tuple[ChaosAction, ...] = o.SIMULATED_JOIN.field()
    partition: tuple[Partition, ...] = o.NETWORK_PARTITION.field()
    seed: int = o.SEED.field()
    json: bool = o.JSON.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.model_size is None or self.task is None,
            "--model-size",
            "give --model-size or --task, not both",
        )
        if isinstance(self.algorithm, RingAllreduce):
            check(self.task is None, "--task", "--algorithm allreduce is a time model; use --model-size")
            check(
                not (self.crash or self.join or self.partition),
                "--crash/--join/--partition",
                "--algorithm allreduce is a time model without faults; simulate a gossip algorithm",
            )
            check(not self.link, "--link", "--algorithm allreduce models one --bandwidth for every link")
        total = self.nodes + sum(action.count for action in self.join)
        check_link_ranks(self.link, total)
        crashed = [round(fraction * self.nodes) for fraction, _ in self.crash]
        check(
            all(count >= 1 for count in crashed),
            "--crash",
            f"FRACTION must be in [{1 / self.nodes:.3g}, 1] (one of {self.nodes} nodes at least)",
        )
        check(
            sum(crashed) < self.nodes,
            "--crash",
            f"together they crash all {self.nodes} nodes; leave one running",
        )
        check(
            not self.partition or self.nodes >= 2,
            "--partition",
            "splits the nodes in two halves: needs --nodes >= 2",
        )


@dataclass(frozen=True)
class TopologyConfig(Options):
    """``gossipmesh topology``: analyse a topology for N nodes (or compare all of them), draw it."""

    title: ClassVar[str] = "topology"

    name: Topology | None = o.TOPOLOGY_NAME.field()
    nodes: int = o.NODES.field(default=16)
    param: tuple[tuple[str, str], ...] = o.PARAM.field()
    json: bool = o.JSON.field()
    png: Path | None = o.PNG.field()
    compare: bool = o.COMPARE.field()
    model_bytes: int | None = o.MODEL_BYTES.field()

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.name is not None or self.compare, "NAME", "give a topology NAME, or --compare")

    @property
    def topology(self) -> Topology:
        """NAME with the --param values added to its own."""
        assert self.name is not None
        if not self.param:
            return self.name
        extra = ",".join(f"{key}={value}" for key, value in self.param)
        return Topology.parse(f"{self.name}{',' if self.name.params else ':'}{extra}")


@dataclass(frozen=True)
class ReportConfig(Options):
    """``gossipmesh report``: where each node's time went, and the plot."""

    title: ClassVar[str] = "report"

    run: Path = o.RUN.field()
    png: Path | None = o.PNG.field()


@dataclass(frozen=True)
class KeygenConfig(Options):
    """``gossipmesh keygen``: a node's CURVE key pair."""

    title: ClassVar[str] = "keygen"

    dir: Path = o.KEY_DIR.field()
    name: str | None = o.KEY_NAME.field()
