"""Bootstrap contacts: the addresses a node was told to join through, tried until each is a member.

A node swaps member tables with each of its bootstrap addresses (a DNS name counts for every
address it resolves to) until that address is a live member of its own table: joining through
one contact does not end the tries of the others, so nodes that name each other in a chain, a
ring or a star end in one mesh, and two meshes that formed apart merge as soon as a node of one
names a node of the other. A contact that does not answer is tried again after a delay that
doubles from ``retry_s`` up to ``max_retry_s``. Names are resolved on a thread of their own,
never on the network thread (a slow DNS server must not delay probes and acks).
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Collection, Iterable

from p2p.address import AddressError, resolve_all, split_endpoint

RESOLVE_EVERY_S = 2.0  # while a contact is not a member yet
RESOLVE_IDLE_S = 30.0  # once every one is (new addresses may still appear)


class Contacts:
    """Bootstrap names, their addresses and when each is tried next (network thread), resolved
    in the background until ``stopped`` is set."""

    def __init__(
        self,
        names: Iterable[str],
        *,
        retry_s: float,
        max_retry_s: float,
        stopped: threading.Event,
        resolve: Callable[[str], list[str]] = resolve_all,
    ) -> None:
        self.names = list(names)
        self.error = ""  # the last resolution error, for the user
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._stopped = stopped
        self._resolve = resolve
        self._addresses: frozenset[str] = frozenset()
        self._next: dict[str, tuple[float, float]] = {}  # address -> (next try, delay after it)
        self._resolver: threading.Thread | None = None
        if all(_numeric(name) for name in self.names):
            self._resolve_all()  # no DNS involved: at once, on this thread
        else:
            self._resolver = threading.Thread(target=self._keep_resolving, name="resolver", daemon=True)

    def due(self, now: float, members: Collection[str], me: str) -> list[str]:
        """The contact addresses to swap tables with now: those not among ``members`` (the
        live members' addresses) whose retry time has come."""
        if self._resolver is not None and self._resolver.ident is None:
            self._resolver.start()
        due = []
        for address in self._addresses - {me}:
            if address in members:
                self._next.pop(address, None)
                continue
            at, delay = self._next.get(address, (now, self._retry_s))
            if now >= at:
                due.append(address)
                self._next[address] = (now + delay, min(2 * delay, self._max_retry_s))
        return due

    def next_try(self) -> float | None:
        """When a contact is due next (None: none is waiting)."""
        return min((at for at, _ in self._next.values()), default=None)

    def _keep_resolving(self) -> None:
        while True:
            self._resolve_all()
            waiting = bool(self._next) or not self._addresses
            if self._stopped.wait(RESOLVE_EVERY_S if waiting else RESOLVE_IDLE_S):
                return

    def _resolve_all(self) -> None:
        addresses: set[str] = set()
        for name in self.names:
            try:
                addresses.update(self._resolve(name))
            except AddressError as exc:
                self.error = str(exc)  # DNS may not list the others yet: retry
        self._addresses = frozenset(addresses)


def _numeric(endpoint: str) -> bool:
    host = split_endpoint(endpoint)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
