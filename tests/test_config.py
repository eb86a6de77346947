"""Config from defaults < TOML file < GOSSIPMESH_* environment < flags, validated once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from node import build_parser
from runtime.config import ConfigError, MeshConfig, NodeConfig, as_flags, load, parse_args_into


def _node(
    argv: list[str], env: dict[str, str] | None = None, security: tuple[str, ...] = ("--insecure",)
) -> NodeConfig:
    return parse_args_into(NodeConfig, build_parser().parse_args(["node", *security, *argv]), env or {})


def test_defaults() -> None:
    config = _node([])
    assert (config.task, config.topology, config.algorithm) == ("digits", None, "dpsgd")
    assert str(config.graph) == "ring"
    assert str(_node(["--algorithm", "sgp"]).graph) == "one-peer-exponential"
    assert (config.lr, config.momentum, config.batch_size) == (0.05, 0.9, 32)
    assert config.step_budget == 600 and config.bootstrap == ()


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "node.toml"
    file.write_text('lr = 0.2\nbatch-size = 8\ntopology = "complete"\nbootstrap = ["a:1", "b:2"]\n')
    env = {"GOSSIPMESH_LR": "0.3", "GOSSIPMESH_SEED": "5"}
    config = _node(["--config", str(file), "--lr", "0.4"], env)
    assert config.lr == 0.4  # flag beats environment beats file
    assert config.seed == 5  # environment
    assert (config.batch_size, config.topology) == (8, "complete")  # file
    assert config.bootstrap == ("a:1", "b:2")
    assert _node(["--config", str(file)], env).lr == 0.3
    mounted = _node([], {**env, "GOSSIPMESH_CONFIG": str(file)})  # a container's mounted file
    assert (mounted.batch_size, mounted.lr) == (8, 0.3)


def test_repeated_and_comma_separated_bootstrap() -> None:
    config = _node(["--bootstrap", "tcp://h1:1,h2:2", "--bootstrap", "h3:3"])
    assert config.bootstrap == ("tcp://h1:1", "h2:2", "h3:3")
    assert _node([], {"GOSSIPMESH_BOOTSTRAP": "h1:1, h2:2"}).bootstrap == ("h1:1", "h2:2")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--topology", "donut"],
            {},
            "--topology: unknown topology 'donut'; choose one of ring, torus, exponential",
        ),
        (["--listen", "7000"], {}, "--listen: bad address '7000': expected tcp://HOST:PORT"),
        (["--bootstrap", "x:1,nope"], {}, "--bootstrap: bad address 'nope'"),
        (["--steps", "10", "--duration", "5"], {}, "give --steps or --duration, not both"),
        (["--lr", "-1"], {}, "--lr: must be > 0, got -1.0"),
        (["--lr", "inf"], {}, "--lr: must be > 0, got inf"),
        (["--lr", "fast"], {}, "--lr: 'fast' is not a number"),
        ([], {"GOSSIPMESH_BATCH_SIZE": "3.5"}, "GOSSIPMESH_BATCH_SIZE: '3.5' is not a whole number"),
        (["--momentum", "1"], {}, "--momentum: must be in [0, 1)"),
        (
            ["--partition", "dirichlet:-1"],
            {},
            "--partition: partition 'dirichlet:-1': use 'iid' or 'dirichlet:ALPHA'",
        ),
        (["--id", "bad id!"], {}, "--id: bad node id 'bad id!'"),
        (["--slowdown", "0.5"], {}, "--slowdown: must be >= 1"),
        (["--task", "imagenet"], {}, "--task: unknown task 'imagenet'; choose one of digits, charlm"),
        (["--task", "no_such_module:make"], {}, "--task: task 'no_such_module:make': cannot import"),
        (["--task", "json:no_such_function"], {}, "json has no function 'no_such_function'"),
    ],
)
def test_bad_values_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _node(argv, env)
    assert message in str(caught.value)


def test_bad_file_contents(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("learning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="unknown option 'learning_rate'; known: task, partition"):
        load(NodeConfig, {}, {}, file)
    file.write_text('lr = "x"\n')
    with pytest.raises(ConfigError, match="lr: 'x' is not a number"):
        load(NodeConfig, {}, {}, file)
    file.write_text("steps = 1.5\n")
    with pytest.raises(ConfigError, match=re.escape("steps: expected a whole number, got 1.5")):
        load(NodeConfig, {}, {}, file)
    file.write_text("lr = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(NodeConfig, {}, {}, file)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(NodeConfig, {}, {}, tmp_path / "missing.toml")


def test_mesh_slowdowns_are_validated_against_the_node_count() -> None:
    assert MeshConfig(nodes=4, slowdown=("3:4", "1:2")).slowdown_by_rank() == {3: 4.0, 1: 2.0}
    with pytest.raises(ConfigError, match=re.escape("rank 4 is not in 0..3")):
        MeshConfig(nodes=4, slowdown=("4:2",))
    with pytest.raises(ConfigError, match="expected RANK:FACTOR"):
        MeshConfig(slowdown=("fast",))


def test_mesh_forwards_training_options_that_nodes_read_back() -> None:
    mesh = MeshConfig(topology="complete", lr=0.1, steps=50, compute_ms=20)
    node = _node(as_flags(mesh))
    assert (node.topology, node.lr, node.steps, node.compute_ms) == ("complete", 0.1, 50, 20.0)


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--robust", "median"], "--robust: unknown rule 'median'; choose one of none, clip, trimmed-mean"),
        (["--robust", "clip:k=2"], "the only parameter is b=K"),
        (["--robust", "clip", "--algorithm", "sgp"], "--robust: works with --algorithm dpsgd, not sgp"),
        (["--byzantine", "flip"], "--byzantine: 'flip': expected scale:FACTOR or random:STD"),
        (["--checkpoint-every", "0"], "--checkpoint-every: must be >= 1"),
    ],
)
def test_security_and_robustness_options_are_checked(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _node(argv)
    assert message in str(caught.value)
