"""One config object per command, read from defaults < TOML file < GOSSIPMESH_* env < flags.

Each option is declared once, as a dataclass field with its help text and parser; the command
line flags, environment variables and file keys are all derived from it, and the object is
validated once, in ``__post_init__``, with errors that name the flag to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

import topologies
from gossip import ALGORITHMS, CODECS, Algorithm, AlgorithmError, parse_codec
from gossip.robust import RobustError, RobustRule
from p2p.address import AddressError, check_node_id, parse_endpoint
from p2p.membership import PROFILES
from runtime.byzantine import ByzantineError, parse_byzantine
from runtime.chaos import ChaosAction, parse_join, parse_kill, parse_leave, parse_pause
from runtime.logs import LOG_FORMATS
from tasks import TASKS, TaskError, parse_dirichlet, task_factory

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "GOSSIPMESH_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
DEFAULT_STEPS = 600

Config = TypeVar("Config", bound="TrainConfig")
Value = TypeVar("Value")
Number = TypeVar("Number", int, float)


class ConfigError(ValueError):
    """Bad configuration; the message names the option and what to pass instead."""


def _option(
    default: Any,
    help: str,
    *,
    parse: Callable[[str], Any] = str,
    metavar: str | None = None,
    repeat: bool = False,
) -> Any:
    return field(
        default=default,
        metadata={"help": help, "parse": parse, "metavar": metavar, "repeat": repeat, "switch": False},
    )


def _switch(help: str) -> Any:
    """An on/off option: a flag without a value; true/false in a file; 1/0, yes/no in the env."""
    return field(
        default=False,
        metadata={"help": help, "parse": _truth, "metavar": None, "repeat": False, "switch": True},
    )


def _truth(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class TrainConfig:
    """What every node of a mesh trains and how it averages (the mesh forwards these)."""

    task: str = _option("digits", f"training task: {', '.join(TASKS)}, or your own as module:function")
    partition: str = _option("iid", "data split over nodes: iid or dirichlet:ALPHA (label skew)")
    topology: str | None = _option(
        None,
        "averaging graph, NAME or NAME:key=value,... (default: ring; one-peer-exponential for sgp): "
        + ", ".join(topologies.NAMES),
    )
    algorithm: str = _option(
        "dpsgd", f"averaging algorithm, NAME or NAME:key=value,...: {', '.join(ALGORITHMS)}"
    )
    steps: int | None = _option(
        None, f"local steps to train (default {DEFAULT_STEPS})", parse=int, metavar="N"
    )
    duration: float | None = _option(
        None,
        "train until this many seconds on the report clock (a mesh's start), instead of --steps",
        parse=float,
        metavar="S",
    )
    lr: float = _option(0.05, "SGD learning rate", parse=float)
    momentum: float = _option(0.9, "SGD momentum", parse=float)
    batch_size: int = _option(32, "examples per local step", parse=int)
    reference_batch: int = _option(
        32, "the batch size --lr is for: other batch sizes scale it in proportion", parse=int
    )
    seed: int = _option(0, "seed for the model, data split and sampling", parse=int)
    average_every: int = _option(1, "local steps between gossip rounds (plain local SGD)", parse=int)
    compression: str = _option("none", f"codec for what choco sends: {', '.join(CODECS)}", metavar="CODEC")
    local_steps: int | None = _option(
        None,
        "DiLoCo: H local steps, then gossip and an outer Nesterov step on the mixed change "
        "(for H of 10 and more: with a few steps the outer momentum compounds the inner one; "
        "use --average-every there)",
        parse=int,
        metavar="H",
    )
    outer_lr: float = _option(0.7, "the outer learning rate with --local-steps", parse=float)
    outer_momentum: float = _option(0.9, "the outer Nesterov momentum with --local-steps", parse=float)
    round_timeout: float = _option(2.0, "longest wait for a neighbour in a round, s", parse=float)
    compute_ms: float = _option(
        0.0, "emulated step time: each step lasts at least this long, ms", parse=float
    )
    startup_timeout: float = _option(60.0, "longest wait for the bootstrap peers, s", parse=float)
    eval_interval: float = _option(0.25, "seconds between timeline points", parse=float)
    profile: str = _option("local", f"failure-detector timings: {', '.join(PROFILES)}")
    robust: str = _option(
        "none",
        "Byzantine-robust mixing (dpsgd): none, clip (self-centred clipping) or trimmed-mean; "
        "':b=K' tolerates K bad neighbours (default 1)",
    )
    device: str = _option(
        "cpu",
        "torch device the model trains on: cpu, cuda or cuda:INDEX (nodes on different devices "
        "gossip together; a GPU model is mixed through a pinned host copy)",
    )

    def __post_init__(self) -> None:
        try:
            task_factory(self.task)
        except TaskError as exc:
            raise ConfigError(f"--task: {exc}") from None
        try:
            algorithm = Algorithm.parse(self.algorithm)
        except AlgorithmError as exc:
            raise ConfigError(f"--algorithm: {exc}") from None
        usual_topology = algorithm.default_topology
        try:
            codec = parse_codec(self.compression)
        except ValueError as exc:
            raise ConfigError(f"--compression: {exc}") from None
        _check(
            codec.name == "none" or algorithm.compresses,
            "--compression",
            f"{self.compression} needs --algorithm choco (CHOCO-SGD); {algorithm.name} sends whole models",
        )
        try:
            graph = topologies.Topology.parse(self.topology or usual_topology)
        except topologies.TopologyError as exc:
            raise ConfigError(f"--topology: {exc}") from None
        _check(
            not algorithm.compresses or not (graph.family.time_varying or graph.family.directed),
            "--topology",
            f"choco needs a static undirected graph (ring, torus, exponential...), not {graph}",
        )
        check_device(self.device)
        if self.partition != "iid":
            try:
                parse_dirichlet(self.partition)
            except ValueError as exc:
                raise ConfigError(f"--partition: {exc}") from None
        _check(self.steps is None or self.duration is None, "--steps", "give --steps or --duration, not both")
        _check(self.steps is None or self.steps >= 1, "--steps", f"must be >= 1, got {self.steps}")
        _check(self.duration is None or self.duration > 0, "--duration", "must be > 0 seconds")
        for name in ("lr", "round_timeout", "startup_timeout", "eval_interval"):
            _check(_finite(getattr(self, name)) > 0, _flag(name), f"must be > 0, got {getattr(self, name)}")
        _check(0 <= _finite(self.momentum) < 1, "--momentum", f"must be in [0, 1), got {self.momentum}")
        _check(_finite(self.compute_ms) >= 0, "--compute-ms", f"must be >= 0, got {self.compute_ms}")
        _check(self.batch_size >= 1, "--batch-size", f"must be >= 1, got {self.batch_size}")
        _check(self.reference_batch >= 1, "--reference-batch", f"must be >= 1, got {self.reference_batch}")
        _check(self.average_every >= 1, "--average-every", f"must be >= 1, got {self.average_every}")
        if self.local_steps is not None:
            _check(self.local_steps >= 1, "--local-steps", f"must be >= 1, got {self.local_steps}")
            _check(
                self.average_every == 1,
                "--local-steps",
                "give --local-steps (with the outer step) or --average-every (without), not both",
            )
        _check(_finite(self.outer_lr) > 0, "--outer-lr", f"must be > 0, got {self.outer_lr}")
        _check(
            0 <= _finite(self.outer_momentum) < 1,
            "--outer-momentum",
            f"must be in [0, 1), got {self.outer_momentum}",
        )
        _check(
            self.profile in PROFILES,
            "--profile",
            f"unknown profile {self.profile!r}; choose {', '.join(PROFILES)}",
        )
        try:
            rule = RobustRule.parse(self.robust)
        except RobustError as exc:
            raise ConfigError(f"--robust: {exc}") from None
        _check(
            rule is None or algorithm.name == "dpsgd",
            "--robust",
            f"works with --algorithm dpsgd, not {algorithm.name}",
        )

    @property
    def graph(self) -> topologies.Topology:
        """The topology to average on (the algorithm's usual one when none was given)."""
        return topologies.Topology.parse(self.topology or Algorithm.parse(self.algorithm).default_topology)

    @property
    def step_budget(self) -> int | None:
        """Steps to run, or None when the run is bounded by --duration."""
        if self.duration is not None:
            return None
        return self.steps if self.steps is not None else DEFAULT_STEPS


@dataclass(frozen=True)
class NodeConfig(TrainConfig):
    """One daemon."""

    listen: str = _option(
        "tcp://0.0.0.0:7000", "address to listen on (port 0: any free port)", metavar="tcp://HOST:PORT"
    )
    advertise: str | None = _option(
        None, "address peers dial (default: the listen address)", metavar="tcp://HOST:PORT"
    )
    bootstrap: tuple[str, ...] = _option(
        (),
        "address of another node (repeat the flag, or comma-separate)",
        repeat=True,
        metavar="tcp://HOST:PORT",
    )
    id: str | None = _option(None, "node id (default: HOSTNAME-PORT)")
    beacon: int = _option(0, "UDP port for LAN discovery beacons (0: off)", parse=int, metavar="PORT")
    mesh_name: str = _option("gossipmesh", "mesh name in beacons: only nodes of the same name join")
    expect: int = _option(
        0,
        "wait for this many members (this one included), then all start at round 0; "
        "0: join a running mesh, taking a member's training state",
        parse=int,
        metavar="N",
    )

    keys: Path | None = _option(
        None,
        "folder with this node's CURVE key pair (ID.key_secret, or the only one there); "
        "make one with: gossipmesh keygen DIR",
        parse=Path,
        metavar="DIR",
    )
    trusted: Path | None = _option(
        None,
        "folder of the public keys (*.key) of the nodes allowed in; re-read when it changes",
        parse=Path,
        metavar="DIR",
    )
    insecure: bool = _switch("run without CURVE: no encryption, no authentication (logged loudly)")
    state_dir: Path | None = _option(
        None,
        "folder for checkpoints; the node resumes from the newest one there",
        parse=Path,
        metavar="DIR",
    )
    checkpoint_every: int = _option(
        100, "with --state-dir: write a checkpoint every N steps (and on stop)", parse=int, metavar="N"
    )
    byzantine: str | None = _option(
        None,
        "for tests and benchmarks: send corrupted models, scale:FACTOR or random:STD",
        metavar="MODE",
    )
    report: Path | None = _option(None, "write the run report (JSON) here", parse=Path)
    save_params: Path | None = _option(None, "write the final flat parameters (.npy) here", parse=Path)
    slowdown: float = _option(1.0, "make every step this many times longer", parse=float)
    threads: int = _option(0, "torch compute threads (0: torch's default)", parse=int, metavar="N")
    progress: str = _option("text", "progress output: text (stderr), json (stdout lines), none")
    clock_origin: float | None = _option(
        None, "wall-clock time (epoch s) the report's t counts from (set by the mesh)", parse=float
    )
    metrics_port: int | None = _option(
        None, "serve /metrics (Prometheus), /healthz and /readyz on this port (default: off)", parse=int
    )
    metrics_host: str = _option(
        "0.0.0.0",
        "address the --metrics-port endpoint listens on (127.0.0.1: this host only)",
        metavar="HOST",
    )
    log_format: str = _option(
        "text", f"log lines on stderr: {' or '.join(LOG_FORMATS)} (one object per event)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("listen", "advertise", *(["bootstrap"] * bool(self.bootstrap))):
            values = getattr(self, name)
            for value in values if isinstance(values, tuple) else [values]:
                if value is not None:
                    try:
                        parse_endpoint(value)
                    except AddressError as exc:
                        raise ConfigError(f"{_flag(name)}: {exc}") from None
        if self.id is not None:
            try:
                check_node_id(self.id)
            except AddressError as exc:
                raise ConfigError(f"--id: {exc}") from None
        _check(_finite(self.slowdown) >= 1, "--slowdown", f"must be >= 1, got {self.slowdown}")
        _check(self.threads >= 0, "--threads", f"must be >= 0, got {self.threads}")
        _check(self.expect >= 0, "--expect", f"must be >= 0, got {self.expect}")
        _check(0 <= self.beacon <= 65535, "--beacon", f"must be a UDP port in 0..65535, got {self.beacon}")
        _check(
            self.profile in PROFILES,
            "--profile",
            f"unknown profile {self.profile!r}; choose {', '.join(PROFILES)}",
        )
        _check(self.progress in ("text", "json", "none"), "--progress", "choose text, json or none")
        _check(self.log_format in LOG_FORMATS, "--log-format", f"choose {' or '.join(LOG_FORMATS)}")
        _check_port(self.metrics_port)
        _check(self.checkpoint_every >= 1, "--checkpoint-every", f"must be >= 1, got {self.checkpoint_every}")
        if self.byzantine is not None:
            try:
                parse_byzantine(self.byzantine)
            except ByzantineError as exc:
                raise ConfigError(f"--byzantine: {exc}") from None
        if self.insecure:
            _check(
                self.keys is None and self.trusted is None,
                "--insecure",
                "give --insecure or --keys/--trusted, not both",
            )
        else:
            _check(
                self.keys is not None and self.trusted is not None,
                "--keys",
                "a node needs --keys DIR and --trusted DIR (make a key pair with: gossipmesh keygen "
                "DIR, and put every node's public .key in the trusted folder), or --insecure to run "
                "without encryption and authentication",
            )


@dataclass(frozen=True)
class MeshConfig(TrainConfig):
    """A local test mesh: N daemons as separate processes on 127.0.0.1."""

    nodes: int = _option(4, "number of node processes", parse=int, metavar="N")
    slowdown: tuple[str, ...] = _option(
        (),
        "RANK:FACTOR, make node RANK's steps FACTOR times longer (repeatable)",
        repeat=True,
        metavar="RANK:FACTOR",
    )
    node_batch: tuple[str, ...] = _option(
        (), "RANK:SIZE, node RANK takes batches of SIZE (its lr scaled to match; repeatable)", repeat=True
    )
    kill: tuple[str, ...] = _option(
        (), "RANK@SECONDS: kill -9 node RANK at that time on the mesh clock (repeatable)", repeat=True
    )
    leave: tuple[str, ...] = _option(
        (), "RANK@SECONDS: stop node RANK gracefully (SIGTERM) at that time (repeatable)", repeat=True
    )
    join: tuple[str, ...] = _option(
        (), "COUNT@SECONDS: start COUNT new nodes then, joining through a live one (repeatable)", repeat=True
    )
    pause: tuple[str, ...] = _option(
        (), "RANK@SECONDS:DURATION: stop node RANK (SIGSTOP) for DURATION s (repeatable)", repeat=True
    )
    node_device: tuple[str, ...] = _option(
        (), "RANK:DEVICE, node RANK trains on DEVICE instead of --device (repeatable)", repeat=True
    )
    insecure: bool = _switch("run the nodes without CURVE (by default the mesh makes a key pair per node)")
    byzantine: tuple[str, ...] = _option(
        (),
        "RANK:MODE, node RANK sends corrupted models: scale:FACTOR or random:STD (repeatable)",
        repeat=True,
    )
    report: Path | None = _option(None, "report path (default: RUN_DIR/report.json)", parse=Path)
    run_dir: Path | None = _option(
        None, "folder for the report and node logs (default: runs/mesh-TIMESTAMP)", parse=Path
    )
    plot: str = _option("auto", "report plot: auto (REPORT.png beside the report), none, or a PNG path")
    metrics_port: int | None = _option(
        None, "node RANK serves /metrics, /healthz and /readyz on PORT+RANK (default: off)", parse=int
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_port(self.metrics_port, self.nodes + sum(a.count for a in self.chaos()) - 1)
        _check(1 <= self.nodes <= 256, "--nodes", f"must be in 1..256, got {self.nodes}")
        try:  # the graph must exist for this node count (a hypercube needs a power of two...)
            self.graph.graph(self.nodes)
        except topologies.TopologyError as exc:
            raise ConfigError(f"--topology: {exc}") from None
        self.slowdown_by_rank()  # validates
        self.batch_by_rank()
        self.byzantine_by_rank()
        self.device_by_rank()
        self.chaos()

    def chaos(self) -> list[ChaosAction]:
        """The --kill / --pause / --join schedule, in time order (validated)."""
        try:
            actions = [
                *(parse_kill(text) for text in self.kill),
                *(parse_leave(text) for text in self.leave),
                *(parse_join(text) for text in self.join),
                *(action for text in self.pause for action in parse_pause(text)),
            ]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        total = self.nodes + sum(a.count for a in actions)
        for action in actions:
            flag = "--pause" if action.action == "resume" else f"--{action.action}"
            _check(action.rank < total, flag, f"rank {action.rank} is not in 0..{total - 1}")
        return sorted(actions)

    def batch_by_rank(self) -> dict[int, int]:
        return self._by_rank("node_batch", "SIZE", "3:64", _at_least_one(int, "size"))

    def byzantine_by_rank(self) -> dict[int, str]:
        def mode(text: str) -> str:
            parse_byzantine(text)
            return text

        return self._by_rank("byzantine", "MODE", "2:scale:-10", mode)

    def slowdown_by_rank(self) -> dict[int, float]:
        return self._by_rank("slowdown", "FACTOR", "3:4", _at_least_one(float, "factor"))

    def device_by_rank(self) -> dict[int, str]:
        return self._by_rank(
            "node_device", "DEVICE", "0:cuda", lambda text: check_device(text, "--node-device")
        )

    def _by_rank(self, name: str, what: str, example: str, parse: Callable[[str], Value]) -> dict[int, Value]:
        """The RANK:VALUE entries of option ``name``, by rank (validated)."""
        values = {}
        for text in getattr(self, name):
            rank, colon, value = text.partition(":")
            try:
                if not (colon and rank.isdigit()):
                    raise ValueError(f"expected RANK:{what}, e.g. {example}")
                if int(rank) >= self.nodes:
                    raise ValueError(f"rank {rank} is not in 0..{self.nodes - 1}")
                values[int(rank)] = parse(value)
            except (ValueError, ByzantineError) as exc:
                raise ConfigError(f"{_flag(name)} {text!r}: {exc}") from None
        return values


def _at_least_one(kind: Callable[[str], Number], what: str) -> Callable[[str], Number]:
    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"the {what} {text!r} is not a number") from None
        if not _finite(float(value)) >= 1:
            raise ValueError(f"the {what} must be >= 1, got {text}")
        return value

    return parse


def check_device(text: str, flag: str = "--device") -> str:
    """``text`` if it names a torch device this machine has (cpu, cuda, cuda:INDEX)."""
    name, _, index = text.partition(":")
    if name not in ("cpu", "cuda") or (index and (name == "cpu" or not index.isdigit())):
        raise ConfigError(f"{flag} {text!r}: choose cpu, cuda or cuda:INDEX")
    available = torch.cuda.device_count() if name == "cuda" else 0
    if name == "cuda" and available <= int(index or 0):
        raise ConfigError(
            f"{flag} {text!r}: this torch build sees no CUDA device {index or 0} ({available} found); "
            "install a CUDA build (make venv TORCH_SPEC=...) or use --device cpu"
        )
    return text


# -- reading ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, cls: type[TrainConfig]) -> None:
    """Flags for every option of ``cls`` (only the ones given end up in the namespace)."""
    parser.add_argument(
        "--config", type=Path, metavar="FILE.toml", help=f"read options from a TOML file (or ${CONFIG_ENV})"
    )
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = "" if f.default in (None, ()) else f" (default: {f.default})"
        if meta["switch"]:
            parser.add_argument(
                _flag(f.name), dest=f.name, action="store_const", const=True, help=meta["help"],
                default=argparse.SUPPRESS,
            )  # fmt: skip
            continue
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            action="append" if meta["repeat"] else "store",
            metavar=meta["metavar"] or f.name.upper(),
            help=meta["help"] + default,
            default=argparse.SUPPRESS,
        )


def load(
    cls: type[Config],
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> Config:
    """Merge defaults < ``config_file`` < ``env`` < ``flags`` into a validated ``cls``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if config_file is not None:
        for key, value in _read_toml(config_file).items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"{config_file}: unknown option {key!r}; known: {', '.join(fields)}")
            values[name] = _coerce(fields[name], value, f"{config_file}: {key}")
    for name, f in fields.items():
        if (raw := env.get(ENV_PREFIX + name.upper())) is not None:
            values[name] = _coerce(f, raw, ENV_PREFIX + name.upper())
    for name, raw in flags.items():
        if name in fields:
            values[name] = _coerce(fields[name], raw, _flag(name))
    return cls(**values)


def as_flags(config: TrainConfig) -> list[str]:
    """The shared training options of ``config`` as node flags (what a mesh forwards)."""
    argv: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if value is not None:
            argv += [_flag(f.name), str(value)]
    return argv


def summary(config: TrainConfig) -> dict[str, Any]:
    """The config as JSON-ready values (for the run report), with the topology resolved."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
    return {**values, "topology": str(config.graph)}


def parse_args_into(cls: type[Config], args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    """The validated config of a parsed command line; the TOML file is ``--config``, else
    ``GOSSIPMESH_CONFIG`` (a file mounted into a container)."""
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config_file = getattr(args, "config", None)
    if config_file is None and env.get(CONFIG_ENV):
        config_file = Path(env[CONFIG_ENV])
    return load(cls, flags, env, config_file)


def node_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> NodeConfig:
    """A node's config as ``gossipmesh node`` reads it (flags, default ``sys.argv[1:]``, over
    ``GOSSIPMESH_*`` over ``--config``), for a user's own training script; a bad value exits
    with the option to fix, as the daemon does."""
    parser = argparse.ArgumentParser(description="A gossipmesh node (options as for gossipmesh node).")
    add_arguments(parser, NodeConfig)
    try:
        return parse_args_into(NodeConfig, parser.parse_args(argv), os.environ if env is None else env)
    except ConfigError as exc:
        parser.error(str(exc))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


_TYPE_NAMES: dict[Callable[[str], Any], str] = {
    int: "whole number",
    float: "number",
    str: "text",
    Path: "path",
    _truth: "true or false",
}


def _coerce(f: dataclasses.Field[Any], value: Any, source: str) -> Any:
    """A raw value (flag or env string, TOML value, repeated flag list) as the field's type."""
    parse = f.metadata["parse"]
    if f.metadata["repeat"]:
        items = value if isinstance(value, list | tuple) else [value]
        return tuple(part.strip() for item in items for part in str(item).split(",") if part.strip())
    if parse is _truth and isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            raise ConfigError(f"{source}: {value!r} is not a {_TYPE_NAMES[parse]}") from None
    if not isinstance(value, bool) and (
        (parse is float and isinstance(value, int | float)) or (parse is int and isinstance(value, int))
    ):
        return parse(value)
    raise ConfigError(f"{source}: expected a {_TYPE_NAMES[parse]}, got {value!r}")


def _check(ok: bool, flag: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}: {problem}")


def _check_port(port: int | None, more: int = 0) -> None:
    """A TCP port (and ``more`` after it), when given."""
    if port is not None:
        _check(
            1 <= port <= 65535 - more,
            "--metrics-port",
            f"must be a TCP port in 1..{65535 - more}, got {port}",
        )


def _finite(value: float) -> float:
    """``value``, or NaN (which fails every range check) when it is infinite."""
    return value if math.isfinite(value) else math.nan
