"""Background work in real time: what ``Peer`` and ``MemoryPeer`` run an algorithm's exchanger on."""

from __future__ import annotations

import threading
from collections.abc import Callable


def start_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    """Start ``target`` on a daemon thread (one left running never keeps the process alive)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
