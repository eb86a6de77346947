"""How fast the command line answers: the commands that train nothing, and a lone node's first step.

Each command runs ``--repeat`` times in a fresh interpreter (``python node.py ...``, what the
``gossipmesh`` script runs); the table shows the median wall time and CPU time (user + system of
the process), and for the node the median ``t_first_step`` of its report (seconds from the
process's start to its first training step). ``--root`` times another checkout (e.g. the commit
before a change) with this same script.

    python bench/startup.py [--repeat 5] [--root PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
_REPORT = ("--report", "{tmp}/report.json")
#: name -> (argv after ``gossipmesh``, the exit code it must end with); {tmp}: a fresh folder
COMMANDS: dict[str, tuple[list[str], int]] = {
    "--help": (["--help"], 0),
    "keygen DIR --name x": (["keygen", "{tmp}/keys", "--name", "x"], 0),
    "invalid combination": (["node", "--steps", "3", "--duration", "4", "--insecure"], 2),
    "topology ring --nodes 16": (["topology", "ring", "--nodes", "16"], 0),
    "node --steps 1 (first step)": (
        ["node", "--task", "digits", "--steps", "1", "--insecure", "--listen", "tcp://127.0.0.1:0", *_REPORT],
        0,
    ),
}


def timed(root: Path, argv: list[str], code: int) -> tuple[float, float, float | None]:
    """Wall s, CPU s and the report's t_first_step (None without a report) of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [arg.format(tmp=tmp) for arg in argv]
        env = {**os.environ, "PYTHONPATH": str(root)}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(root / "node.py"), *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != code:
            raise SystemExit(
                f"gossipmesh {' '.join(args)}: exit {done.returncode}, not {code}:\n{done.stderr}"
            )
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        report = Path(tmp) / "report.json"
        first = json.loads(report.read_text())["nodes"][0]["t_first_step"] if report.exists() else None
        return wall, cpu, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (the median is shown)")
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout to time (default: this one)")
    args = parser.parse_args()
    where = f"({args.root}, load {os.getloadavg()[0]:.1f})"
    print(f"{'command':<30} {'wall s':>7} {'CPU s':>7} {'first step s':>13}   {where}")
    for name, (argv, code) in COMMANDS.items():
        runs = [timed(args.root, argv, code) for _ in range(args.repeat)]
        wall, cpu = (statistics.median(r[i] for r in runs) for i in (0, 1))
        firsts = [r[2] for r in runs if r[2] is not None]
        first = f"{statistics.median(firsts):13.2f}" if firsts else f"{'':>13}"
        print(f"{name:<30} {wall:7.2f} {cpu:7.2f} {first}")


if __name__ == "__main__":
    main()
