"""The command line answers what needs no training without importing torch (or anything heavy it
does not use), and says what to fix in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ml_dtypes", "matplotlib", "sklearn", "transformers")
#: runs ``node.main(ARGV)`` in a fresh interpreter, then prints its exit code and the heavy modules
#: it imported as the last line
_PROBE = f"""
import json, sys
import node
try:
    code = node.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
REPORT = {
    "wall_time_s": 2.0,
    "nodes": [
        {
            "id": "a",
            "status": "finished",
            "steps": 2,
            "bytes_sent": 100,
            "final": {"accuracy": 0.5},
            "timeline": [
                {"t": 1.0, "loss": 2.0, "accuracy": 0.3, "consensus": 0.1, "bytes_sent": 0},
                {"t": 2.0, "loss": 1.0, "accuracy": 0.5, "consensus": 0.01, "bytes_sent": 100},
            ],
        }
    ],
}


def _run(*argv: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.stdout, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done


@pytest.mark.parametrize(
    ("argv", "code", "allowed"),
    [
        (["--help"], 0, ()),
        (["node", "--help"], 0, ()),
        (["keygen", "{tmp}/keys", "--name", "x"], 0, ()),
        (["node", "--steps", "3", "--duration", "4", "--insecure"], 2, ()),  # an invalid combination
        (["mesh", "--nodes", "4", "--topology", "hypercube:dim=3"], 2, ()),
        (["topology", "ring", "--nodes", "16"], 0, ()),
        (["report", "{tmp}/report.json"], 0, ("matplotlib",)),  # (it plots)
    ],
)
def test_a_command_that_does_not_train_imports_no_torch(
    tmp_path: Path, argv: list[str], code: int, allowed: tuple[str, ...]
) -> None:
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    result, done = _run(*(arg.format(tmp=tmp_path) for arg in argv))
    assert result["code"] == code, done.stderr
    assert [m for m in result["heavy"] if m not in allowed] == []


def test_the_library_names_still_resolve_from_the_package() -> None:
    import gossipmesh

    assert all(getattr(gossipmesh, name) is not None for name in gossipmesh.__all__)
    assert gossipmesh.GossipOptimizer.__name__ == "GossipOptimizer"


def test_the_topology_default_model_size_is_the_digits_model() -> None:
    from gossipmesh.cli.topology_view import DIGITS_MODEL_BYTES
    from gossipmesh.tasks import load_task

    model = load_task("digits").model(0)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == DIGITS_MODEL_BYTES


def test_keygen_without_a_name_refuses_to_overwrite_and_asks_for_one(tmp_path: Path) -> None:
    result, done = _run("keygen", str(tmp_path))
    assert result["code"] == 0, done.stderr
    (public,) = tmp_path.glob("*.key")
    before = public.read_bytes()
    result, done = _run("keygen", str(tmp_path))
    assert result["code"] == 1 and result["heavy"] == []
    assert f"{public} exists" in done.stderr and "pass --name NAME" in done.stderr
    assert public.read_bytes() == before


def test_an_unknown_environment_variable_names_the_closest_option() -> None:
    from gossipmesh.cli import parse_config
    from gossipmesh.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"GOSSIPMESH_STPES: no such option \(did you mean GOSSIPMESH_STEPS\?\)"
    ):
        parse_config(["node", "--insecure"], {"GOSSIPMESH_STPES": "5"})
    # another command's option passes: a mesh's nodes inherit the mesh's environment
    parse_config(["node", "--insecure"], {"GOSSIPMESH_NODES": "5"})


@pytest.mark.parametrize(
    "contents", ['{"nodes": []}', "[1, 2]", '{"wall_time_s": 1, "nodes": [{"id": "a"}]}']
)
def test_a_malformed_report_is_one_line(tmp_path: Path, contents: str) -> None:
    (tmp_path / "bad.json").write_text(contents)
    result, done = _run("report", str(tmp_path / "bad.json"))
    assert result["code"] == 1
    assert done.stderr.count("\n") == 1 and "is not a run report" in done.stderr


def test_a_mesh_bounds_its_nodes_a_daemon_runs_until_stopped() -> None:
    from gossipmesh.cli import parse_config
    from gossipmesh.config import DEFAULT_STEPS, MeshConfig, NodeConfig

    node = parse_config(["node", "--insecure"], {})
    assert isinstance(node, NodeConfig) and node.steps is None and node.duration is None
    mesh = parse_config(["mesh"], {})
    assert isinstance(mesh, MeshConfig) and mesh.bounded().steps == DEFAULT_STEPS
    timed = parse_config(["mesh", "--duration", "5"], {})
    assert isinstance(timed, MeshConfig) and timed.bounded().steps is None
