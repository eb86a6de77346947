"""Each example's usage, as its docstring prints it, runs: the commands of each ``::`` block in
order (a line ending in ``&`` in the background), with few steps, in a fresh folder."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from p2p.address import free_ports

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
STEPS = "3"  # instead of the printed --steps: the commands must run (gossip included), not converge
TRAINING = ("node", "mesh")  # the gossipmesh commands that take --steps (and every example)


def usage(path: Path) -> list[list[str]]:
    """The blocks of commands of the module docstring (continuation lines joined)."""
    doc = path.read_text().split('"""')[1]
    blocks = re.findall(r"::\n\n((?:    .*\n|\n)+)", doc + "\n")
    return [
        [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()] for block in blocks
    ]


def as_run(command: str, tmp: Path, ports: dict[str, int]) -> tuple[list[str], bool]:
    """The argv that runs ``command`` from ``tmp`` with this checkout, and whether it runs in
    the background: ``/tmp/`` becomes ``tmp``, each port a free one, the printed --steps few."""
    command = command.replace("/tmp/", f"{tmp}/")
    command = re.sub(
        r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports.setdefault(m[1], free_ports(1)[0])}", command
    )
    words = shlex.split(command)
    background = words[-1] == "&"
    words = words[:-1] if background else words
    if any(word in TRAINING or word.startswith("examples/") for word in words[:2]):
        words = re.sub(r"--steps \d+", f"--steps {STEPS}", " ".join(words)).split()
        words += [] if "--steps" in words else ["--steps", STEPS]
    program = [sys.executable, str(ROOT / "node.py")] if words[0] == "gossipmesh" else [sys.executable]
    rest = [str(ROOT / w) if w.startswith("examples/") else w for w in words[1:]]
    return [*program, *rest], background


@pytest.mark.mesh
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_usage_an_example_prints_runs(path: Path, tmp_path: Path) -> None:
    if "import transformers" in path.read_text() and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the test extra)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    ports: dict[str, int] = {}
    blocks = usage(path)
    assert blocks, f"{path.name} prints no usage"
    for block in blocks:
        started = []
        for command in block:
            argv, background = as_run(command, tmp_path, ports)
            process = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
            if background:
                started.append((command, process))
            else:
                _, err = process.communicate()
                assert process.returncode == 0, f"{command}\n{err}"
        for command, process in started:
            _, err = process.communicate()
            assert process.returncode == 0, f"{command}\n{err}"
