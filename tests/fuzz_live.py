"""A structure-aware fuzzer against a live node, for the suite (``test_fuzz_live.py``, seconds)
and ``bench/fuzz_wire.py`` (minutes).

Inputs come from hypothesis strategies built from the wire schema: headers whose every field is
drawn from what the decoder accepts and what it must refuse; valid messages of every kind a
node reads (membership, each algorithm's, state transfer, streams of chunks) built by the
project's own encoders and then mutated (bits flipped, frames cut, dropped or added, one field
of the header or its meta replaced); UDP beacons; and an insider's moves (:func:`insider_moves`:
valid messages a member holding a trusted key could send, each one of issue 29's attacks).

The target is a real node, as the daemon runs it: a ``Peer`` in a mesh with a friend, its
inbox limited to the kinds the daemon reads, and a reader thread that hands each message to
the code that takes it in (D-PSGD, SGP, CHOCO, AD-PSGD, the state server and a state fetch),
with the self-tuning agreements fed from what those accept. A death is the network thread
stopping or a reader raising: both must never happen.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq
from helpers import HANG_S, addresses, wait_until
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gossip import CHOCO, DPSGD, SGP
from gossip.algorithms.choco_replicas import MAX_PENDING
from gossip.buffers.pieces import RunningMix
from gossip.compression import Int8, Sparse
from gossip.messages import STATE_CHUNK as CHUNK
from gossip.messages import STATE_MANIFEST as MANIFEST
from gossip.messages import STATE_REQUEST as REQUEST
from gossip.messages import STATE_VERSION, StateChunk, StateManifest
from gossip.state.manifest import MAX_COUNTER, Assembly, Manifest, Snapshot, StateTransferError, check_fit
from gossip.state.server import StateServer
from gossip.tuning.agreement import AgreeingPeer, EpochAgreement
from gossip.tuning.auto_codec import CodecAgreement
from gossip.tuning.auto_period import MAX_H, PeriodAgreement
from gossipmesh.daemon.peers import message_kinds
from p2p import Peer
from p2p.membership.beacon import BEACON_VERSION
from p2p.membership.kinds import GOSSIP, PING, SYNC
from p2p.membership.protocol import Membership
from p2p.membership.table import Member, Status
from p2p.security.rejections import Rejections
from p2p.wire import WIRE_DTYPES, encode, encode_chunks
from topologies import Topology

SIZE = 64  # the target's model: 64 float32
IDS = ["fuzzer", "friend", "target", "ghost"]  # the fuzzer sends as fuzzer, and as the friend
KINDS = sorted(Membership.kinds | message_kinds())
_U64 = 2**64 - 1
_EDGES = [0, 1, 2, 255, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, _U64]

ints = st.one_of(st.integers(0, _U64), st.sampled_from(_EDGES), st.integers(-(2**63), 2**64 - 1))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=40))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
node_ids = st.sampled_from(IDS) | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True)
endpoints = (
    st.sampled_from(["tcp://127.0.0.1:1", "tcp://10.0.0.1:7000"])
    | st.builds("tcp://127.0.0.1:{}".format, st.integers(0, 70000))
    | st.text(max_size=30)
)
keys = st.just("") | st.from_regex(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}", fullmatch=True)
member_records = st.lists(
    st.tuples(
        node_ids, endpoints, ints, ints, st.sampled_from([s.value for s in Status]), ints, ints, keys
    ).map(list)
    | values,
    max_size=6,
)
metas = st.fixed_dictionaries(
    {},
    optional={
        "updates": member_records,
        "probe": ints,
        "target": endpoints,
        "reply_to": endpoints,
        "transfer": ints,
        "exchange": ints,
        "index": ints,
        "count": ints,
        "total": ints,
        "version": ints,
        "manifest": st.booleans() | values,
        "chunks": st.lists(ints, max_size=40) | values,
        "chunk_bytes": st.sampled_from([256, 1024, 8 << 20]) | ints,
        "settled": ints,
        "layout": st.lists(
            st.tuples(
                st.text(max_size=8), st.sampled_from(["float32", "int64", "c8"]), st.lists(ints, max_size=3)
            ).map(list),
            max_size=3,
        )
        | values,
        "counters": st.dictionaries(st.text(max_size=8), ints | st.floats(), max_size=3) | values,
        "sparse": st.sampled_from(["segments", "bitmap", "zip"]) | values,
        "gamma": st.floats() | values,
        "x": values,
    },
)
descriptors = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(sorted(WIRE_DTYPES)) | values,
        "shape": st.lists(st.integers(0, 8) | ints, max_size=9) | values,
        "nbytes": st.integers(0, 64) | ints,
    }
)
headers = st.fixed_dictionaries(
    {
        "v": st.just(1) | values,
        "kind": st.sampled_from(KINDS) | st.text(max_size=40),
        "sender": node_ids,
        "session": ints,
        "seq": ints,
        "round": st.integers(0, 100) | ints,
        "tensors": st.lists(descriptors, max_size=4) | values,
    },
    optional={
        "meta": metas | values,
        "chunk": st.lists(ints, min_size=3, max_size=3) | values,
        "extra": values,
    },
)


@dataclass
class Input:
    """What the fuzzer sends: ZeroMQ messages in order, or a UDP beacon."""

    messages: list[list[bytes]] = field(default_factory=list)
    beacon: bytes | None = None


@st.composite
def _schema_messages(draw: st.DrawFn) -> Input:
    header = draw(headers)
    payload = draw(st.lists(st.binary(max_size=128), max_size=4))
    return Input([[msgpack.packb(header, use_bin_type=True), *payload]])


_seqs = itertools.count(1)


@st.composite
def _valid_messages(draw: st.DrawFn) -> Input:
    """A well-formed message of one of the kinds a node reads (a stream: several messages)."""
    sender = draw(st.sampled_from(["fuzzer", "friend", "friend", "friend"]))  # mostly a member: read deep
    kind = draw(st.sampled_from(KINDS))
    round = draw(st.integers(0, 70) | st.sampled_from([2**62, _U64]))
    vector = np.asarray(draw(st.lists(st.floats(width=32), min_size=SIZE, max_size=SIZE)), np.float32)
    tensors: list[np.ndarray] = []
    meta: dict[str, Any] = {"updates": draw(member_records), "reply_to": draw(endpoints)}
    if kind in ("params", "pair_model", "pair_difference", "choco_full"):
        tensors = [vector]
        meta["exchange"] = draw(ints)
    elif kind in ("pair_ask", "pair_turn"):
        meta["exchange"] = draw(ints)
    elif kind == "push":
        tensors = [vector, np.array([draw(st.floats())])]
    elif kind == "choco":
        codec = draw(st.sampled_from([Int8(), Sparse("topk", 0.1)]))
        encoded = codec.encode(np.nan_to_num(vector))
        tensors, meta = list(encoded.frames), {**meta, **encoded.meta, "codec": str(codec)}
    elif kind in (REQUEST, MANIFEST, CHUNK):
        meta.update(transfer=draw(ints), index=draw(st.integers(0, 2) | ints), manifest=draw(st.booleans()))
        meta.update(chunks=draw(st.lists(st.integers(0, 3) | ints, max_size=40)), settled=draw(ints))
        meta.update(chunk_bytes=draw(st.sampled_from([256, 1024, SIZE * 4]) | ints))
        meta.update(
            version=STATE_VERSION,
            total=SIZE * 4,
            layout=[["params", "float32", [SIZE]]],
            counters={"round": draw(ints)},
        )
        tensors = [vector.view(np.uint8)] if kind == CHUNK else []
    else:
        meta.update(probe=draw(ints), target=draw(endpoints))
    if kind in ("choco", "choco_full"):
        meta["gamma"] = draw(st.sampled_from([0.05, 1.0]) | st.floats())  # valid ones get past the check
    chunk_bytes = draw(st.integers(16, 200)) if tensors and draw(st.integers(0, 3)) == 0 else None
    return _message(kind, round, tensors, meta, sender=sender, chunk_bytes=chunk_bytes)


def _message(
    kind: str,
    round: int,
    tensors: list[np.ndarray],
    meta: dict[str, Any],
    *,
    sender: str = "fuzzer",
    chunk_bytes: int | None = None,
) -> Input:
    """One message as the project's encoder makes it; a stream of chunks of ``chunk_bytes``."""
    fields = {"kind": kind, "sender": sender, "round": round, "tensors": tensors, "meta": meta}
    if chunk_bytes is not None:
        chunks = encode_chunks(**fields, session=7, seqs=_seqs, chunk_bytes=chunk_bytes)
        return Input([[bytes(f) for f in chunk] for chunk in chunks])
    return Input([[bytes(f) for f in encode(**fields, session=7, seq=next(_seqs))]])


@st.composite
def _mutated(draw: st.DrawFn) -> Input:
    """A valid message (or stream) with a few mutations."""
    messages = [list(m) for m in draw(_valid_messages()).messages]
    for _ in range(draw(st.integers(1, 3))):
        message = draw(st.sampled_from(messages))
        index = draw(st.integers(0, len(message) - 1))
        frame = bytearray(message[index])
        op = draw(st.sampled_from(["flip", "cut", "splice", "drop", "add", "field", "meta", "repeat"]))
        if op == "flip" and frame:
            frame[draw(st.integers(0, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del frame[draw(st.integers(0, len(frame))) :]
        elif op == "splice":
            at = draw(st.integers(0, len(frame)))
            frame[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif op == "drop" and len(message) > 1:
            del message[index]
            continue
        elif op == "add":
            message.append(draw(st.binary(max_size=64)))
            continue
        elif op in ("field", "meta"):
            header = _header(message[0])
            target = header.get("meta") if op == "meta" and header is not None else header
            if isinstance(target, dict):
                target[draw(st.sampled_from([*target, "x"]))] = draw(values)
                message[0] = msgpack.packb(header, use_bin_type=True)
            continue
        elif op == "repeat":
            messages.append(list(message))
            continue
        message[index] = bytes(frame)
    return Input(messages)


beacon_fields = st.fixed_dictionaries(
    {"v": st.just(BEACON_VERSION) | values, "mesh": st.just("fuzz") | values, "id": node_ids | values,
     "address": endpoints | values, "key": keys | values},
)  # fmt: skip
beacons = st.builds(lambda b: Input(beacon=msgpack.packb(b, use_bin_type=True)), beacon_fields) | st.builds(
    lambda raw: Input(beacon=raw), st.binary(max_size=600)
)

#: everything the fuzzer sends
wire_inputs = st.one_of(_schema_messages(), _valid_messages(), _mutated(), beacons)

UNREAD_KINDS = ("unread", "telemetry", "params_v2")  # valid on the wire, read by no daemon
BIG_BYTES = (1 << 20, 4 << 20)  # an unread message's size: the models of issue 29's attack


def insider_moves(members: Mapping[str, str], insider: str = "friend") -> st.SearchStrategy[Input]:
    """What an insider holding a trusted key could send to a mesh whose members are at
    ``members`` (id -> address), as member ``insider`` (the fuzzer claims its id: the mesh is
    insecure, the insider is the member whose key went bad), each a well-formed message:
    phantom member records (new ids sorted right after real ones, at a live member's address,
    alive or dead), big messages of kinds nobody reads, CHOCO updates for rounds ahead, state
    manifests that lie (a longer layout, counters at their bounds) and averaging messages
    carrying forged agreements."""
    return st.one_of(
        _phantoms(members, insider),
        _unread(insider),
        _future_choco(insider),
        _lying_manifests(insider),
        _forged_agreements(insider),
    )


@st.composite
def _phantoms(draw: st.DrawFn, members: Mapping[str, str], insider: str) -> Input:
    ids = sorted(members)
    records = [
        Member(
            f"{draw(st.sampled_from(ids))}{i}",
            members[draw(st.sampled_from(ids))],
            draw(st.integers(1, 2**31)),
            draw(st.integers(0, 3)),
            draw(st.sampled_from([Status.ALIVE, Status.ALIVE, Status.DEAD, Status.SUSPECT])),
            first_round=draw(st.integers(0, 100)),
        ).to_wire()
        for i in range(draw(st.integers(1, 3)))
    ]
    kind = draw(st.sampled_from([GOSSIP, SYNC, PING]))
    meta = {"updates": records, "reply_to": draw(st.sampled_from([*members.values()]))}
    meta = {**meta, "probe": draw(st.integers(0, 2**31))} if kind == PING else meta
    return _message(kind, 0, [], meta, sender=insider)


@st.composite
def _unread(draw: st.DrawFn, insider: str) -> Input:
    nbytes = draw(st.sampled_from(BIG_BYTES))
    chunk_bytes = draw(st.sampled_from([None, 1 << 20]))
    tensors = [np.zeros(nbytes // 4, np.float32)]
    kind = draw(st.sampled_from(UNREAD_KINDS))
    return _message(kind, 0, tensors, {}, sender=insider, chunk_bytes=chunk_bytes)


@st.composite
def _future_choco(draw: st.DrawFn, insider: str) -> Input:
    encoded = Int8().encode(np.ones(SIZE, np.float32))
    meta = {**encoded.meta, "codec": "int8", "gamma": 0.5}
    round = draw(st.integers(1, MAX_PENDING + 8) | st.sampled_from([2**31, 2**62]))
    return _message("choco", round, list(encoded.frames), meta, sender=insider)


@st.composite
def _lying_manifests(draw: st.DrawFn, insider: str) -> Input:
    size = SIZE + draw(st.sampled_from([0, 2, -2, SIZE]))
    edge = st.sampled_from([0, 1, 2**31, MAX_COUNTER])
    counters = {"steps": draw(edge), "round": draw(edge), "rounds_per_s": draw(edge | st.floats(0, 1e6))}
    manifest = StateManifest(
        transfer=draw(ints), version=STATE_VERSION, layout=[["params", "float32", [size]]],
        counters=counters, total=-(-size * 4 // 8) * 8,
    )  # fmt: skip
    return _message(MANIFEST, 0, [], manifest.encode(), sender=insider)


@st.composite
def _forged_agreements(draw: st.DrawFn, insider: str) -> Input:
    """A D-PSGD message (finite or not, of a round near the target's) whose agreements claim
    values up to far beyond every cap, for this epoch or the next."""
    claim = st.integers(0, 2 * MAX_H) | st.sampled_from([MAX_H, 10 * MAX_H, 2**31]) | values
    forged = {key: [draw(st.integers(0, 1)), draw(claim), draw(claim)] for key in _AGREEMENT_KEYS}
    vector = np.full(SIZE, draw(st.sampled_from([0.5, np.nan])), np.float32)
    return _message("params", draw(st.integers(0, 16)), [vector], {**forged, "exchange": 0}, sender=insider)


_AGREEMENT_KEYS = (PeriodAgreement.meta_key, CodecAgreement.meta_key)


class FuzzTarget:
    """A live node (``target``) in a mesh with ``friend``, reading as the daemon reads; the
    fuzzer may send as either id (it is insecure: anyone may claim any id)."""

    def __init__(self, beacon_port: int) -> None:
        listen = addresses(2)
        self.friend = Peer("friend", listen[1], [listen[0]])
        self.target = Peer(
            "target", listen[0], inbox_kinds=message_kinds(), beacon_port=beacon_port, mesh_name="fuzz"
        )
        self.target.transport.stats.rejections = Rejections(shun_after=2**62)  # keep reading the fuzzer
        self.errors: list[str] = []
        self.taken = 0
        self.agreements: list[EpochAgreement] = [PeriodAgreement(), CodecAgreement()]
        self.choco: CHOCO | None = None  # the reader's, once it runs
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="fuzz-reader", daemon=True)

    def start(self) -> None:
        self.target.start()
        self.friend.start()
        self.target.wait_ready(HANG_S, expect=2)
        self._reader.start()

    def close(self) -> None:
        self._stop.set()
        self._reader.join(10)
        self.friend.close()
        self.target.close()

    @property
    def members(self) -> dict[str, str]:
        """The mesh's members: id -> address."""
        return {peer.node_id: peer.address for peer in (self.target, self.friend)}

    @property
    def deaths(self) -> int:
        """Network threads stopped, readers that raised: each a crash of a real node."""
        return (self.target.transport.failure is not None) + len(self.errors)

    def _read(self) -> None:
        peer = self.target
        ring, exponential = Topology.parse("ring"), Topology.parse("one-peer-exponential")
        readers: list[tuple[frozenset[str], Callable[[Any], object]]] = []
        agreeing = AgreeingPeer(peer, self.agreements)
        dpsgd = DPSGD(agreeing, np.zeros(SIZE, np.float32), topology=ring)
        readers.append((frozenset(dpsgd.kinds), lambda m: (dpsgd._file(m, 0, {}), dpsgd._early.clear())))
        sgp = SGP(agreeing, np.zeros(SIZE, np.float32), topology=exponential)
        # (shares of rounds ahead are held up to two models, then mixed: bounded either way)
        shares = RunningMix(sgp.params, sgp.vector_layout, 1.0, sgp._scratch, sgp.lock, sgp._coverage)
        readers.append((frozenset(sgp.kinds), lambda m: sgp._mix_in(m, 0, shares)))
        choco = self.choco = CHOCO(agreeing, np.zeros(SIZE, np.float32), topology=ring, codec=Int8())
        readers.append((frozenset(choco.kinds), choco._take))
        for averager in (dpsgd, sgp, choco):
            averager.on_accepted = agreeing.accepted
        readers.append((frozenset({MANIFEST, CHUNK}), _take_state))
        server = StateServer(peer, Snapshot({"params": np.zeros(SIZE, np.float32)}, {"round": 1}))
        kinds = frozenset().union(*(k for k, _ in readers))
        while not self._stop.is_set():
            try:
                server.serve()
                message = peer.transport.recv(0.05, kinds)
                if message is not None:
                    self.taken += 1
                    next(take for k, take in readers if message.kind in k)(message)
            except Exception:  # a reader that raises would be a training thread that dies
                self.errors.append(traceback.format_exc())


def _take_state(message: Any) -> None:
    """What a joiner does with a manifest (parse it) or a chunk (add it to a state of the
    fuzzer's layout, check the whole)."""
    with contextlib.suppress(ValueError):
        if message.kind == MANIFEST:
            manifest = Manifest.parse(StateManifest.decode(message.meta), 1 << 16)
            params = np.zeros(SIZE, np.float32)
            with contextlib.suppress(StateTransferError):  # (what a joiner checks before using it)
                check_fit(((e.name, e.dtype, e.shape) for e in manifest.entries), params, params, 1)
            return
        layout = StateManifest(
            transfer=0,
            version=STATE_VERSION,
            layout=[["params", "float32", [SIZE]]],
            counters={},
            total=SIZE * 4,
        )
        assembly = Assembly(Manifest.parse(layout, 1 << 16), SIZE * 4)  # one chunk
        if assembly.add(StateChunk.decode(message.meta).index, message.tensors):
            assembly.snapshot()


class Fuzzer:
    """Sends inputs to a target: as ``fuzzer`` or, when the header says so, as ``insider``."""

    def __init__(self, address: str, beacon_port: int, insider: str = "friend") -> None:
        self._context = zmq.Context()
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._insider = insider
        for sender in ("fuzzer", insider):
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, f"{sender}/fuzz".encode())
            dealer.setsockopt(zmq.SNDHWM, 100_000)
            dealer.connect(address)
            self._dealers[sender] = dealer
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._beacon_port = beacon_port
        self.sent = 0

    def send(self, sent: Input) -> None:
        if sent.beacon is not None:
            self._udp.sendto(sent.beacon, ("127.0.0.1", self._beacon_port))
            self.sent += 1
        for frames in sent.messages:
            self._dealers[self._claimed(frames)].send_multipart(frames)
            self.sent += 1

    def _claimed(self, frames: list[bytes]) -> str:
        """The dealer to send a message from: the insider's when its header says it is from it."""
        header = _header(frames[0]) if frames else None
        return self._insider if header is not None and header.get("sender") == self._insider else "fuzzer"

    def close(self) -> None:
        self._udp.close()
        self._context.destroy(linger=1000)


def _header(frame: bytes) -> dict[Any, Any] | None:
    """The header map in a (maybe mutated) frame, if there is one."""
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # garbage
        return None
    return header if isinstance(header, dict) else None


def settle(target: FuzzTarget, timeout: float = 30.0) -> bool:
    """Wait until the target has read everything sent so far: what it refused and what its
    reader took stop moving (the friend's membership traffic never stops, so it is not counted)."""
    stats = target.target.stats
    last = [-1]

    def still() -> bool:
        now = stats.messages_rejected + target.taken
        moved, last[0] = now != last[0], now
        return not moved

    return wait_until(still, timeout, interval=0.5)


def out_of_bounds(target: FuzzTarget) -> list[str]:
    """What an insider's moves pushed past a bound the target keeps: an agreement's value
    outside [floor, cap], CHOCO updates pending beyond ``MAX_PENDING`` (+1) per neighbour,
    two live members at one address (a phantom beside a real member). (The fuzzer may speak
    as the friend, so the friend's own record may move: its old address is then free.)"""
    found = [
        f"{type(a).__name__} took {value} (bounds {a.floor}..{a.cap})"
        for a in target.agreements
        for _, value in a.history
        if not a.floor <= value <= a.cap
    ]
    pending = max((len(r.pending) for r in target.choco._replicas.values()), default=0) if target.choco else 0
    if pending > MAX_PENDING + 1:
        found.append(f"CHOCO holds {pending} pending updates of one neighbour")
    holders: dict[str, list[str]] = {}
    for member in target.target.membership.view:
        if member.status.live:
            holders.setdefault(member.address, []).append(member.id)
    shared = {address: ids for address, ids in holders.items() if len(ids) > 1}
    if shared:
        found.append(f"live members sharing an address: {shared}")
    return found


def fuzz(fuzzer: Fuzzer, examples: int, inputs: st.SearchStrategy[Input] = wire_inputs) -> None:
    """Send ``examples`` inputs drawn from ``inputs`` (one hypothesis run, no shrinking: the
    target's deaths, not an exception here, say whether it failed)."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs)
    def send(sent: Input) -> None:
        fuzzer.send(sent)

    send()
