"""Every option of every command, declared once: its parser, help text, default and form.

A config class (``gossipmesh.config.configs``) takes an option by naming a field after it:
``lr: float = LR.field()``. The field name gives the flag (``--lr``), the environment variable
(``GOSSIPMESH_LR``) and the TOML key (``lr``); the declaration gives the rest, so a command's
``--help``, its env and file keys and its parsing all come from here. An option that several
commands take (``--nodes``, ``--topology``, ``--seed``...) is declared once and reads the same in
each; a command may only change its default (``NODES.field(default=64)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gossip import ALGORITHMS, CODECS, Algorithm, Codec
from gossip.algorithms.registry import AUTO, AUTO_LOCAL_STEPS, LOCAL_STEPS_ALGORITHM
from gossipmesh.config import values
from gossipmesh.config.values import Corruption
from gossipmesh.logs import LOG_FORMATS
from gossipmesh.tasks import IID, PRECISIONS, TASKS, DataPartition, Precision, TaskRef
from p2p.membership.protocol import PROFILES
from topologies import NAMES, Topology
from topologies.spec import choice, number

Form = Literal["value", "switch", "list", "positional"]


@dataclass(frozen=True)
class Option:
    """Args:
    parse: text -> the typed value; a ValueError's message says what is expected.
    help: one line for ``--help`` (a function of none where it lists what can be registered
        later, such as the algorithms).
    default: the typed value when the option is not given.
    metavar: the value's name in ``--help`` (default: the field name in capitals).
    form: ``value`` (``--lr 0.1``), ``switch`` (``--insecure``; true/false in a file, 1/0 or
        yes/no in the environment), ``list`` (repeatable and comma-separated), ``positional``.
    none: the spelling that means None (``--robust none``).
    """

    parse: Callable[[str], Any]
    help: str | Callable[[], str]
    default: Any = None
    metavar: str | None = None
    form: Form = "value"
    none: str | None = None

    def field(self, *, default: Any = dataclasses.MISSING) -> Any:
        """A config class's field for this option (``default`` replaces the declared one)."""
        value = self.default if default is dataclasses.MISSING else default
        if value is dataclasses.MISSING:  # a required positional
            return dataclasses.field(metadata={"option": self})
        return dataclasses.field(default=value, metadata={"option": self})

    @property
    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def read(self, text: str) -> Any:
        """The typed value of one piece of text."""
        if self.none is not None and text.strip() == self.none:
            return None
        return self.parse(text)

    def text(self, value: Any) -> str | None:
        """The spelling :meth:`read` reads back as ``value`` (None for an absent value)."""
        if value is None:
            return self.none
        if isinstance(value, float):
            return repr(value)
        return str(value)


def option_of(field: dataclasses.Field[Any]) -> Option:
    option: Option = field.metadata["option"]
    return option


def flag(name: str) -> str:
    """The flag of the option a config calls ``name``: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def truth(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not true or false")


def _switch(help: str) -> Option:
    return Option(truth, help, default=False, form="switch")


def _repeatable(parse: Callable[[str], Any], help: str, metavar: str | None = None) -> Option:
    """An option given any number of times, or once with comma-separated values."""
    return Option(parse, help, (), metavar, form="list")


_POSITIVE = number(float, above=0)
_AT_LEAST_ONE = number(int, at_least=1)
_PORT = number(int, at_least=1, at_most=65535)


def _steps_or_auto(text: str) -> int | Literal["auto"]:
    """A number of local steps >= 1, or ``auto`` (chosen by the mesh: ``gossip.tuning.auto_period``)."""
    if text.strip() == "auto":
        return "auto"
    try:
        return _AT_LEAST_ONE(text)
    except ValueError as exc:
        raise ValueError(f"{exc}, or auto") from None


# -- what a node trains, and how it averages --------------------------------------------------
TASK = Option(
    TaskRef.parse,
    f"training task: {', '.join(TASKS)}, or your own as module:function",
    TaskRef.parse("digits"),
)
PARTITION = Option(DataPartition.parse, "data split over nodes: iid or dirichlet:ALPHA (label skew)", IID)
TOPOLOGY = Option(
    Topology.parse,
    "averaging graph, NAME or NAME:key=value,... (default: ring; one-peer-exponential for sgp): "
    + ", ".join(NAMES),
)
ALGORITHM = Option(
    values.algorithm,
    lambda: (
        f"averaging algorithm, NAME or NAME:key=value,...: {', '.join(ALGORITHMS)}; or auto (the "
        f"default): --local-steps {AUTO_LOCAL_STEPS} over {LOCAL_STEPS_ALGORITHM}, the measured "
        "best, unless other options rule it out; then the first of adpsgd, sgp, dpsgd, choco "
        "that works with them"
    ),
    AUTO,
)
COMPRESSION = Option(
    Codec.parse,
    f"codec for what choco sends: {', '.join(CODECS)}; auto: the mesh picks none, bf16 or int8 "
    "each epoch of rounds from its measured round and step times; topk and randk also take "
    "values=int8|float32 (default int8) and dense_every=M (an int8 round every M, default 20; 0: never)",
    Codec(),
    metavar="CODEC",
)
ROBUST = Option(
    values.robust_rule,
    "Byzantine-robust mixing (dpsgd): none, clip (self-centred clipping) or trimmed-mean; "
    "':b=K' tolerates K bad neighbours (default 1)",
    none="none",
)
_STEP_COUNT = "the mesh's: a straggler's count moves on by the rounds it skips to keep up"
STEPS = Option(
    _AT_LEAST_ONE,
    f"train to this step count ({_STEP_COUNT}; default: until stopped, or --duration)",
    metavar="N",
)
MESH_STEPS = Option(
    _AT_LEAST_ONE,
    f"train each node to this step count ({_STEP_COUNT}; default: 600, unless --duration)",
    metavar="N",
)
DURATION = Option(
    _POSITIVE,
    "train until this many seconds on the report clock (a mesh's start), instead of --steps "
    "(with --local-steps or --average-every, on to the next gossip round)",
    metavar="S",
)
LR = Option(_POSITIVE, "SGD learning rate", 0.05)
MOMENTUM = Option(number(float, at_least=0, below=1), "SGD momentum", 0.9)
BATCH_SIZE = Option(_AT_LEAST_ONE, "examples per local step", 32)
REFERENCE_BATCH = Option(
    _AT_LEAST_ONE, "the batch size --lr is for: other batch sizes scale it in proportion", 32
)
SEED = Option(
    number(int),
    "seed of what is drawn at random: the model, data split, sampling (and the simulator's draws)",
    0,
)
AVERAGE_EVERY = Option(
    _steps_or_auto,
    "local steps between gossip rounds (plain local SGD); auto: the mesh agrees on H from "
    "measured step and round times, so rounds take at most a fifth of the time",
    1,
)
LOCAL_STEPS = Option(
    _steps_or_auto,
    "DiLoCo: H local steps, then gossip and an outer Nesterov step on the mixed change "
    "(for H of 10 and more: with a few steps the outer momentum compounds the inner one; "
    "use --average-every there); auto: H agreed by the mesh, as for --average-every",
    metavar="H",
)
OUTER_LR = Option(_POSITIVE, "the outer learning rate with --local-steps", 0.7)
OUTER_MOMENTUM = Option(
    number(float, at_least=0, below=1), "the outer Nesterov momentum with --local-steps", 0.9
)
QUASI_GLOBAL_MOMENTUM = Option(
    number(float, at_least=0, below=1),
    "quasi-global momentum (Lin et al. 2021): a momentum step of this beta on the model's "
    "movement, mixing included, after each local step; for label-skewed data, with --momentum 0 "
    "(0: none)",
    0.0,
    metavar="BETA",
)
MIX_MOMENTUM = _switch(
    "mix each node's SGD momentum buffer along with its parameters (messages twice as large; "
    "each node's model stays closer to the mesh's average); give it to every node"
)
NO_AVERAGE_BUFFERS = _switch(
    "keep the model's floating-point buffers (BatchNorm's running statistics) local instead of "
    "averaging them with the parameters"
)
MIX_IN_PLACE = _switch(
    "mix in the model's own memory and dtype: a bfloat16 or float16 model then needs no float32 "
    "copy (twice its bytes), each neighbour's value rounded into it as it is mixed (the copy "
    "rounds once a round); for a CPU model of one dtype, not with CHOCO"
)
ROUND_TIMEOUT = Option(
    _POSITIVE, "longest wait for a neighbour in a round while nothing of its value arrives, s", 2.0
)
COMPUTE_MS = Option(
    number(float, at_least=0), "emulated step time: each step lasts at least this long, ms", 0.0
)
LOCAL_RANKS = Option(
    number(int, at_least=1, at_most=64),
    "local ranks (one process per device) of each machine, one member of the mesh: gradients "
    "averaged inside the machine, rank r gossips slice r of the model with rank r of the others, "
    "listening on the --listen port + r (torchrun's LOCAL_WORLD_SIZE sets it too)",
    1,
    metavar="N",
)
SHARD = _switch(
    "with --local-ranks N: shard the model over the machine's ranks with FSDP2 (fully_shard): "
    "each rank holds, mixes and sends only its shard of the parameters and optimizer state, "
    "with rank r of the other machines (a model N times one device's memory)"
)
STARTUP_TIMEOUT = Option(_POSITIVE, "longest wait for the bootstrap peers, s", 60.0)
EVAL_INTERVAL = Option(_POSITIVE, "seconds between timeline points", 0.25)
PROFILE = Option(choice(PROFILES), f"failure-detector timings: {', '.join(PROFILES)}", "local")
MAX_SEND_MBPS = Option(
    _POSITIVE,
    "cap what the node sends at MBPS Mbit/s (a token bucket in its network thread), to share an "
    "uplink (default: no cap)",
    metavar="MBPS",
)
STREAMS = Option(
    number(int, at_least=1, at_most=16),
    "connections to each neighbour a large message is spread over (its chunks in turn), for a "
    "long link that one TCP stream cannot fill (its window over the round trip); 1: one",
    1,
    metavar="K",
)
DTYPE = Option(
    lambda text: Precision(choice(PRECISIONS)(text)),
    "the model's parameter dtype: float32, bfloat16, float16, or mixed (weight matrices in "
    "bfloat16, biases in float32); narrower models run under autocast, gossip mixes in float32",
    Precision(),
)
DEVICE = Option(
    values.device,
    "torch device the model trains on: cpu, cuda or cuda:INDEX (nodes on different devices "
    "gossip together; a GPU model is mixed through a pinned host copy)",
    "cpu",
)

# -- one daemon --------------------------------------------------------------------------------
LISTEN = Option(
    values.endpoint,
    "address to listen on (port 0: any free port)",
    "tcp://0.0.0.0:7000",
    metavar="tcp://HOST:PORT",
)
ADVERTISE = Option(
    values.endpoint, "address peers dial (default: the listen address)", metavar="tcp://HOST:PORT"
)
BOOTSTRAP = _repeatable(
    values.endpoint, "address of another node (repeat the flag, or comma-separate)", "tcp://HOST:PORT"
)
NO_LISTEN = _switch(
    "accept no connection (behind a NAT or a firewall): the node dials the members that listen and "
    "is reached over those connections; the topology never pairs two such nodes (needs --bootstrap)"
)
ID = Option(values.node_id, "node id (default: HOSTNAME-PORT)")
BEACON = Option(
    number(int, at_least=0, at_most=65535), "UDP port for LAN discovery beacons (0: off)", 0, metavar="PORT"
)
MESH_NAME = Option(str, "mesh name in beacons: only nodes of the same name join", "gossipmesh")
EXPECT = Option(
    number(int, at_least=0),
    "wait for this many members (this one included), then all start at round 0; "
    "0: join a running mesh, taking a member's training state",
    0,
    metavar="N",
)
KEYS = Option(
    Path,
    "folder with this node's CURVE key pair (ID.key_secret, or the only one there); "
    "make one with: gossipmesh keygen DIR",
    metavar="DIR",
)
TRUSTED = Option(
    Path,
    "folder of the public keys (*.key) of the nodes allowed in; re-read when it changes",
    metavar="DIR",
)
INSECURE = _switch("run without CURVE: no encryption, no authentication (logged loudly)")
STATE_DIR = Option(Path, "folder for checkpoints; the node resumes from the newest one there", metavar="DIR")
CHECKPOINT_EVERY = Option(
    _AT_LEAST_ONE, "with --state-dir: write a checkpoint every N steps (and on stop)", 100, metavar="N"
)
BYZANTINE = Option(
    Corruption.parse,
    "for tests and benchmarks: send corrupted models, scale:FACTOR or random:STD",
    metavar="MODE",
)
REPORT = Option(Path, "write the run report (JSON) here")
SAVE_PARAMS = Option(Path, "write the final flat parameters (.npy) here")
LIVE_PARAMS = Option(
    Path,
    "rewrite the current flat parameters (.npy) here about once a second while training (what a "
    "local mesh estimates its average model from)",
)
SLOWDOWN = Option(number(float, at_least=1), "make every step this many times longer", 1.0)
THREADS = Option(number(int, at_least=0), "torch compute threads (0: torch's default)", 0, metavar="N")
PROGRESS = Option(
    choice(("text", "json", "none")), "progress output: text (stderr), json (stdout lines), none", "text"
)
CLOCK_ORIGIN = Option(number(float), "wall-clock time (epoch s) the report's t counts from (set by the mesh)")
METRICS_PORT = Option(_PORT, "serve /metrics (Prometheus), /healthz and /readyz on this port (default: off)")
METRICS_HOST = Option(
    str,
    "address the --metrics-port endpoint listens on (0.0.0.0: every interface; the image sets it)",
    "127.0.0.1",
    metavar="HOST",
)
LOG_FORMAT = Option(
    choice(LOG_FORMATS), f"log lines on stderr: {' or '.join(LOG_FORMATS)} (one object per event)", "text"
)

# -- a local test mesh -------------------------------------------------------------------------
NODES = Option(_AT_LEAST_ONE, "number of nodes", 4, metavar="N")
MESH_SLOWDOWN = _repeatable(
    values.per_rank(SLOWDOWN.parse, "FACTOR", "3:4"),
    "RANK:FACTOR, make node RANK's steps FACTOR times longer (repeatable)",
    "RANK:FACTOR",
)
NODE_BATCH = _repeatable(
    values.per_rank(BATCH_SIZE.parse, "SIZE", "3:64"),
    "RANK:SIZE, node RANK takes batches of SIZE (its lr scaled to match; repeatable)",
)
NODE_DEVICE = _repeatable(
    values.per_rank(DEVICE.parse, "DEVICE", "0:cuda"),
    "RANK:DEVICE, node RANK trains on DEVICE instead of --device (repeatable)",
)
MESH_BYZANTINE = _repeatable(
    values.per_rank(BYZANTINE.parse, "MODE", "2:scale:-10"),
    "RANK:MODE, node RANK sends corrupted models: scale:FACTOR or random:STD (repeatable)",
)
KILL = _repeatable(values.kill, "RANK@SECONDS: kill -9 node RANK at that time on the mesh clock (repeatable)")
LEAVE = _repeatable(values.leave, "RANK@SECONDS: stop node RANK gracefully (SIGTERM) then (repeatable)")
JOIN = _repeatable(
    values.join, "COUNT@SECONDS: start COUNT new nodes then, joining through a live one (repeatable)"
)
PAUSE = _repeatable(
    values.pause, "RANK@SECONDS:DURATION: stop node RANK (SIGSTOP) for DURATION s (repeatable)"
)
MESH_INSECURE = _switch("run the nodes without CURVE (by default the mesh makes a key pair per node)")
MESH_REPORT = Option(Path, "report path (default: RUN_DIR/report.json)")
HOSTS = Option(
    choice(("local", "netns")),
    "where the nodes run: local (127.0.0.1), or netns (a Linux network-namespace host each, on one "
    "bridged LAN; needs root and iproute2)",
    "local",
)
LINK = _repeatable(
    values.link,
    "MBPS limits every node's uplink, RANK:MBPS node RANK's (tc tbf; repeatable; needs --hosts netns). "
    "Latency cannot be emulated here (no netem): gossipmesh simulate models it",
    "[RANK:]MBPS",
)
MESH_NO_LISTEN = _repeatable(
    number(int, at_least=1),
    "node RANK runs with --no-listen (repeatable); with --hosts netns its host also drops inbound TCP "
    "connections (an nftables rule, where nft is installed)",
    "RANK",
)
RUN_DIR = Option(Path, "folder for the report and node logs (default: runs/mesh-TIMESTAMP)")
PLOT = Option(str, "report plot: auto (REPORT.png beside the report), none, or a PNG path", "auto")
MESH_METRICS_PORT = Option(
    _PORT, "node RANK serves /metrics, /healthz and /readyz on PORT+RANK (default: off)"
)

# -- the simulator -------------------------------------------------------------------------------
SIMULATED_ALGORITHM = Option(
    values.simulated_algorithm,
    lambda: f"{ALGORITHM.help_text}; or allreduce, the ring-allreduce time model",
    Algorithm("dpsgd"),
    metavar="A",
)
MODEL_SIZE = Option(_AT_LEAST_ONE, "model size on the wire (default: 100 MB)", metavar="BYTES")
SIMULATED_TASK = Option(TaskRef.parse, "train this task's real model on every node (small N)")
STRAGGLER = Option(values.stragglers, "e.g. 0.05:4: 5%% of the nodes 4x slower", metavar="FRACTION:FACTOR")
LATENCY = Option(number(float, at_least=0), "link latency", 1.0, metavar="MS")
BANDWIDTH = Option(_POSITIVE, "link bandwidth", 10.0, metavar="GBPS")
SIMULATED_LINK = _repeatable(
    values.link,
    "MBPS sets every node's uplink in place of --bandwidth, RANK:MBPS node RANK's (repeatable): "
    "the links gossipmesh mesh --hosts netns --link emulates",
    "[RANK:]MBPS",
)
ROUNDS = Option(_AT_LEAST_ONE, "local steps per node", 30, metavar="R")
JITTER = Option(number(float, at_least=0), "lognormal shape of step times", 0.0)
LOSS = Option(number(float, at_least=0, below=1), "probability a message is lost", 0.0)
CRASH = _repeatable(
    values.crash,
    "e.g. 0.1@2: 10%% of the nodes (drawn with the seed) crash 2 virtual s in; the others drop "
    "them from the membership 1 s later (repeatable)",
    "FRACTION@SECONDS",
)
SIMULATED_JOIN = _repeatable(
    values.join,
    "e.g. 8@3: 8 new nodes join 3 virtual s in, each starting from a live node's model (repeatable)",
    "COUNT@SECONDS",
)
NETWORK_PARTITION = _repeatable(
    values.window,
    "e.g. 1:4: from 1 to 4 virtual s no message crosses between the first half of the nodes "
    "(node-0 .. node-N/2-1) and the rest (joiners included) (repeatable)",
    "START:END",
)
JSON = _switch("print the result as JSON")

# -- inspecting topologies and reports, making keys ----------------------------------------------
TOPOLOGY_NAME = Option(
    Topology.parse,
    f"NAME or NAME:key=value,...; one of {', '.join(NAMES)}",
    metavar="NAME",
    form="positional",
)
PARAM = _repeatable(values.key_value, "a parameter of the topology (repeatable)", "KEY=VALUE")
PNG = Option(Path, "the PNG file to draw to (report: RUN.png beside RUN.json by default)", metavar="FILE")
COMPARE = _switch("a table of every named topology")
MODEL_BYTES = Option(_AT_LEAST_ONE, "model size for bytes per round (default: the digits MLP)", metavar="B")
RUN = Option(
    Path, "a report of gossipmesh mesh or node", dataclasses.MISSING, metavar="RUN.json", form="positional"
)
KEY_DIR = Option(
    Path,
    "folder for the key pair (created if missing)",
    dataclasses.MISSING,
    metavar="DIR",
    form="positional",
)
KEY_NAME = Option(values.node_id, "file name of the pair, one per node (default: host name)")
