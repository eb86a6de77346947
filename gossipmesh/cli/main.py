"""``gossipmesh COMMAND``: each command is a config class (its options, ``--help`` and checks
come from ``gossipmesh.config``) and a handler. A config error exits with status 2 and one line
naming the option, before any socket is opened or any member waited for.

Parsing imports no torch: ``--help``, ``keygen``, ``topology``, ``report`` and every config error
answer at once; a command that trains imports it once it runs (``tests/test_cli_startup.py``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gossipmesh import report_view
from gossipmesh.cli import simulate, topology_view
from gossipmesh.config import ConfigError, NodeConfig, Options, add_options, from_namespace
from gossipmesh.config.configs import (
    KeygenConfig,
    MeshConfig,
    ReportConfig,
    SimulateConfig,
    TopologyConfig,
    in_flags,
)
from gossipmesh.report import read_json
from p2p.address import default_name

if TYPE_CHECKING:
    from gossipmesh.mesh.node_process import NodeMain


def user_errors() -> tuple[type[Exception], ...]:
    """What a user must fix (the message says how), reported without a traceback. Imported when
    an error is raised: the network's and the status server's modules are not a light command's."""
    from gossipmesh.daemon.status_server import StatusServerError
    from p2p import AddressError, TransportError
    from p2p.security.curve import SecurityError
    from topologies import TopologyError

    return (AddressError, TransportError, TopologyError, StatusServerError, SecurityError)


@dataclass(frozen=True)
class Command:
    config: type[Options]
    help: str
    description: str
    files: bool = False  # also read --config FILE.toml and GOSSIPMESH_* variables


COMMANDS = {
    "node": Command(
        NodeConfig,
        "run one daemon",
        "Run one node daemon. Every option can also come from --config FILE.toml or a "
        "GOSSIPMESH_<OPTION> environment variable (flags win).",
        files=True,
    ),
    "mesh": Command(
        MeshConfig,
        "run a local test mesh of daemons on 127.0.0.1",
        "Start N daemons as separate processes on 127.0.0.1, show a live table, write a report.",
        files=True,
    ),
    "simulate": Command(
        SimulateConfig,
        "simulate a mesh of N nodes (thousands) in virtual time, with the real gossip code",
        (simulate.__doc__ or "").replace("``", ""),
        files=True,
    ),
    "topology": Command(
        TopologyConfig,
        "inspect a topology: degree, spectral gap, diameter, bytes per round; draw it",
        "Analyse a topology for N nodes (or compare all of them) and draw it.",
    ),
    "report": Command(
        ReportConfig,
        "summarize a run report and plot it",
        "Print where each node's time went and plot loss, accuracy, consensus distance and bytes/s "
        "against wall time, with kills, joins and pauses marked.",
    ),
    "keygen": Command(
        KeygenConfig,
        "make a node's CURVE key pair",
        "Write DIR/NAME.key (public: copy it into the --trusted folder of every node that should "
        "admit this one) and DIR/NAME.key_secret (secret, mode 0600; pass --keys DIR).",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossipmesh", description="Decentralized peer-to-peer training: gossip averaging over ZeroMQ."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(
            name,
            help=command.help,
            description=command.description,
            # a module docstring keeps its paragraphs
            formatter_class=argparse.RawDescriptionHelpFormatter
            if "\n" in command.description
            else argparse.HelpFormatter,
        )
        add_options(sub, command.config, files=command.files)
    return parser


def main(argv: Sequence[str] | None, *, run_node: Callable[[NodeConfig], int], node_main: NodeMain) -> int:
    """Run the command ``argv`` names; ``run_node`` runs a daemon, ``node_main`` is the
    entry point each node of a local mesh runs (``node.main``)."""
    try:
        config = parse_config(argv)
        handlers: dict[type[Options], Callable[[Any], int]] = {
            NodeConfig: run_node,
            MeshConfig: lambda mesh: _mesh(mesh, node_main),
            SimulateConfig: simulate.run,
            TopologyConfig: topology_view.run,
            ReportConfig: _report,
            KeygenConfig: _keygen,
        }
        return handlers[type(config)](config)
    except ConfigError as exc:
        print(f"gossipmesh: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # (not `except user_errors()`: --help's SystemExit would evaluate
        # that, importing the network's modules to print the help)
        if not isinstance(exc, user_errors()):
            raise
        print(f"gossipmesh: error: {in_flags(str(exc))}", file=sys.stderr)  # (the library's words)
        return 1


def parse_config(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> Options:
    """The config of the command ``argv`` names (``env``: the environment, for the commands
    that read it; default ``os.environ``)."""
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    environment = (os.environ if env is None else env) if command.files else None
    return from_namespace(command.config, args, environment)


def _mesh(config: MeshConfig, node_main: NodeMain) -> int:
    from gossipmesh.mesh.launcher import run_mesh  # (imports torch, for the nodes it forks)

    return run_mesh(config, node_main)


def _report(config: ReportConfig) -> int:
    try:
        report = read_json(config.run)
    except (OSError, ValueError) as exc:
        print(f"gossipmesh: error: cannot read report {config.run}: {exc}", file=sys.stderr)
        return 1
    png = config.png or config.run.with_suffix(".png")
    try:
        lines = report_view.summarize(report)
        print("\n".join(lines))
        report_view.plot(report, png)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a field missing or of a wrong type
        what = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(
            f"gossipmesh: error: {config.run} is not a run report ({what}); pass the --report file "
            "of gossipmesh node or mesh",
            file=sys.stderr,
        )
        return 1
    print(f"plot: {png}")
    return 0


def _keygen(config: KeygenConfig) -> int:
    from p2p.security.curve import KeyExistsError, SecurityError, keygen  # (zmq: only keygen needs it)

    name = config.name or default_name()
    try:
        public, secret = keygen(config.dir, name)
    except KeyExistsError as exc:
        if config.name is not None:
            raise
        raise SecurityError(
            f"{exc.path} exists (without --name a key is named after this host); pass --name NAME, "
            f"one name per node, e.g. --name {name}-2"
        ) from None
    print(f"public key {public}  (copy it into every trusted folder)\nsecret key {secret}")
    return 0
