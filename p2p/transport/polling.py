"""The network thread's poller, shared by what waits on a socket for different reasons: a
stream waits for room on a peer's DEALER (``POLLOUT``) while, on a node that does not listen,
replies arrive on that same DEALER (``POLLIN``). Each adds and removes its own interest."""

from __future__ import annotations

from typing import Any

import zmq


class Poller(zmq.Poller):
    def flags(self, socket: Any) -> int:
        """What ``socket`` is polled for (0: it is not)."""
        index = self._map.get(socket)
        return 0 if index is None else int(self.sockets[index][1])

    def want(self, socket: Any, flag: int) -> None:
        """Poll ``socket`` for ``flag`` too."""
        self.register(socket, self.flags(socket) | flag)

    def unwant(self, socket: Any, flag: int) -> None:
        """Stop polling ``socket`` for ``flag`` (and drop it once it is polled for nothing)."""
        if self.flags(socket):
            self.register(socket, self.flags(socket) & ~flag)  # (flags 0 unregisters)
