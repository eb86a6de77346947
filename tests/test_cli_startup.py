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
