"""CURVE on every socket: key pairs, trusted folders (reloaded live), untrusted peers kept out;
hostile input counted per peer and a garbage sender shunned."""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq
from helpers import HANG_S, addresses, average_in_threads, raw_dealer, started_transport, wait_until
from hostile import connect

from p2p import Peer, Transport, TransportError
from p2p.security.curve import Curve, NodeKeys, SecurityError, TrustedKeys, _TrustedProvider, keygen
from p2p.security.rejections import Rejections
from p2p.wire import encode


def make_keys(folder: Path, *names: str) -> Path:
    """A key pair per name in ``folder/keys``; the public keys also in ``folder/trusted``."""
    trusted = folder / "trusted"
    trusted.mkdir(parents=True, exist_ok=True)
    for name in names:
        public, _ = keygen(folder / "keys" / name, name)
        shutil.copy(public, trusted)
    return trusted


def curve_for(folder: Path, name: str, trusted: Path) -> Curve:
    return Curve.load(folder / "keys" / name, trusted, name)


def keys_b_trusts_and_a_does_not(folder: Path) -> tuple[Path, Path, Path]:
    """Key pairs for a and b; the folders a trusts (a's key) and b trusts (both), and b's
    public key."""
    trusted_by_a = make_keys(folder, "a")
    trusted_by_b = folder / "trusted-b"
    shutil.copytree(trusted_by_a, trusted_by_b)
    public, _ = keygen(folder / "keys" / "b", "b")
    shutil.copy(public, trusted_by_b)
    return trusted_by_a, trusted_by_b, public


@contextmanager
def curve_peers(folder: Path, names: list[str], trusted: Path) -> Iterator[list[Peer]]:
    listen = addresses(len(names))
    peers = [
        Peer(name, address, listen[:1] if i else [], curve=curve_for(folder, name, trusted))
        for i, (name, address) in enumerate(zip(names, listen, strict=True))
    ]
    try:
        for peer in peers:
            peer.start()
        yield peers
    finally:
        for peer in peers:
            peer.close()


def test_keygen_writes_a_pyzmq_pair_with_a_private_secret(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "node-a")
    assert (public.name, secret.name) == ("node-a.key", "node-a.key_secret")
    assert secret.stat().st_mode & 0o077 == 0
    keys = NodeKeys.load(tmp_path, "node-a")
    assert len(keys.public) == 40 and len(keys.secret) == 40
    assert zmq.curve_public(keys.secret) == keys.public
    with pytest.raises(SecurityError, match="exists"):
        keygen(tmp_path, "node-a")


def test_missing_or_ambiguous_keys_say_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="gossipmesh keygen"):
        NodeKeys.load(tmp_path, "x")
    keygen(tmp_path, "a")
    keygen(tmp_path, "b")
    with pytest.raises(SecurityError, match=r"b\.key_secret and no c\.key_secret; give node_id="):
        NodeKeys.load(tmp_path, "c")
    assert NodeKeys.load(tmp_path, "b") == NodeKeys.load(tmp_path, "b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SecurityError, match=r"no \.key files"):
        TrustedKeys(tmp_path / "empty")


def test_trusted_peers_form_a_mesh_through_a_bootstrap_address_alone(tmp_path: Path) -> None:
    trusted = make_keys(tmp_path, "a", "b", "c")
    with curve_peers(tmp_path, ["a", "b", "c"], trusted) as peers:
        assert wait_until(lambda: all(p.members() == {"a", "b", "c"} for p in peers))
        vector = np.arange(1000, dtype=np.float32)
        peers[2].send("a", "params", 3, [vector])
        message = peers[0].recv(5.0, {"params"})
        assert message is not None and message.sender == "c"
        np.testing.assert_array_equal(message.tensors[0], vector)


def test_a_node_joins_through_a_peer_whose_handshakes_are_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every CURVE handshake takes 0.3 s (a peer's authenticator starved of CPU). A join's tables
    wait for the handshake, on either side, rather than being sent on a connection a fixed time
    old and dropped, on every try."""
    decide = _TrustedProvider.callback

    def slowly(self: _TrustedProvider, domain: str, key: bytes) -> bool:
        time.sleep(0.3)
        return decide(self, domain, key)

    monkeypatch.setattr(_TrustedProvider, "callback", slowly)
    trusted = make_keys(tmp_path, "a", "b")
    with curve_peers(tmp_path, ["a", "b"], trusted) as peers:
        joined = wait_until(lambda: all(p.members() == {"a", "b"} for p in peers))
        assert joined, [(p.members(), dict(p.stats.dropped)) for p in peers]


def test_a_trusted_key_check_that_raises_refuses_one_handshake_and_the_mesh_still_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first key checks raise OSError (EMFILE while the folder is listed): those handshakes
    are refused and counted, the ZAP thread lives on, and the peers join on the next tries."""
    allows = TrustedKeys.allows
    failures = iter(range(3))

    def flaky(self: TrustedKeys, key: bytes) -> bool:
        if next(failures, None) is not None:
            raise OSError(24, "Too many open files")
        return allows(self, key)

    monkeypatch.setattr(TrustedKeys, "allows", flaky)
    trusted = make_keys(tmp_path, "a", "b")
    with curve_peers(tmp_path, ["a", "b"], trusted) as peers:
        assert wait_until(lambda: all(p.members() == {"a", "b"} for p in peers))
        authenticators = [p.transport._authenticator for p in peers]
        assert sum(a._provider.errors for a in authenticators if a is not None) == 3
        assert all(p.transport.failure is None for p in peers)


def test_a_dead_authenticator_fails_the_transport(tmp_path: Path) -> None:
    """Should the ZAP thread stop, no peer could connect again: the transport fails as if its
    network thread had died (so ``/healthz`` answers 503 and the daemon exits)."""
    trusted = make_keys(tmp_path, "a")
    with curve_peers(tmp_path, ["a"], trusted) as (a,):
        authenticator = a.transport._authenticator
        assert authenticator is not None
        authenticator._thread.stop()
        assert a.transport.stopped.wait(HANG_S)
        assert a.transport.failure is not None and a.transport.failure.startswith("SecurityError")


def test_an_untrusted_peer_gets_no_frame_through_until_its_key_is_trusted(tmp_path: Path) -> None:
    trusted = make_keys(tmp_path, "a")
    public, _ = keygen(tmp_path / "keys" / "b", "b")
    with curve_peers(tmp_path, ["a", "b"], trusted) as (honest, newcomer):
        authenticator = honest.transport._authenticator
        assert authenticator is not None
        assert wait_until(lambda: authenticator.refused >= 2)  # it keeps trying to join...
        assert honest.members() == {"a"} and newcomer.members() == {"b"}
        assert honest.stats.messages_received == 0 and honest.stats.bytes_received == 0
        assert honest.stats.messages_rejected == 0  # ...refused at the handshake, before any frame
        shutil.copy(public, trusted)  # trusted from now on, with no restart
        assert wait_until(lambda: honest.members() == newcomer.members() == {"a", "b"})


def test_a_connection_refused_before_its_key_was_trusted_is_dialed_again(tmp_path: Path) -> None:
    """ZeroMQ never redials a connection whose handshake the peer refused: the transport does.
    b sends to a under a's key (as to a member) before a trusts b, then after."""
    trusted_by_a, trusted_by_b, public = keys_b_trusts_and_a_does_not(tmp_path)
    key_of_a = NodeKeys.load(tmp_path / "keys" / "a", "a").public.decode()
    with (
        started_transport("a", curve=curve_for(tmp_path, "a", trusted_by_a)) as a,
        started_transport("b", curve=curve_for(tmp_path, "b", trusted_by_b)) as b,
    ):
        sent = iter(range(10**6))

        def delivered() -> bool:
            b.send(a.address, "note", next(sent), key=key_of_a, member=True)
            return a.recv(0.05) is not None

        assert wait_until(lambda: b.connections.refused[a.address] >= 1 or delivered())
        assert a.stats.messages_received == 0
        shutil.copy(public, trusted_by_a)
        assert wait_until(delivered)
        assert b.connections.refused[a.address] >= 1


def test_a_refused_key_is_named_on_both_sides(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """b's key is not in a's trusted folder: a logs b's key and its folder; b gives up on its
    start, before its (long) timeout, saying which file to copy where."""
    trusted_by_a, trusted_by_b, public = keys_b_trusts_and_a_does_not(tmp_path)
    key_of_b = NodeKeys.load(tmp_path / "keys" / "b", "b").public.decode()
    a_address, b_address = addresses(2)
    a = Peer("a", a_address, curve=curve_for(tmp_path, "a", trusted_by_a))
    b = Peer("b", b_address, [a_address], curve=curve_for(tmp_path, "b", trusted_by_b))
    try:
        a.start()
        b.start()
        with pytest.raises(TransportError) as refused:
            b.wait_ready(HANG_S)
    finally:
        a.close()
        b.close()
    message = str(refused.value)
    assert re.search(rf"\d+ handshakes refused for untrusted keys: {a_address} does not trust", message)
    assert key_of_b in message and f"copy {public} into the trusted= folder there" in message
    logged = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert logged and key_of_b in logged[0] and f"not in --trusted {trusted_by_a}" in logged[0]


def _average_under_attack(tmp_path: Path, *, secure: bool, attack: bool) -> str:
    """The hash of a's vector after 10 rounds of pure averaging with b, while (with ``attack``)
    an intruder with an untrusted key, claiming to be b, sends a huge models for every round."""
    trusted = make_keys(tmp_path, "a", "b")
    intruder_keys = tmp_path / "keys" / "mallory"
    if not intruder_keys.exists():
        keygen(intruder_keys, "mallory")
    listen = addresses(3)
    peers = [
        Peer(
            name,
            address,
            listen[:1] if i else [],
            curve=curve_for(tmp_path, name, trusted) if secure else None,
        )
        for i, (name, address) in enumerate(zip(["a", "b"], listen, strict=False))
    ]
    intruder = Transport("b", listen[2], curve=curve_for(tmp_path, "mallory", trusted) if secure else None)
    try:
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.wait_ready(HANG_S, expect=2)
        intruder.start()
        if not secure:  # (what a transport sends before its connection is up is dropped)
            connect(intruder, peers[0].address, peers[0].transport)
        key = NodeKeys.load(tmp_path / "keys" / "a", "a").public.decode() if secure else None
        transport, heard = peers[0].transport, peers[0].transport.stats.messages_received
        for r in range(10) if attack else ():
            intruder.send(peers[0].address, "params", r, [np.full(1000, 1e6, np.float32)], key=key)
        if attack and secure:  # its handshake was refused: nothing it sent arrives
            authenticator = transport._authenticator
            assert authenticator is not None and wait_until(lambda: authenticator.refused >= 1)
        elif attack:  # what it sent has arrived, before the averaging starts
            assert wait_until(lambda: transport.stats.messages_received >= heard + 10)
        vectors = [np.arange(1000, dtype=np.float32) * (i + 1) for i in range(2)]
        average_in_threads(peers, vectors, topology="ring", rounds=10)
        return hashlib.sha256(vectors[0].tobytes()).hexdigest()
    finally:
        intruder.close()
        for peer in peers:
            peer.close()


def test_an_untrusted_node_leaves_every_honest_model_hash_unchanged(tmp_path: Path) -> None:
    clean = _average_under_attack(tmp_path / "clean", secure=True, attack=False)
    assert _average_under_attack(tmp_path / "attacked", secure=True, attack=True) == clean
    # without CURVE the same intruder does change the model: the check above can see a change
    insecure = _average_under_attack(tmp_path / "insecure", secure=False, attack=False)
    assert insecure == clean
    assert _average_under_attack(tmp_path / "insecure-attacked", secure=False, attack=True) != clean


def test_garbage_is_counted_per_peer_and_a_persistent_sender_is_shunned() -> None:
    now = [0.0]
    rejections = Rejections(shun_after=5, shun_window_s=10, shun_for_s=30, clock=lambda: now[0])
    for _ in range(4):
        rejections.reject("bad", "header_schema")
    rejections.reject("good", "non_finite")
    assert not rejections.shunned("bad")
    rejections.reject("bad", "dtype")
    assert rejections.shunned("bad") and not rejections.shunned("good")
    rejections.reject("bad", "shunned")
    assert rejections.by_peer == {
        "bad": {"header_schema": 4, "dtype": 1, "shunned": 1},
        "good": {"non_finite": 1},
    }
    assert rejections.total == 7
    now[0] = 31.0
    assert not rejections.shunned("bad")  # for a while, not forever
    assert rejections.shunned_peers == {"bad"}


def test_a_live_transport_shuns_a_garbage_sender_and_counts_everything() -> None:
    with (
        started_transport("rx", inbox_kinds={"params"}) as receiver,
        raw_dealer(b"fuzzer", receiver.address) as raw,
    ):
        for _ in range(300):
            raw.send_multipart([b"\x93garbage"])
        raw.send_multipart(encode(kind="params", sender="fuzzer", round=0, seq=1))  # well formed
        assert wait_until(lambda: receiver.stats.messages_rejected == 301), receiver.stats
        assert receiver.stats.rejected_by_peer == {"fuzzer": {"header_not_msgpack": 100, "shunned": 201}}
        assert receiver.recv(0.2) is None  # shunned: even its good message is dropped unread
