"""The chaos harness: real daemons on network-namespace hosts (``tests/netns.py``), forked like
the local mesh's nodes (so none pays for importing torch) and driven by the test: kill -9,
SIGSTOP/SIGCONT, restart from the state folder, partition and heal.

Every node gets a CURVE key pair (all trusted), a state folder with a checkpoint every 10 steps,
its report in the run folder and the mesh clock; node i listens on host i, port 7000, and all
join through host 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.auth
from helpers import HANG_S
from wire_fuzz import decodes, hostile_messages

from gossipmesh.daemon.checkpoint import load_newest
from gossipmesh.mesh import netns
from gossipmesh.mesh.node_process import NodeProcess, preload_for_nodes
from node import main
from p2p.security.curve import NodeKeys, configure_client, keygen

PORT = 7000


class HostMesh:
    def __init__(self, hosts: list[netns.Host], run_dir: Path, *flags: str) -> None:
        self.hosts = hosts
        self.run_dir = run_dir
        self.flags = flags
        self.origin = time.time()
        self.trusted = run_dir / "trusted"
        self.trusted.mkdir(parents=True)
        self.nodes: dict[int, NodeProcess] = {}
        preload_for_nodes()
        for i in range(len(hosts)):
            public, _ = keygen(self.keys(i), f"node-{i}")
            shutil.copy(public, self.trusted)

    def keys(self, i: int) -> Path:
        return self.run_dir / "keys" / f"node-{i}"

    def address(self, i: int) -> str:
        return f"tcp://{self.hosts[i].address}:{PORT}"

    def state(self, i: int) -> Path:
        return self.run_dir / "state" / f"node-{i}"

    def clock(self) -> float:
        return time.time() - self.origin

    def start(self, i: int, *, expect: int, bootstrap: int = 0, logs: str = "logs") -> None:
        """Start (or restart) node i on host i."""
        log_dir = self.run_dir / logs
        log_dir.mkdir(exist_ok=True)
        node = NodeProcess(i, self.address(i), log_dir)
        node.report = self.run_dir / f"node-{i}.json"
        argv = [
            "node", "--id", node.id, "--listen", self.address(i),
            *(["--bootstrap", self.address(bootstrap)] if i != bootstrap else []),
            "--expect", str(expect),
            "--keys", str(self.keys(i)), "--trusted", str(self.trusted),
            "--state-dir", str(self.state(i)), "--checkpoint-every", "10",
            "--report", str(node.report), "--progress", "none",
            "--clock-origin", repr(self.origin), "--threads", "1",
            *self.flags,
        ]  # fmt: skip
        host = self.hosts[i]
        node.start(main, argv, enter=lambda: netns.enter(host))
        self.nodes[i] = node

    def start_all(self) -> float:
        """Start every node and wait until each has written its first checkpoint (it trains);
        returns that time on the mesh clock. Fails if a node exits first."""
        for i in range(len(self.hosts)):
            self.start(i, expect=len(self.hosts))
        deadline = time.monotonic() + HANG_S
        while not all(load_newest(self.state(i)) for i in range(len(self.hosts))):
            exited = [node.id for node in self.nodes.values() if node.poll() is not None]
            assert not exited and time.monotonic() < deadline, (
                f"the mesh did not start ({exited or 'hung'}); see {self.run_dir}"
            )
            time.sleep(0.1)
        return self.clock()

    def signal(self, i: int, signum: signal.Signals) -> None:
        self.nodes[i].send_signal(signum)
        while signum == signal.SIGKILL and self.nodes[i].poll() is None:
            time.sleep(0.01)

    def fuzz(self, on_host: int, target: int, count: int, seed: int = 0) -> int:
        """Fork a fuzzer on host ``on_host`` (with a trusted key, id "fuzzer") that sends node
        ``target`` ``count`` messages its decoder must reject, and exits once every one has left
        for the target (see ``reap``); returns the fuzzer's pid."""
        public, _ = keygen(self.run_dir / "keys" / "fuzzer", "fuzzer")
        shutil.copy(public, self.trusted)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                netns.enter(self.hosts[on_host])
                server_key, _ = zmq.auth.load_certificate(self.keys(target) / f"node-{target}.key")
                _send_garbage(self.address(target), server_key, self.run_dir / "keys" / "fuzzer", count, seed)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        return pid

    def reap(self, pid: int) -> None:
        """Wait for the forked ``pid`` (a fuzzer) to exit 0; kill it and fail if it hangs."""
        deadline = time.monotonic() + HANG_S
        while (exited := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"process {pid} still running after {HANG_S} s; see {self.run_dir}")
            time.sleep(0.1)
        assert os.waitstatus_to_exitcode(exited[1]) == 0, f"process {pid} failed; see its stderr"

    def wait(self) -> None:
        """Until every node has exited; kills the rest and fails if they hang."""
        deadline = time.monotonic() + HANG_S
        while any(n.poll() is None for n in self.nodes.values()):
            if time.monotonic() > deadline:
                for node in self.nodes.values():
                    node.send_signal(signal.SIGKILL)
                raise AssertionError(f"nodes still running after {HANG_S} s; logs in {self.run_dir}")
            time.sleep(0.1)

    def report(self, i: int) -> dict[str, Any]:
        """Node i's own record, with its membership events."""
        report = json.loads(self.nodes[i].report.read_text())
        node: dict[str, Any] = report["nodes"][0]
        return {**node, "membership_events": report["membership_events"]}

    def params(self, i: int) -> np.ndarray:
        """Node i's parameters at its newest checkpoint."""
        checkpoint = load_newest(self.state(i))
        assert checkpoint is not None, f"node-{i} has no checkpoint yet"
        return np.asarray(checkpoint.tensors["params"])


def _send_garbage(address: str, server_key: bytes, keys: Path, count: int, seed: int) -> None:
    own = NodeKeys.load(keys, "fuzzer")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"fuzzer")
    configure_client(dealer, own, server_key)
    dealer.connect(address)
    messages = (m for m in hostile_messages(seed, "fuzzer") if not decodes(m))
    for _ in range(count):
        dealer.send_multipart(next(messages))
    dealer.close(linger=-1)  # exit once all have left: the caller reaps it while the target runs
    context.term()
