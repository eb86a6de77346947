"""Real test hosts: Linux network namespaces on a bridged LAN (needs root and iproute2).

Each host is a namespace with one interface on a shared bridge (in a 'switch' namespace), so
hosts see each other's broadcasts; a host's link can be taken down to partition it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # its IPv4 address on the LAN
    switch_port: str  # its cable's end on the switch

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (the ip command)"
    probe = f"gmprobe{os.getpid() % 100000}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this machine does not allow creating network namespaces"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def lan(count: int, hosts_file: str = "") -> Iterator[list[Host]]:
    """``count`` hosts on one bridged segment, removed afterwards. ``hosts_file`` becomes each
    host's /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/ over /etc/): a stand-in DNS."""
    tag = f"gm{os.getpid() % 100000}"
    switch = f"{tag}sw"
    hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}", f"{tag}p{i}") for i in range(count)]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.namespace)
            _ip("link", "add", f"{tag}e{i}", "type", "veth", "peer", "name", host.switch_port)
            _ip("link", "set", f"{tag}e{i}", "netns", host.namespace, "name", "eth0")
            _ip("link", "set", host.switch_port, "netns", switch)
            _ip("-n", switch, "link", "set", host.switch_port, "master", "br0", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "brd", "+", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            if hosts_file:
                etc = Path("/etc/netns") / host.namespace
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
        yield hosts
    finally:
        for namespace in [switch, *(h.namespace for h in hosts)]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)
