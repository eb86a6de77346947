"""Options declared once, parsed once: defaults < TOML file < GOSSIPMESH_* environment < flags,
typed values inward, every bad value or combination refused before a socket opens."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import HANG_S

from gossip import Algorithm, Codec, RobustRule
from gossipmesh.cli import COMMANDS, build_parser, parse_config
from gossipmesh.config import (
    Averaging,
    ConfigError,
    LocalSGD,
    MeshConfig,
    NodeConfig,
    TrainConfig,
    as_flags,
    load,
    summary,
)
from gossipmesh.config.configs import in_flags
from gossipmesh.config.options import Option, flag, option_of
from gossipmesh.mesh import netns
from gossipmesh.tasks import DataPartition
from node import main
from topologies import Topology


def _node(
    argv: list[str], env: dict[str, str] | None = None, security: tuple[str, ...] = ("--insecure",)
) -> NodeConfig:
    config = parse_config(["node", *security, *argv], env or {})
    assert isinstance(config, NodeConfig)
    return config


def test_defaults_are_typed_values() -> None:
    config = _node([])
    assert config.task.name == "digits" and config.topology is None
    assert config.algorithm == Algorithm.parse("dpsgd:stragglers=tolerate") and config.local_steps == 10
    assert config.compression == Codec() and config.robust is None
    assert config.graph == Topology("ring")
    assert _node(["--algorithm", "sgp"]).graph == Topology("one-peer-exponential")
    assert (config.lr, config.momentum, config.batch_size) == (0.05, 0.9, 32)
    assert config.steps is None and config.bootstrap == ()  # a daemon runs until stopped


@pytest.mark.parametrize(
    ("argv", "chosen", "local_steps"),
    [
        ([], "dpsgd:stragglers=tolerate", 10),  # the fastest arm, even and with a straggler
        (["--topology", "torus"], "dpsgd:stragglers=tolerate", 10),
        (["--mix-momentum"], "adpsgd", None),  # not with an outer step: the fastest per step
        (["--quasi-global-momentum", "0.9"], "adpsgd", None),
        (["--topology", "one-peer-exponential"], "sgp", None),  # directed: push-sum's
        (["--topology", "directed-exponential"], "sgp", None),
        (["--robust", "clip"], "dpsgd", None),
        (["--compression", "int8"], "choco", None),
        (["--compression", "auto"], "choco", None),
        (["--local-steps", "50"], "dpsgd:stragglers=tolerate", 50),  # an outer step over D-PSGD's rounds
        (["--average-every", "auto"], "dpsgd:stragglers=tolerate", None),  # measures rounds
        (["--average-every", "4", "--compression", "int8"], "choco:stragglers=tolerate", None),
    ],
)
def test_algorithm_auto_chooses_the_first_that_works_with_the_other_options(
    argv: list[str], chosen: str, local_steps: int | None
) -> None:
    for config in (_node(argv), _node(["--algorithm", "auto", *argv])):  # auto is the default
        assert config.algorithm == Algorithm.parse(chosen)  # (the config holds the one chosen)
        assert config.local_steps == local_steps
        assert summary(config)["algorithm"] == chosen


def test_algorithm_auto_reads_the_same_from_a_file_and_in_the_simulator() -> None:
    mesh = load(MeshConfig, {"algorithm": "auto", "topology": "directed-exponential"})
    assert mesh.algorithm == Algorithm("sgp")
    assert load(MeshConfig, {}).local_steps == 10
    simulated = parse_config(["simulate", "--algorithm", "auto", "--robust", "clip"])
    assert simulated.algorithm == Algorithm("dpsgd")


def test_algorithm_auto_that_finds_none_names_why_each_was_refused() -> None:
    with pytest.raises(ConfigError, match=r"--algorithm auto found none .*adpsgd: .*choco: "):
        _node(["--algorithm", "auto", "--robust", "clip", "--compression", "int8"])


def test_values_are_parsed_into_their_objects() -> None:
    config = _node(["--algorithm", "dpsgd:backup=1", "--topology", "random-regular:degree=4",
                    "--robust", "clip:b=2", "--partition", "dirichlet:0.5"])  # fmt: skip
    assert config.algorithm == Algorithm("dpsgd", (("backup", 1),))
    assert config.topology == Topology("random-regular", (("degree", 4),))
    assert config.robust == RobustRule("clip", 2)
    assert config.partition == DataPartition("dirichlet", (("alpha", 0.5),))
    choco = _node(["--algorithm", "choco", "--compression", "topk:0.01"])
    assert str(choco.compression) == "topk:0.01" and choco.compression.name == "topk"


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "node.toml"
    file.write_text('lr = 0.2\nbatch-size = 8\ntopology = "complete"\nbootstrap = ["a:1", "b:2"]\n')
    env = {"GOSSIPMESH_LR": "0.3", "GOSSIPMESH_SEED": "5"}
    config = _node(["--config", str(file), "--lr", "0.4"], env)
    assert config.lr == 0.4  # flag beats environment beats file
    assert config.seed == 5  # environment
    assert (config.batch_size, config.topology) == (8, Topology("complete"))  # file
    assert config.bootstrap == ("tcp://a:1", "tcp://b:2")
    assert _node(["--config", str(file)], env).lr == 0.3
    mounted = _node([], {**env, "GOSSIPMESH_CONFIG": str(file)})  # a container's mounted file
    assert (mounted.batch_size, mounted.lr) == (8, 0.3)


def test_repeated_and_comma_separated_bootstrap() -> None:
    config = _node(["--bootstrap", "tcp://h1:1,h2:2", "--bootstrap", "h3:3"])
    assert config.bootstrap == ("tcp://h1:1", "tcp://h2:2", "tcp://h3:3")
    assert _node([], {"GOSSIPMESH_BOOTSTRAP": "h1:1, h2:2"}).bootstrap == ("tcp://h1:1", "tcp://h2:2")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--topology", "donut"],
            {},
            "--topology: unknown topology 'donut'; choose one of ring, torus, exponential",
        ),
        (
            ["--topology", "random-regular:degree=x"],
            {},
            "--topology: random-regular: degree: 'x' is not a whole",
        ),
        (["--algorithm", "dpsgd:backup=-1"], {}, "--algorithm: dpsgd: backup: must be >= 0, got -1"),
        (["--compression", "topk"], {}, "--compression: topk: needs fraction, as in topk:FRACTION"),
        (["--listen", "7000"], {}, "--listen: bad address '7000': expected tcp://HOST:PORT"),
        (["--bootstrap", "x:1,nope"], {}, "--bootstrap: bad address 'nope'"),
        (["--lr", "-1"], {}, "--lr: must be > 0, got -1.0"),
        (["--lr", "inf"], {}, "--lr: must be > 0, got inf"),
        (["--lr", "fast"], {}, "--lr: 'fast' is not a number"),
        ([], {"GOSSIPMESH_BATCH_SIZE": "3.5"}, "GOSSIPMESH_BATCH_SIZE: '3.5' is not a whole number"),
        (["--momentum", "1"], {}, "--momentum: must be in [0, 1)"),
        (["--partition", "dirichlet:-1"], {}, "--partition: dirichlet: alpha: must be > 0, got -1.0"),
        (["--id", "bad id!"], {}, "--id: bad node id 'bad id!'"),
        (["--slowdown", "0.5"], {}, "--slowdown: must be >= 1"),
        (["--beacon", "70000"], {}, "--beacon: must be in [0, 65535], got 70000"),
        (["--task", "imagenet"], {}, "--task: unknown task 'imagenet'; choose one of digits, charlm"),
        (["--task", "no_such_module:make"], {}, "--task: task 'no_such_module:make': cannot import"),
        (["--task", "json:no_such_function"], {}, "json has no function 'no_such_function'"),
        (
            ["--robust", "median"],
            {},
            "--robust: unknown robust rule 'median'; choose one of clip, trimmed-mean",
        ),
        (["--robust", "clip:k=2"], {}, "--robust: clip: unknown parameter 'k'; it takes: b"),
        (["--byzantine", "flip"], {}, "--byzantine: unknown corruption 'flip'; choose one of scale:FACTOR"),
        (["--checkpoint-every", "0"], {}, "--checkpoint-every: must be >= 1"),
        (
            ["--mix-in-place", "--algorithm", "choco"],
            {},
            "--mix-in-place: choco's codecs work on float32 values: leave out --mix-in-place",
        ),
        (["--progress", "loud"], {}, "--progress: choose one of text, json, none, not 'loud'"),
    ],
)
def test_bad_values_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _node(argv, env)
    assert message in str(caught.value)


def test_bad_file_contents(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("learning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown option 'learning_rate'; known: lr, momentum"):
        load(NodeConfig, {}, {}, file)
    file.write_text('lr = "x"\n')
    with pytest.raises(ConfigError, match="lr: 'x' is not a number"):
        load(NodeConfig, {}, {}, file)
    file.write_text("steps = 1.5\n")
    with pytest.raises(ConfigError, match=re.escape("steps: '1.5' is not a whole number")):
        load(NodeConfig, {}, {}, file)
    file.write_text("lr = true\n")
    with pytest.raises(ConfigError, match=re.escape("lr: expected a single value, got True")):
        load(NodeConfig, {}, {}, file)
    file.write_text("lr = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(NodeConfig, {}, {}, file)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(NodeConfig, {}, {}, tmp_path / "missing.toml")


def test_mesh_values_per_rank_are_checked_against_the_node_count() -> None:
    mesh = load(MeshConfig, {"nodes": "4", "slowdown": ["3:4", "1:2"], "node_batch": ["0:64"]})
    assert mesh.by_rank("slowdown") == {3: 4.0, 1: 2.0} and mesh.by_rank("node_batch") == {0: 64}
    with pytest.raises(ConfigError, match=re.escape("--slowdown: '4:2': rank 4 is not in 0..3")):
        load(MeshConfig, {"nodes": "4", "slowdown": ["4:2"]})
    with pytest.raises(ConfigError, match=re.escape("--slowdown: 'fast': expected RANK:FACTOR, e.g. 3:4")):
        load(MeshConfig, {"slowdown": ["fast"]})
    with pytest.raises(ConfigError, match=re.escape("--node-batch: '1:0': must be >= 1, got 0")):
        load(MeshConfig, {"node_batch": ["1:0"]})


def test_mesh_forwards_every_training_option_and_nodes_read_back_the_same_values() -> None:
    mesh = load(
        MeshConfig,
        {"topology": "torus:rows=2,weights=uniform", "algorithm": "dpsgd:backup=1,overlap=1", "lr": "0.1",
         "steps": "50", "compute_ms": "20", "robust": "trimmed-mean:b=1", "partition": "dirichlet:0.3",
         "local_steps": "4", "outer_lr": "0.5", "seed": "7", "device": "cpu", "profile": "lan"},
    )  # fmt: skip
    node = _node(as_flags(mesh))
    for field in dataclasses.fields(TrainConfig):
        assert getattr(node, field.name) == getattr(mesh, field.name), field.name
    choco = load(MeshConfig, {"algorithm": "choco", "compression": "randk:0.25"})
    assert _node(as_flags(choco)).compression == choco.compression


def test_report_summary_keeps_its_fields_as_text() -> None:
    values = summary(_node(["--robust", "clip", "--algorithm", "dpsgd:backup=1"]))
    assert (values["robust"], values["algorithm"], values["topology"]) == (
        "clip:b=1",
        "dpsgd:backup=1",
        "ring",
    )
    assert (values["compression"], values["task"], values["partition"]) == ("none", "digits", "iid")
    assert summary(_node([]))["robust"] == "none"


def test_a_node_runs_without_curve_only_when_told_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs --keys DIR and --trusted DIR .* or --insecure"):
        _node([], security=())
    with pytest.raises(ConfigError, match="--insecure: give --insecure or --keys/--trusted, not both"):
        _node(["--keys", "k"])
    secure = _node(["--keys", "k", "--trusted", "t"], security=())
    assert (secure.insecure, secure.keys, secure.trusted) == (False, Path("k"), Path("t"))
    assert _node([], {"GOSSIPMESH_INSECURE": "yes"}, security=()).insecure
    file = tmp_path / "node.toml"
    file.write_text("insecure = true\n")
    assert _node(["--config", str(file)], security=()).insecure


# -- every invalid combination: one line naming the flags, exit status 2, nothing opened ----------

INVALID = [
    (["node", "--algorithm", "dpsgd", "--compression", "int8"], "--compression int8 needs --algorithm choco"),
    (["node", "--algorithm", "dpsgd", "--compression", "auto"], "--compression auto needs --algorithm choco"),
    (["simulate", "--algorithm", "choco", "--compression", "auto", "--rounds", "3"], None),  # valid
    (
        ["node", "--algorithm", "sgp", "--compression", "topk:0.1"],
        "--compression topk:0.1 needs --algorithm choco",
    ),
    (
        ["node", "--robust", "clip", "--algorithm", "sgp"],
        "--robust clip:b=1 works with --algorithm dpsgd, not sgp",
    ),
    (
        ["node", "--robust", "trimmed-mean", "--algorithm", "adpsgd"],
        "works with --algorithm dpsgd, not adpsgd",
    ),
    (
        ["node", "--algorithm", "adpsgd", "--topology", "one-peer-exponential"],
        "--algorithm adpsgd needs a static undirected --topology (ring, torus",
    ),
    (["node", "--algorithm", "adpsgd", "--topology", "directed-exponential"], "not directed-exponential"),
    (
        ["node", "--algorithm", "choco", "--topology", "random-matching"],
        "--algorithm choco needs a static undirected",
    ),
    (["node", "--steps", "5", "--duration", "3"], "--steps: give --steps or --duration, not both"),
    (
        ["node", "--local-steps", "10", "--average-every", "2"],
        "--local-steps: give --local-steps (with the outer",
    ),
    (["node", "--insecure", "--keys", "k"], "--insecure: give --insecure or --keys/--trusted, not both"),
    (["node", "--trusted", "t"], "--keys: a node needs --keys DIR and --trusted DIR"),
    (
        ["mesh", "--topology", "hypercube", "--nodes", "6"],
        "--topology hypercube with --nodes 6: hypercube needs a",
    ),
    (["mesh", "--kill", "7@1"], "--kill: rank 7 is not in 0..3"),
    (["mesh", "--pause", "9@1:2", "--join", "2@5"], "--pause: rank 9 is not in 0..5"),
    (["mesh", "--metrics-port", "65535"], "--metrics-port: must be in 1..65532 for 4 nodes"),
    (["mesh", "--link", "100"], "--link: limits namespace hosts' links: add --hosts netns"),
    (["mesh", "--hosts", "netns", "--link", "9:100"], "--link: '9:100': rank 9 is not in 0..3"),
    (["mesh", "--hosts", "netns", "--link", "x:1"], "--link: 'x:1': expected MBPS or RANK:MBPS"),
    (["mesh", "--hosts", "netns", "--link", "0"], "--link: '0': expected MBPS or RANK:MBPS"),
    (["mesh", "--hosts", "netns", "--metrics-port", "9000"], "--metrics-port: serves on 127.0.0.1"),
    (["mesh", "--algorithm", "choco", "--compression", "int8", "--topology", "star"], None),  # valid
    (
        ["simulate", "--algorithm", "allreduce", "--task", "digits"],
        "--task: --algorithm allreduce is a time model",
    ),
    (
        ["simulate", "--algorithm", "allreduce", "--crash", "0.1@1"],
        "--algorithm allreduce is a time model without",
    ),
    (
        ["simulate", "--model-size", "1000", "--task", "digits"],
        "--model-size: give --model-size or --task, not both",
    ),
    (
        ["simulate", "--algorithm", "sgp", "--compression", "int8"],
        "--compression int8 needs --algorithm choco",
    ),
    (
        ["simulate", "--algorithm", "adpsgd", "--topology", "random-matching"],
        "--algorithm adpsgd needs a static",
    ),
    (["simulate", "--partition", "1:2", "--nodes", "1"], "--partition: splits the nodes in two halves"),
    (["mesh", "--mix-momentum", "--momentum", "0"], "--mix-momentum: there is no --momentum to mix (0)"),
    (
        ["mesh", "--mix-momentum", "--momentum", "0", "--quasi-global-momentum", "0.9"],
        "--mix-momentum mixes the local optimizer's momentum: not with an outer step (--local-steps) or "
        "--quasi-global-momentum",
    ),
    (["mesh", "--mix-momentum", "--local-steps", "10"], "not with an outer step (--local-steps)"),
    (["node", "--mix-momentum", "--local-ranks", "2"], "nor with --local-ranks (each rank gossips a slice"),
    (["simulate", "--mix-momentum", "--momentum", "0"], "--mix-momentum: there is no --momentum to mix (0)"),
    (["mesh", "--shard"], "--shard: shards the model over a machine's local ranks: give --local-ranks N"),
    (["node", "--shard"], "--shard: shards the model over a machine's local ranks: give --local-ranks N"),
    (["mesh", "--shard", "--local-ranks", "2", "--dtype", "mixed"], "--shard: FSDP shards a model of one"),
    (["mesh", "--shard", "--local-ranks", "2", "--dtype", "bfloat16"], None),  # valid
    (["mesh", "--mix-momentum", "--algorithm", "adpsgd"], None),  # valid
    (["topology"], "NAME: give a topology NAME, or --compare"),
]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port this test holds: a node that got as far as binding it would fail (exit 1), not 2."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("argv", "message"), INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_every_invalid_combination_exits_2_before_any_socket_or_wait(
    argv: list[str], message: str | None, held_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    if message is None:  # the combinations around the invalid ones are accepted
        parse_config(argv, {})
        return
    extra = []
    if argv[0] == "node":  # listen on a port that is taken; wait 60 s for 3 members of a dead mesh
        security = ["--insecure"] if {"--keys", "--trusted"}.isdisjoint(argv) else []
        extra = ["--listen", f"tcp://127.0.0.1:{held_port}", "--expect", "3", "--startup-timeout", "60",
                 "--bootstrap", "tcp://127.0.0.1:9", *security]  # fmt: skip
    started = time.monotonic()
    assert main([*argv, *extra]) == 2
    assert time.monotonic() - started < 30  # far from the 60 s a wait for members would take
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gossipmesh: error: ")  # one line
    assert message in err


def test_the_command_exits_with_status_2_and_no_listener() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["node", "--insecure", "--algorithm", "dpsgd", "--compression", "int8", "--listen", f"tcp://127.0.0.1:{port}",
            "--expect", "2", "--startup-timeout", "60"]  # fmt: skip
    process = subprocess.Popen([sys.executable, "node.py", *argv], cwd=Path(__file__).resolve().parents[1],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    listened = False
    while process.poll() is None:  # until it exits, nothing may listen on its port
        with socket.socket() as sock:
            listened |= sock.connect_ex(("127.0.0.1", port)) == 0
        time.sleep(0.01)
    _, err = process.communicate(timeout=HANG_S)
    assert process.returncode == 2 and not listened
    assert err.strip() == (
        "gossipmesh: error: --compression int8 needs --algorithm choco: dpsgd sends whole models, "
        "and only CHOCO's replicas keep convergence under a lossy codec"
    )


# -- every command's options come from the shared declarations ------------------------------------


def _actions(command: str) -> dict[str, str]:
    """dest -> the help text of every option of ``command``'s parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[index]
    return {a.dest: a.help or "" for a in sub._actions if a.dest not in ("help", "config")}


def test_every_option_of_every_command_is_declared_once_and_reads_the_same_everywhere() -> None:
    uses: dict[int, list[tuple[str, str]]] = {}  # id(Option) -> (command, help shown)
    for command, spec in COMMANDS.items():
        shown = _actions(command)
        fields = {f.name: option_of(f) for f in dataclasses.fields(spec.config)}
        assert set(shown) == set(fields), command  # a flag for every field, and nothing else
        for name, option in fields.items():
            assert isinstance(option, Option)
            assert shown[name].startswith(option.help_text), (command, name)
            uses.setdefault(id(option), []).append((command, shown[name].split(" (default")[0]))
    shared = [u for u in uses.values() if len(u) > 1]
    assert len(shared) >= 10  # --nodes, --topology, --seed, --lr... each declared once for all
    for places in shared:
        assert len({text for _, text in places}) == 1, places


def test_an_option_of_a_group_appears_in_every_command_that_takes_the_group() -> None:
    takes = {command: spec.config for command, spec in COMMANDS.items()}
    for group in (Averaging, LocalSGD, TrainConfig):
        commands = [c for c, config in takes.items() if issubclass(config, group)]
        assert commands, group
        for command in commands:
            assert {f.name for f in dataclasses.fields(group)} <= set(_actions(command)), (group, command)
    assert {c for c, config in takes.items() if issubclass(config, Averaging)} == {"node", "mesh", "simulate"}
    assert {c for c, config in takes.items() if issubclass(config, LocalSGD)} == {"node", "mesh", "simulate"}


def test_help_of_every_command_renders(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        for name in _actions(command):
            assert flag(name) in text or name.upper() in text or "NAME" in text, (command, name)


def test_namespace_hosts_where_none_can_be_made_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(netns, "unavailable", lambda: "network namespaces need root")
    assert main(["mesh", "--hosts", "netns", "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gossipmesh: error: --hosts netns: network namespaces need root; run as root, or use --hosts local"
    )


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        ("keys=/etc/k: found a.key_secret and b.key_secret", "--keys /etc/k: found"),
        ("copy b.key into the trusted= folder there", "into the --trusted folder there"),
        ("lower expect=, or raise timeout=", "lower --expect, or raise --startup-timeout"),
        (
            "compression=topk:0.01 needs algorithm=choco: sgp sends",
            "--compression topk:0.01 needs --algorithm choco:",
        ),
        (
            "pass listen= with port 0 (e.g. tcp://127.0.0.1:0)",
            "pass --listen with port 0 (e.g. tcp://127.0.0.1:0)",
        ),
        ("use dpsgd, choco or sgp:overlap=0", "use dpsgd, choco or sgp:overlap=0"),  # not an argument
    ],
)
def test_the_command_line_says_the_librarys_arguments_as_flags(message: str, shown: str) -> None:
    assert shown in in_flags(message)
