"""Background work in real time: what ``Peer`` and ``MemoryPeer`` run an algorithm's exchanger on."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from p2p.transport.network_thread import TransportError


def start_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    """Start ``target`` on a daemon thread (one left running never keeps the process alive)."""
    thread = threading.Thread(
        target=functools.partial(_until_the_network_is_down, target), name=name, daemon=True
    )
    thread.start()
    return thread


def _until_the_network_is_down(target: Callable[[], None]) -> None:
    """Run ``target``; once the node's network thread has died it ends quietly: the training
    thread's next call raises that failure (``check_running``) and the node stops with it,
    where each background thread would otherwise print the same error again."""
    try:
        target()
    except TransportError:
        return
