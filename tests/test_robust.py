"""Byzantine-robust mixing: the rules on vectors, and a mesh with one node sending bad models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gossip.algorithms.robust import RobustRule
from node import main
from topologies import SpecError


def test_clipping_bounds_a_far_neighbour_and_spares_the_close_ones() -> None:
    own = np.zeros(4, np.float32)
    honest = np.array([1.0, 0, 0, 0], np.float32)
    liar = np.array([0, 1e6, 0, 0], np.float32)
    out = np.empty(4, np.float32)
    rule = RobustRule.parse("clip")
    rule.mix(own, {"h": (honest, 0.25), "m": (liar, 0.25)}, out)
    # tau = distance to the closest (d - b = 1st) neighbour = 1: the liar moves us by 0.25 at most
    np.testing.assert_allclose(out, [0.25, 0.25, 0, 0], atol=1e-6)
    plain = RobustRule("clip", tolerate=0)
    plain.mix(own, {"h": (honest, 0.25), "m": (honest * 3, 0.25)}, out)
    np.testing.assert_allclose(out, [1.0, 0, 0, 0])  # nobody clipped: the weighted mean


def test_trimmed_mean_drops_the_extremes_of_every_coordinate() -> None:
    own = np.array([1.0, 5.0], np.float32)
    values = [
        np.array([2.0, -1e9], np.float32),
        np.array([1e9, 6.0], np.float32),
        np.array([3.0, 7.0], np.float32),
    ]
    out = np.empty(2, np.float32)
    rule = RobustRule.parse("trimmed-mean:b=1")
    rule.mix(own, {str(i): (v, 0.25) for i, v in enumerate(values)}, out)
    np.testing.assert_allclose(out, [2.5, 5.5])
    # b=2 of 4 values would trim them all: the node keeps its own value (tests/test_hardening_gossip.py)
    RobustRule("trimmed-mean", tolerate=2).mix(own, {str(i): (v, 0.25) for i, v in enumerate(values)}, out)
    np.testing.assert_array_equal(out, own)


def test_rules_parse_or_say_what_parses() -> None:
    assert str(RobustRule.parse("clip:b=2")) == "clip:b=2"
    assert RobustRule.parse("trimmed-mean") == RobustRule("trimmed-mean", 1)
    with pytest.raises(SpecError, match="unknown robust rule 'krum'; choose one of clip, trimmed-mean"):
        RobustRule.parse("krum")


def _honest_accuracies(tmp_path: Path, robust: str) -> list[float]:
    run_dir = tmp_path / robust
    argv = ["mesh", "--nodes", "5", "--topology", "complete", "--steps", "300", "--insecure",
            # with and without the rule alike: a round every step, every honest value in it
            "--algorithm", "dpsgd:stragglers=wait",
            "--byzantine", "4:random:5", "--robust", robust, "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    report: dict[str, Any] = json.loads((run_dir / "report.json").read_text())
    return [n["final"]["accuracy"] for n in report["nodes"] if n["id"] != "node-4"]


@pytest.mark.mesh
@pytest.mark.usefixtures("no_other_threads")
def test_honest_nodes_reach_the_target_with_robust_mixing_and_not_without(tmp_path: Path) -> None:
    plain = _honest_accuracies(tmp_path, "none")
    # one node sending noise ruins plain averaging: most honest nodes (on a loaded machine one
    # that missed most of the noise in its rounds' waits ended at 0.82, the others at 0.05-0.15)
    assert sorted(plain)[2] < 0.5, plain
    for rule in ("clip", "trimmed-mean"):
        robust = _honest_accuracies(tmp_path, rule)
        assert min(robust) >= 0.93, (rule, robust)
