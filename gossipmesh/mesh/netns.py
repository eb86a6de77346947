"""Real test hosts: Linux network namespaces on a bridged LAN (needs root and iproute2).

Each host is a namespace with one interface on a switch (a 'switch' namespace with two bridges
joined by a trunk link), so hosts see each other's broadcasts. The first half of the hosts sits
on one bridge and the rest on the other: taking the trunk down (:func:`partition`) splits the
LAN into two halves, bringing it up heals it. :func:`cap_bandwidth` limits a host's link with
``tc ... tbf``; :func:`enter` moves the calling process into a host (for forked daemons).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000


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
    switch = _switch()
    tag = switch.removesuffix("sw")
    hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}", f"{tag}p{i}") for i in range(count)]
    try:
        _ip("netns", "add", switch)
        for bridge in ("br0", "br1"):
            _ip("-n", switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", switch, "link", "set", bridge, "up")
        _ip("-n", switch, "link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
        for end in ("0", "1"):
            _ip("-n", switch, "link", "set", f"trunk{end}", "master", f"br{end}", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.namespace)
            _ip("link", "add", f"{tag}e{i}", "type", "veth", "peer", "name", host.switch_port)
            _ip("link", "set", f"{tag}e{i}", "netns", host.namespace, "name", "eth0")
            _ip("link", "set", host.switch_port, "netns", switch)
            bridge = "br0" if i < (count + 1) // 2 else "br1"
            _ip("-n", switch, "link", "set", host.switch_port, "master", bridge, "up")
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


def partition() -> None:
    """Split the LAN into its two halves (the trunk between the bridges goes down)."""
    _ip("-n", _switch(), "link", "set", "trunk0", "down")


def heal() -> None:
    _ip("-n", _switch(), "link", "set", "trunk0", "up")


def cap_bandwidth(host: Host, rate: str, *, downlink: bool = False) -> None:
    """Limit what ``host`` sends (with ``downlink``: what it receives) to ``rate`` (e.g.
    ``20mbit``) with a token bucket filter. The bucket holds 4 ms at the rate (64 KB at the
    least): smaller ones cannot reach fast rates between the kernel's timer ticks."""
    bits = float(rate.removesuffix("mbit")) * 1e6 if rate.endswith("mbit") else 0.0
    burst = f"{max(64_000, int(bits / 8 * 0.004))}b"
    namespace, device = (_switch(), host.switch_port) if downlink else (host.namespace, "eth0")
    _ip("netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
        "rate", rate, "burst", burst, "latency", "200ms")  # fmt: skip


def can_refuse_inbound() -> bool:
    """Whether :func:`refuse_inbound` can run here (it needs nft: apt-get install nftables)."""
    return shutil.which("nft") is not None


def refuse_inbound(host: Host) -> None:
    """Drop every TCP connection attempt to ``host`` (a SYN without ACK), as a NAT or a
    firewall does; what it dials itself still works."""
    rules = """table inet gossipmesh {
        chain inbound {
            type filter hook input priority 0; policy accept;
            tcp flags & (syn | ack) == syn drop
        }
    }"""
    subprocess.run(
        ["ip", "netns", "exec", host.namespace, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
    )


def enter(host: Host) -> None:
    """Move the calling process (a freshly forked daemon) into ``host``'s network namespace."""
    fd = os.open(f"/var/run/netns/{host.namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {host.namespace}")
    finally:
        os.close(fd)


def sent_bytes(host: Host) -> int:
    """Bytes ``host`` has sent on its link (its eth0's counter: headers and all)."""
    shown = subprocess.run(
        ["ip", "-n", host.namespace, "-j", "-s", "link", "show", "eth0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"])


def _switch() -> str:
    return f"gm{os.getpid() % 100000}sw"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)
