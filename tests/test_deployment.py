"""Containers without a container engine: the image's install steps and entrypoint run as the
Dockerfile says, configured only by environment variables; compose and Kubernetes manifests
checked for what a mesh needs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import HANG_S
from test_observability import get

from gossipmesh.config import CONFIG_ENV, ENV_PREFIX, NodeConfig, load
from p2p.address import free_ports

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OPTIONS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(NodeConfig)} | {CONFIG_ENV}


def _copied() -> list[str]:
    """What the Dockerfile's wheel stage copies into its build folder."""
    text = (ROOT / "Dockerfile").read_text()
    wheel_stage = text[text.index(" AS wheel") : text.index("RUN pip wheel")]
    return [
        name for line in re.findall(r"^COPY (.+) \S+$", wheel_stage, re.MULTILINE) for name in line.split()
    ]


COPIED = _copied()


def dockerfile() -> dict[str, Any]:
    """The Dockerfile's stages, ENV of the base stage, ENTRYPOINT, HEALTHCHECK command, users."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, re.MULTILINE)
    env_lines = re.findall(r"^ENV (.*)$", text, re.MULTILINE)
    env = {
        k: v for line in env_lines for k, v in re.findall(r"(\w+)=(\S+)", line) if k.startswith(ENV_PREFIX)
    }
    (entrypoint,) = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    (healthcheck,) = re.findall(r"^HEALTHCHECK .* CMD (\[.*\])$", text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    return {
        "stages": stages,
        "env": env,
        "entrypoint": json.loads(entrypoint),
        "healthcheck": json.loads(healthcheck),
        "users": users,
    }


def test_dockerfile_runs_the_daemon_as_a_user_with_a_health_check() -> None:
    image = dockerfile()
    assert image["stages"][-1] == "cpu" and "cuda" in image["stages"]  # cpu is the default target
    assert image["entrypoint"] == ["gossipmesh", "node"]  # exec form: SIGTERM reaches the daemon
    assert image["healthcheck"][:2] == ["python", "-c"] and "/healthz" in image["healthcheck"][2]
    assert image["users"] == ["gossipmesh", "gossipmesh"]  # both final stages
    assert set(image["env"]) <= OPTIONS and "GOSSIPMESH_METRICS_PORT" in image["env"]
    config = load(NodeConfig, {}, image["env"])  # the image's defaults are a valid config
    assert config.metrics_port == 9100 and config.listen == "tcp://0.0.0.0:7000"


def test_compose_mesh_discovers_itself_through_the_service_name() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    node = compose["services"]["node"]
    env = node["environment"]
    assert set(env) <= OPTIONS
    assert env["GOSSIPMESH_BOOTSTRAP"] == "tcp://node:7000"
    assert env["GOSSIPMESH_CONFIG"] == "/etc/gossipmesh/node.toml"
    mounts = {volume.split(":")[1] for volume in node["volumes"]}
    assert mounts == {"/etc/gossipmesh/node.toml", "/etc/gossipmesh/keys"}
    assert (DEPLOY / "node.toml").exists() and (DEPLOY / "keys").is_dir()
    assert load(NodeConfig, {}, dockerfile()["env"], DEPLOY / "node.toml").duration == 3600  # in the image
    cuda = yaml.safe_load((DEPLOY / "compose.cuda.yaml").read_text())["services"]["node"]
    assert cuda["build"]["target"] == "cuda"
    assert cuda["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_kubernetes_statefulset_behind_a_headless_service() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    documents = {}
    for name in kustomization["resources"]:
        document = yaml.safe_load((DEPLOY / name).read_text())
        documents[document["kind"]] = document
    assert kustomization["configMapGenerator"][0]["files"] == ["node.toml"]
    service, statefulset = documents["Service"], documents["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == statefulset["spec"]["template"]["metadata"]["labels"]
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {name for name in env if name.startswith(ENV_PREFIX)} <= OPTIONS
    assert env["GOSSIPMESH_BOOTSTRAP"] == f"tcp://{service['metadata']['name']}:7000"
    assert env["GOSSIPMESH_EXPECT"] == str(statefulset["spec"]["replicas"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/etc/gossipmesh/keys"]]["secret"]["secretName"] == "gossipmesh-keys"
    assert volumes[mounts["/etc/gossipmesh/node.toml"]]["configMap"]["name"] == "gossipmesh-config"
    cuda = yaml.safe_load((DEPLOY / "k8s" / "cuda" / "kustomization.yaml").read_text())
    assert cuda["resources"] == ["../.."] and cuda["images"][0]["newTag"] == "cuda"
    (patch,) = yaml.safe_load(cuda["patches"][0]["patch"])
    assert patch["path"] == "/spec/template/spec/containers/0/resources/limits"
    assert patch["value"] == {"nvidia.com/gpu": 1}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's install steps: a wheel of the project (no dependencies) built from the files
    the Dockerfile copies, installed on its own; the folder it was installed into."""
    root = tmp_path_factory.mktemp("image")
    source, wheels, site = root / "src", root / "wheels", root / "site"
    source.mkdir()
    for name in COPIED:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels),
                    str(source)], check=True, cwd=root, capture_output=True)  # fmt: skip
    (wheel,) = wheels.glob("gossipmesh-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return site


def test_the_installed_distribution_has_only_its_own_top_level_names(installed: Path) -> None:
    names = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")}
    names -= {"bin", "__pycache__"}
    assert names == {"gossipmesh", "p2p", "gossip", "topologies", "node.py"}
    (info,) = installed.glob("gossipmesh-*.dist-info")
    assert (info / "top_level.txt").read_text().split() == [
        "gossip",
        "gossipmesh",
        "node",
        "p2p",
        "topologies",
    ]
    packages = {
        p.parent.relative_to(installed).as_posix() for p in (installed / "gossipmesh").rglob("__init__.py")
    }
    subpackages = ("cli", "config", "daemon", "integrations", "mesh", "sim", "tasks")
    assert packages == {"gossipmesh", *(f"gossipmesh/{sub}" for sub in subpackages)}


@pytest.mark.mesh
def test_image_entrypoint_configured_only_by_environment_joins_a_mesh(
    tmp_path: Path, installed: Path
) -> None:
    site = installed
    image = dockerfile()
    entrypoint = [str(site / "bin" / image["entrypoint"][0]), *image["entrypoint"][1:]]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    base_env["PYTHONPATH"] = str(site)  # the wheel's code, not this checkout's
    keys = tmp_path / "keys"  # what the image expects mounted at GOSSIPMESH_KEYS: one pair for the mesh
    subprocess.run([str(site / "bin" / "gossipmesh"), "keygen", str(keys), "--name", "mesh"], env=base_env,
                   check=True, capture_output=True)  # fmt: skip
    gossip_port = free_ports(1, block=4)[0]
    metrics_port = gossip_port + 2
    nodes = []
    for rank in range(2):
        env = {
            **base_env,
            **image["env"],
            "GOSSIPMESH_LISTEN": f"tcp://127.0.0.1:{gossip_port + rank}",
            "GOSSIPMESH_METRICS_PORT": str(metrics_port + rank),
            "GOSSIPMESH_REPORT": str(tmp_path / f"report-{rank}.json"),
            "GOSSIPMESH_EXPECT": "2",
            "GOSSIPMESH_STEPS": "300",
            "GOSSIPMESH_COMPUTE_MS": "30",  # 9 s or more: alive when the health check comes
            "GOSSIPMESH_THREADS": "1",
            "GOSSIPMESH_TASK": "sine_regression:make_task",  # a user's task, from the working folder
            "GOSSIPMESH_PARTITION": "dirichlet:0.3",
            "GOSSIPMESH_LOG_FORMAT": "json",
            "GOSSIPMESH_KEYS": str(keys),
            "GOSSIPMESH_TRUSTED": str(keys),
            **({"GOSSIPMESH_BOOTSTRAP": f"tcp://127.0.0.1:{gossip_port}"} if rank else {}),
        }
        process = subprocess.Popen(
            entrypoint, env=env, cwd=ROOT / "examples", stderr=subprocess.PIPE, text=True
        )
        nodes.append((process, env))
    while get(f"http://127.0.0.1:{metrics_port + 1}/readyz")[0] != 200:
        if any(process.poll() is not None for process, _ in nodes):
            break
        time.sleep(0.05)
    health = subprocess.run(image["healthcheck"], env=nodes[1][1], capture_output=True, timeout=HANG_S)
    errors = [process.communicate(timeout=HANG_S)[1] for process, _ in nodes]
    assert health.returncode == 0, errors
    where = subprocess.run([sys.executable, "-c", "import node; print(node.__file__)"], env=base_env,
                           cwd=tmp_path, capture_output=True, text=True, check=True)  # fmt: skip
    assert where.stdout.startswith(str(site))
    for rank, (process, _) in enumerate(nodes):
        assert process.returncode == 0, errors[rank][-2000:]
        events = [json.loads(line) for line in errors[rank].splitlines()]  # every line one JSON object
        assert {"listening", "progress"} <= {e.get("event") for e in events}
        assert "finished: 300 steps" in events[-1]["message"]
        (node,) = json.loads((tmp_path / f"report-{rank}.json").read_text())["nodes"]
        assert node["status"] == "finished" and node["steps"] == 300 and node["rank"] == rank
        assert node["shard"]["partition"] == "dirichlet:0.3"
        counts = node["shard"]["label_counts"]
        assert min(counts.values()) < 0.5 * max(counts.values())  # label skew (iid: within a few %)
        assert node["final"]["loss"] < 0.5 * node["timeline"][0]["loss"]
