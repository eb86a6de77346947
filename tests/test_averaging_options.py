"""One set of averaging options for every command: each option ``node`` takes runs in ``simulate``
too (both build their optimizer through ``Averaging.gossip_optimizer``), and an algorithm added
to the registry shows wherever the built-in ones do."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossip.algorithms import registry
from gossip.algorithms.dpsgd import DPSGD
from gossip.algorithms.registry import AlgorithmFamily, algorithm_table, register
from gossipmesh.cli import build_parser, parse_config
from gossipmesh.config import Averaging, summary
from node import main
from topologies import Params, Topology

ROOT = Path(__file__).resolve().parents[1]

#: an example of every option of the averaging group (a new option without one fails below)
EXAMPLES = {
    "algorithm": ["--algorithm", "sgp"],
    "topology": ["--topology", "exponential"],
    "compression": ["--algorithm", "choco", "--compression", "int8"],
    "robust": ["--robust", "clip"],
    "round_timeout": ["--round-timeout", "1.5"],
    "average_every": ["--average-every", "2"],
    "local_steps": ["--local-steps", "10"],
    "outer_lr": ["--local-steps", "10", "--outer-lr", "0.5"],
    "outer_momentum": ["--local-steps", "10", "--outer-momentum", "0.5"],
    "quasi_global_momentum": ["--quasi-global-momentum", "0.9", "--momentum", "0"],
    "mix_momentum": ["--mix-momentum"],
    "no_average_buffers": ["--no-average-buffers"],
    "mix_in_place": ["--mix-in-place"],
}
AUTO = {  # what the mesh tunes from measured times; a simulation measures virtual time
    "average_every=auto": ["--average-every", "auto"],
    "compression=auto": ["--algorithm", "choco", "--compression", "auto"],
}
CASES = {**EXAMPLES, **AUTO}


def test_every_averaging_option_has_an_example() -> None:
    assert set(EXAMPLES) == {field.name for field in dataclasses.fields(Averaging)}


def _consensus(output: str) -> list[float]:
    """The consensus column of ``simulate``'s table."""
    return [float(m[1]) for m in re.finditer(r"^\s*\d+\s+(\S+)\s", output, re.MULTILINE)]


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_each_option_runs_in_simulate(args: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--nodes", "8", "--rounds", "12", "--seed", "3", *args]) == 0
    consensus = _consensus(capfd.readouterr().out)
    assert len(consensus) >= 2 and consensus[-1] < consensus[0]  # the nodes average


@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_each_option_runs_in_node(args: list[str], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = ["node", "--task", "digits", "--steps", "4", "--insecure", "--listen", "tcp://127.0.0.1:0",
            "--progress", "none", "--report", str(report), *args]  # fmt: skip
    assert main(argv) == 0
    written = json.loads(report.read_text())
    (record,) = written["nodes"]
    assert record["status"] == "finished" and record["steps"] == 4
    config = parse_config(argv)
    assert isinstance(config, Averaging)
    shown = summary(config)
    for field in dataclasses.fields(Averaging):  # the report says what the node ran with
        assert written["config"][field.name] == shown[field.name], field.name


class Toy(DPSGD):
    """D-PSGD under another name: an algorithm that only the registry knows of."""

    name = "toy"


@pytest.fixture
def toy() -> Iterator[AlgorithmFamily]:
    families, choices = dict(registry.FAMILIES), dict(registry._CHOICES)
    family = AlgorithmFamily(
        Toy, Params({}), Topology("ring"), summary="D-PSGD for the test", parameters="none"
    )
    register(family)
    yield family
    registry.FAMILIES.clear()
    registry.FAMILIES.update(families)
    registry._CHOICES.clear()
    registry._CHOICES.update(choices)


def test_a_registered_algorithm_shows_in_every_command_and_the_docs_table(
    toy: AlgorithmFamily, capfd: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in ("node", "mesh", "simulate"):
        help_text = re.sub(r"\s+", " ", commands[command].format_help())
        assert "dpsgd, sgp, adpsgd, choco, toy" in help_text, command
    mesh = parse_config(["mesh", "--algorithm", "toy"], {})
    assert isinstance(mesh, Averaging) and mesh.algorithm.family is toy
    assert main(["simulate", "--algorithm", "toy", "--nodes", "4", "--rounds", "5"]) == 0
    assert "simulated 4 nodes, toy" in capfd.readouterr().out
    assert "| `toy` | D-PSGD for the test | none |" in algorithm_table().splitlines()
    with pytest.raises(ValueError, match="'toy' is registered already"):
        register(toy)


def test_the_docs_table_is_the_registrys() -> None:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    assert algorithm_table() in text
