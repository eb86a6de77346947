"""Builds the node image and runs it in a real container engine: what ``make image-check`` runs.

    python bench/image_check.py                 # docker when its daemon answers, else podman
    python bench/image_check.py --setup ../shared/containers/setup.sh \\
        --build-arg PYTHON_IMAGE=localhost/py311-debian --build-arg "TORCH_SOURCE=--find-links /opt/wheels"

1. The Dockerfile's cpu target builds as ``gossipmesh:cpu`` (podman with ``--format docker``: the
   OCI format drops HEALTHCHECK) and keeps its HEALTHCHECK.
2. Three containers on a bridge network of the engine, each with its own CURVE pair and one folder
   of the trusted public keys mounted read-only, train digits together (``--expect 3``), with
   checkpoints on a volume each. ``/healthz``, ``/readyz`` and ``/metrics`` answer on the ports
   published to the host, and the engine reports each HEALTHCHECK healthy.
3. node-2 is killed (``kill -s KILL``) once it has a checkpoint and started again on its volume:
   it resumes from the checkpoint. node-3 starts later with ``--expect 0``: it joins the running
   mesh and takes its state. Every node finishes at held-out accuracy >= 0.93.
4. ``deploy/compose.yaml`` with the same image (podman-compose, or docker compose), 3 replicas
   and one key pair for the mesh: every service trains for 20 s, exits 0 and reaches >= 0.93.

Prints the figures. Exit status: 0 when every check passed, 1 when one failed, 2 without an
engine. Everything it makes is named ``gm-check-PID-*`` and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "gossipmesh:cpu"  # the tag deploy/compose.yaml runs
IMAGE_USER = "gossipmesh"  # the image's non-root user: owns the mounted secret keys (mode 0600)
METRICS_PORT = 9100  # the image's GOSSIPMESH_METRICS_PORT
STATE = "/var/lib/gossipmesh"  # the user's home in the image: checkpoints and report.json
TARGET = 0.93  # held-out accuracy every node reaches
STEPS, COMPUTE_MS, CHECKPOINT_EVERY = 600, 60, 50  # 36 s or more: time to kill, resume and join
COMPOSE_NODES, COMPOSE_SECONDS = 3, 20
NO_ENGINE = "no container engine here (docker with a running daemon, or podman)"

T = TypeVar("T")


class CheckError(RuntimeError):
    """A step could not be done; the message says what was seen."""


@dataclass(frozen=True)
class Engine:
    """docker or podman, with the global flags every command takes, the flags of a build and
    those of every container the check starts itself."""

    program: str
    flags: tuple[str, ...] = ()
    build_flags: tuple[str, ...] = ()
    run_flags: tuple[str, ...] = ()

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> str:
        """Runs ``PROGRAM FLAGS ARGS``; its stdout. A failure raises CheckError with its output."""
        return run([self.program, *self.flags, *args], timeout=timeout, check=check)

    def start(self, *args: str) -> str:
        """``run ARGS`` with the run flags; its stdout."""
        return self("run", *self.run_flags, *args)

    def works(self) -> bool:
        """The engine answers (docker: its daemon runs)."""
        info = subprocess.run([self.program, *self.flags, "info"], capture_output=True, timeout=60)
        return info.returncode == 0

    def compose(self) -> list[str]:
        """The compose command of this engine."""
        if self.program == "docker":
            return ["docker", *self.flags, "compose"]
        if importlib.util.find_spec("podman_compose") is None:
            raise CheckError(f"no podman-compose for {sys.executable}: pip install podman-compose")
        return [sys.executable, "-m", "podman_compose", f"--podman-args={shlex.join(self.flags)}"]

    def logs(self, container: str, lines: int = 20) -> str:
        """The end of the container's log (its stdout and stderr)."""
        command = [self.program, *self.flags, "logs", "--tail", str(lines), container]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def health(self, container: str) -> str:
        """The engine's health status of ``container`` once it has one. Podman runs the check on
        demand here: it schedules checks with systemd timers, which a sandbox lacks."""

        def status() -> str | None:
            if self.program == "podman":
                self("healthcheck", "run", container, check=False)  # its verdict is read below
            state = self("inspect", "--format", "{{.State.Health.Status}}", container).strip()
            return None if state == "starting" else state

        return wait_until(f"{container}'s health check", status, 60.0, interval=1.0)[0]

    def published(self, container: str) -> str:
        """``http://HOST:PORT`` of the container's metrics port on the host (it changes on restart)."""
        host, port = self("port", container, f"{METRICS_PORT}/tcp").split()[0].rsplit(":", 1)
        return f"http://{host.strip('[]')}:{port}"


def run(
    command: Sequence[str], *, timeout: float, check: bool = True, env: dict[str, str] | None = None
) -> str:
    """Runs ``command``; its stdout. A failure raises CheckError with the end of its output."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CheckError(f"{shlex.join(command)} took more than {timeout:.0f} s") from None
    if check and done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-3000:]
        raise CheckError(f"{shlex.join(command)} failed with exit status {done.returncode}:\n{output}")
    return done.stdout


def wait_until(
    what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.2
) -> tuple[T, float]:
    """Polls ``probe`` until it returns something other than None: that and the seconds waited."""
    start = time.monotonic()
    while (value := probe()) is None:
        if time.monotonic() - start > timeout:
            raise CheckError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
    return value, time.monotonic() - start


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except OSError:
        return 0, ""


def find_engine(name: str | None = None, setup: Path | None = None) -> Engine | None:
    """``name``, or docker when its daemon answers, else podman; None when none works. ``setup``
    is a script that prints podman's flags (``--runtime-flag``, ``--build-flags``), as
    ``../shared/containers/setup.sh`` does for a sandbox."""
    for program in [name] if name else ["docker", "podman"]:
        if shutil.which(program) is None:
            continue
        engine = Engine(program)
        if program == "podman" and setup is not None:
            flags, build_flags = (shlex.split(run([str(setup), flag], timeout=30)) for flag in
                                  ("--runtime-flag", "--build-flags"))  # fmt: skip
            engine = Engine(program, tuple(flags), tuple(build_flags))
        if engine.works():
            return engine
    return None


def build(engine: Engine, build_args: Sequence[str] = ()) -> float:
    """Builds the Dockerfile's cpu target as IMAGE; the seconds it took."""
    image_format = ["--format", "docker"] if engine.program == "podman" else []
    args = [word for arg in build_args for word in ("--build-arg", arg)]
    start = time.monotonic()
    engine("build", *image_format, *engine.build_flags, *args, "--target", "cpu", "-t", IMAGE, str(ROOT),
           timeout=1800)  # fmt: skip
    seconds = time.monotonic() - start
    check = json.loads(engine("image", "inspect", "--format", "{{json .Config.Healthcheck}}", IMAGE))
    if not check or "/healthz" not in " ".join(check.get("Test", [])):
        raise CheckError(f"{IMAGE} has no HEALTHCHECK of /healthz: {check}")
    return seconds


def container_limits(engine: Engine) -> tuple[str, ...]:
    """``--ulimit`` flags of the open files and processes a container gets from the engine.
    Engines ask to raise both for a container, and podman asks again for every ``exec`` (so every
    health check): where raising is refused (no CAP_SYS_RESOURCE, as in a sandbox whose runtime
    drops a container's limits) exec fails, so the check's containers ask for what they get."""
    limits = engine("run", "--rm", "--entrypoint", "cat", IMAGE, "/proc/self/limits")
    flags = []
    for name, label in (("nofile", "Max open files"), ("nproc", "Max processes")):
        found = re.search(rf"^{label}\s+(\S+)\s+(\S+)", limits, re.MULTILINE)
        if found is None:
            raise CheckError(f"no '{label}' in a container's /proc/self/limits:\n{limits}")
        soft, hard = ("-1" if value == "unlimited" else value for value in found.groups())
        flags.append(f"--ulimit={name}={soft}:{hard}")
    return tuple(flags)


def as_root(engine: Engine, folder: Path, script: str) -> None:
    """Runs a shell script as root in the image, ``folder`` mounted at /out."""
    engine.start("--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{folder}:/out", IMAGE, "-c", script)


def make_keys(engine: Engine, folder: Path, names: Sequence[str]) -> None:
    """With the image's own keygen: each name's CURVE pair in ``folder/keys/NAME`` (owned by the
    image's user, the secret mode 0600) and every public key in ``folder/trusted``."""
    pairs = "".join(f"gossipmesh keygen /out/keys/{n} --name {n}; cp /out/keys/{n}/{n}.key /out/trusted; "
                    for n in names)  # fmt: skip
    as_root(engine, folder, f"set -e; mkdir -p /out/trusted; {pairs}chown -R {IMAGE_USER} /out/keys")


@contextlib.contextmanager
def scratch(engine: Engine) -> Iterator[Path]:
    """A host folder to mount; what containers wrote there (as root or the image's user) is
    removed by a container, then the folder."""
    folder = Path(tempfile.mkdtemp(prefix="gm-check-"))
    try:
        yield folder
    finally:
        with contextlib.suppress(CheckError):
            as_root(engine, folder, "rm -rf /out/* /out/.[!.]*")
        shutil.rmtree(folder, ignore_errors=True)


def read_report(engine: Engine, container: str, folder: Path) -> dict[str, Any]:
    """The node record of the report a (stopped) container wrote."""
    path = folder / f"{container}.report.json"
    engine("cp", f"{container}:{STATE}/report.json", str(path))
    (record,) = json.loads(path.read_text())["nodes"]
    return dict(record)


def finish(
    engine: Engine, containers: dict[str, str], folder: Path, timeout: float
) -> dict[str, dict[str, Any]]:
    """Waits for the containers (by node name) to exit: per node its exit code and its report's
    status, steps, accuracy, resumed_from and state_transfer, or the end of its log without one."""
    deadline = time.monotonic() + timeout
    results: dict[str, dict[str, Any]] = {}
    for name, container in containers.items():
        code = int(engine("wait", container, timeout=max(deadline - time.monotonic(), 1.0)).split()[0])
        try:
            record = read_report(engine, container, folder)
        except CheckError:
            results[name] = {"exit": code, "log": engine.logs(container)}
            continue
        results[name] = {
            "exit": code,
            "status": record["status"],
            "steps": record["steps"],
            "accuracy": round(record["final"].get("accuracy", 0.0), 3),
            "resumed_from": record["resumed_from"],
            "state_transfer": {k: record["state_transfer"][k] for k in ("bytes", "seconds")}
            if record["state_transfer"]
            else None,
        }
    return results


def finished_failures(results: dict[str, dict[str, Any]]) -> list[str]:
    """What went wrong with the finished containers: an exit code, a status, an accuracy."""
    return [
        f"{name}: exit {r['exit']}, status {r.get('status')}, accuracy {r.get('accuracy')} "
        f"(wanted 0, finished, >= {TARGET}){(chr(10) + r['log']) if 'log' in r else ''}"
        for name, r in results.items()
        if r["exit"] != 0 or r.get("status") != "finished" or r.get("accuracy", 0.0) < TARGET
    ]


@dataclass
class MeshFigures:
    """What the mesh of containers did."""

    ready_s: float = 0.0  # from the first start until all three answered /readyz
    endpoints: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> path -> HTTP status
    steps_in_metrics: dict[str, int] = field(default_factory=dict)  # gossipmesh_steps_total when probed
    health: dict[str, str] = field(default_factory=dict)  # the engine's verdict on the HEALTHCHECK
    killed_at: str = ""  # node-2's newest checkpoint when it was killed
    back_ready_s: float = 0.0  # from its start again until /readyz
    joiner_ready_s: float = 0.0
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # see finish()
    seconds: float = 0.0

    def failures(self) -> list[str]:
        problems = [
            f"{node} {path}: HTTP {status}"
            for node, statuses in self.endpoints.items()
            for path, status in statuses.items()
            if status != 200
        ]
        problems += [f"{node}: health {state}" for node, state in self.health.items() if state != "healthy"]
        problems += finished_failures(self.results)
        resumed = self.results.get("node-2", {}).get("resumed_from")
        if not resumed or _step_of(resumed) < _step_of(self.killed_at):
            problems.append(f"node-2 resumed from {resumed}, not from {self.killed_at} or a later checkpoint")
        if not (self.results.get("node-3", {}).get("state_transfer") or {}).get("bytes"):
            problems.append(f"node-3 took no state: {self.results.get('node-3')}")
        return problems


def _step_of(checkpoint: str) -> int:
    """The step count in a checkpoint's file name."""
    match = re.search(r"checkpoint-(\d+)\.safetensors", checkpoint)
    return int(match.group(1)) if match else -1


def check_mesh(engine: Engine) -> MeshFigures:
    """Steps 2 and 3 of the module's docstring."""
    prefix = f"gm-check-{os.getpid()}"
    network, figures = f"{prefix}-net", MeshFigures()
    names = [f"node-{i}" for i in range(4)]  # node ids, key names and host names on the network
    containers = {name: f"{prefix}-{name}" for name in names}
    start = time.monotonic()
    with scratch(engine) as folder, contextlib.ExitStack() as cleanup:
        make_keys(engine, folder, names)
        engine("network", "create", network)
        cleanup.callback(engine, "network", "rm", "-f", network, check=False)

        def launch(name: str, expect: int) -> None:
            env = {
                "ID": name,
                "TRUSTED": "/etc/gossipmesh/trusted",
                "EXPECT": expect,
                "STATE_DIR": f"{STATE}/state",
                "CHECKPOINT_EVERY": CHECKPOINT_EVERY,
                "STEPS": STEPS,
                "COMPUTE_MS": COMPUTE_MS,
                "THREADS": 1,
                "LOG_FORMAT": "json",
                **({"BOOTSTRAP": "tcp://node-0:7000"} if name != "node-0" else {}),
            }
            volume = f"{containers[name]}-state"
            cleanup.callback(engine, "volume", "rm", "-f", volume, check=False)
            cleanup.callback(engine, "rm", "-f", containers[name], check=False)  # first: last in, first out
            engine.start("-d", "--name", containers[name], "--network", network, "--network-alias", name,
                         "-p", f"127.0.0.1::{METRICS_PORT}", "-v", f"{volume}:{STATE}",
                         "-v", f"{folder}/keys/{name}:/etc/gossipmesh/keys:ro",
                         "-v", f"{folder}/trusted:/etc/gossipmesh/trusted:ro",
                         *(f"--env=GOSSIPMESH_{k}={v}" for k, v in env.items()), IMAGE)  # fmt: skip

        def wait_ready(*nodes: str) -> float:
            """Seconds until every node answers /readyz; a failure shows the end of their logs."""

            def ready() -> bool | None:
                return all(get(engine.published(containers[n]) + "/readyz")[0] == 200 for n in nodes) or None

            try:
                return wait_until(f"{', '.join(nodes)} ready", ready, 120.0)[1]
            except CheckError as error:
                logs = "".join(f"\n{n}:\n{engine.logs(containers[n])}" for n in nodes)
                raise CheckError(f"{error}{logs}") from None

        first = names[:3]
        for name in first:
            launch(name, expect=3)
        figures.ready_s = wait_ready(*first)
        for name in first:
            url = engine.published(containers[name])
            answers = {path: get(url + path) for path in ("/healthz", "/readyz", "/metrics")}
            figures.endpoints[name] = {path: status for path, (status, _) in answers.items()}
            steps = re.search(r"^gossipmesh_steps_total (\S+)$", answers["/metrics"][1], re.MULTILINE)
            figures.steps_in_metrics[name] = int(float(steps.group(1))) if steps else -1
            figures.health[name] = engine.health(containers[name])

        restarted = containers["node-2"]

        def checkpoints() -> list[str] | None:
            listing = engine("exec", restarted, "ls", f"{STATE}/state", check=False).split()
            return sorted(n for n in listing if n.endswith(".safetensors")) or None

        figures.killed_at = wait_until("node-2's first checkpoint", checkpoints, 120.0)[0][-1]
        engine("kill", "-s", "KILL", restarted)
        engine("wait", restarted)
        engine("start", restarted)
        figures.back_ready_s = wait_ready("node-2")
        launch("node-3", expect=0)
        figures.joiner_ready_s = wait_ready("node-3")
        figures.results = finish(engine, containers, folder, timeout=300.0)
    figures.seconds = time.monotonic() - start
    return figures


@dataclass
class ComposeFigures:
    """What deploy/compose.yaml did."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # see finish()
    seconds: float = 0.0

    def failures(self) -> list[str]:
        count = [] if len(self.results) == COMPOSE_NODES else [f"{len(self.results)} services ran"]
        return count + finished_failures(self.results)


def check_compose(engine: Engine) -> ComposeFigures:
    """Step 4 of the module's docstring: the compose file as it is, with two overrides (a run of
    COMPOSE_SECONDS instead of node.toml's hour, and the mesh's key folder)."""
    project, figures = f"gm-check-{os.getpid()}-compose", ComposeFigures()
    start = time.monotonic()
    with scratch(engine) as folder, contextlib.ExitStack() as cleanup:
        make_keys(engine, folder, ["mesh"])
        override = folder / "override.yaml"  # JSON is YAML
        override.write_text(json.dumps({"services": {"node": {
            "environment": {"GOSSIPMESH_DURATION": str(COMPOSE_SECONDS), "GOSSIPMESH_THREADS": "1"},
            "volumes": [f"{folder}/keys/mesh:/etc/gossipmesh/keys:ro"],
        }}}))  # fmt: skip
        files = ["-f", str(ROOT / "deploy" / "compose.yaml"), "-f", str(override)]
        compose = [*engine.compose(), "-p", project, *files]
        env = {**os.environ, "NODES": str(COMPOSE_NODES)}
        cleanup.callback(run, [*compose, "down", "-v", "-t", "5"], timeout=120, check=False, env=env)
        run([*compose, "up", "-d", "--no-build"], timeout=120, env=env)
        label = f"label=com.docker.compose.project={project}"
        containers = engine("ps", "-a", "--filter", label, "--format", "{{.Names}}").split()
        services = {container: container for container in sorted(containers)}
        figures.results = finish(engine, services, folder, timeout=COMPOSE_SECONDS + 120.0)
    figures.seconds = time.monotonic() - start
    return figures


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("docker", "podman"), help="default: docker, else podman")
    parser.add_argument(
        "--setup", type=Path, help="a script printing podman's --runtime-flag and --build-flags"
    )
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="a build argument of the Dockerfile (repeat)")  # fmt: skip
    return parser.parse_args(argv)


def show(title: str, figures: MeshFigures | ComposeFigures) -> bool:
    """Prints the figures and the failures; True when there were none."""
    print(f"{title}: {figures.seconds:.1f} s")
    for key, value in vars(figures).items():
        if key != "seconds":
            print(f"  {key}: {json.dumps(value)}")
    failures = figures.failures()
    print("\n".join(f"  FAILED {failure}" for failure in failures) or "  ok")
    return not failures


def prepare(options: argparse.Namespace) -> tuple[Engine, float] | None:
    """The engine, ready to start the check's containers, and the seconds the image's build took;
    None without an engine."""
    engine = find_engine(options.engine, options.setup)
    if engine is None:
        return None
    seconds = build(engine, options.build_arg)
    return dataclasses.replace(engine, run_flags=container_limits(engine)), seconds


def main() -> int:
    options = parse_args()
    start = time.monotonic()
    prepared = prepare(options)
    if prepared is None:
        print(NO_ENGINE)
        return 2
    engine, build_seconds = prepared
    print(
        f"engine: {shlex.join([engine.program, *engine.flags])}; containers: {shlex.join(engine.run_flags)}"
    )
    print(f"build: {build_seconds:.1f} s, {IMAGE} with its HEALTHCHECK")
    passed = show("mesh of containers", check_mesh(engine))
    passed = show("compose", check_compose(engine)) and passed
    print(f"image check: {time.monotonic() - start:.1f} s, {'ok' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
