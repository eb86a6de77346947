"""The structure-aware fuzzer (``fuzz_live``) against a live node, for a bounded time:
no input stops its network thread or a reader, no insider's move pushes it past a bound
(``fuzz_live.out_of_bounds``), and the node still works afterwards
(``bench/fuzz_wire.py`` runs the same for minutes)."""

from __future__ import annotations

import pytest
from fuzz_live import Fuzzer, FuzzTarget, fuzz, insider_moves, out_of_bounds, settle
from helpers import HANG_S, addresses
from hostile import free_udp_port, resident_bytes

from p2p import Peer

pytestmark = pytest.mark.mesh
EXAMPLES = 1000
INSIDER_MOVES = 200


def test_no_input_kills_a_live_node_or_grows_it() -> None:
    port = free_udp_port()
    target = FuzzTarget(port)
    target.start()
    fuzzer = Fuzzer(target.target.address, port)
    newcomer = Peer("newcomer", addresses(1)[0], [target.target.address])
    try:
        before = resident_bytes()
        fuzz(fuzzer, EXAMPLES)
        fuzz(fuzzer, INSIDER_MOVES, insider_moves(target.members))
        assert settle(target)
        assert target.deaths == 0, target.errors[:1]
        assert out_of_bounds(target) == []
        stats = target.target.stats
        assert stats.messages_rejected > EXAMPLES / 4 and target.taken > 0  # it got deep, and was refused
        newcomer.start()  # the node still serves: a newcomer joins through it
        newcomer.wait_ready(HANG_S, expect=3)
        assert resident_bytes() - before < 200 << 20
    finally:
        newcomer.close()
        fuzzer.close()
        target.close()
