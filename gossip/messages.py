"""Every kind of message the averaging sends, declared once: its name, the fields of its payload
(the header's ``meta``) and what its frames carry.

A handler reads a payload through :meth:`Payload.decode`, which checks every declared field's
type (an ``int`` is an int, not a bool or a float) and fills in defaults, and raises
:class:`PayloadError` for a missing or mistyped one; what a field's value may be beyond its type
(a chunk index within the state, a step size in (0, 1]) is the handler's to check. Fields a
payload does not declare are left alone: the self-tuning agreements add their proposals to any
averaging message (``gossip.tuning.agreement``), and a codec its own fields to CHOCO's updates
(``gossip.compression``). The frame layout and limits are the network's (``p2p.wire``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar


class PayloadError(ValueError):
    """A payload without a declared field, or with one of the wrong type."""


@dataclass(frozen=True)
class Payload:
    """The base of every payload: a frozen dataclass of the header's fields."""

    @classmethod
    def decode(cls: type[P], meta: Mapping[str, Any]) -> P:
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            expected, optional = _field_type(cls, field.name)
            value = meta.get(field.name)
            if value is None and (optional or field.default is not dataclasses.MISSING):
                continue  # (the dataclass fills in the default, None for an optional field)
            if not _CHECKS[expected](value):
                raise PayloadError(f"{cls.__name__}.{field.name} is {_shown(value)}, not {_name(expected)}")
            values[field.name] = value
        return cls(**values)

    def encode(self) -> dict[str, Any]:
        """The header's meta (None fields left out)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) is not None
        }


P = TypeVar("P", bound=Payload)

_CHECKS: dict[object, Callable[[object], bool]] = {
    int: lambda v: type(v) is int,
    float: lambda v: type(v) is float,
    bool: lambda v: type(v) is bool,
    str: lambda v: type(v) is str,
    list[int]: lambda v: isinstance(v, list) and all(type(i) is int for i in v),
    list[float]: lambda v: isinstance(v, list) and all(type(i) is float for i in v),
    list[Any]: lambda v: isinstance(v, list),
    dict[str, Any]: lambda v: isinstance(v, dict) and all(type(k) is str for k in v),
}


_FIELD_TYPES: dict[tuple[type, str], tuple[object, bool]] = {}


def _field_type(cls: type, name: str) -> tuple[object, bool]:
    """(the declared type, whether None is allowed) of field ``name``, resolved once."""
    if (cls, name) not in _FIELD_TYPES:
        hint = typing.get_type_hints(cls)[name]
        optional = isinstance(hint, types.UnionType)
        if optional:
            (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        _FIELD_TYPES[cls, name] = hint, optional
    return _FIELD_TYPES[cls, name]


def _name(expected: object) -> str:
    return getattr(expected, "__name__", str(expected)) if not typing.get_args(expected) else str(expected)


def _shown(value: object, limit: int = 60) -> str:
    text = "missing" if value is None else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the payloads -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange(Payload):
    """AD-PSGD: which exchange an ask, a turn, a request or its answer belongs to."""

    exchange: int


@dataclass(frozen=True)
class PushShare(Payload):
    """SGP: the share's push-sum weight by segment of the vector, ``weights[i]`` from element
    ``starts[i]`` on (one segment from 0, unless a share the sender mixed was cut off)."""

    starts: list[int]
    weights: list[float]


@dataclass(frozen=True)
class ChocoStep(Payload):
    """CHOCO: the sender's step size γ at the round of its update q or of its public copy (an
    update's codec fields ride along: its codec reads them); a public copy names
    ``since``, the round of the last q it holds (a node that skipped rounds sends its copy as of
    a later round than that)."""

    gamma: float
    since: int | None = None


@dataclass(frozen=True)
class StateRequest(Payload):
    """A joiner asks a source for its manifest (``manifest``), else for ``chunks`` of
    ``chunk_bytes``, having ``settled`` that many of those asked so far."""

    transfer: int
    manifest: bool = False
    chunk_bytes: int | None = None
    chunks: list[int] | None = None
    settled: int | None = None


STATE_VERSION = 3  # of the state transfer's format (3: the step counter is "steps")


@dataclass(frozen=True)
class StateManifest(Payload):
    """A source's state: ``layout`` (name, dtype, shape of each array), ``total`` bytes and the
    counters (steps, round, rounds per second); checked in full by ``Manifest.parse``."""

    transfer: int
    version: int
    layout: list[Any]
    counters: dict[str, Any]
    total: int

    @classmethod
    def decode(cls, meta: Mapping[str, Any]) -> StateManifest:
        """The version first: another version's fields may differ in any way."""
        if meta.get("version") != STATE_VERSION:
            raise PayloadError(f"version {_shown(meta.get('version'))}, this node reads {STATE_VERSION}")
        return super().decode(meta)


@dataclass(frozen=True)
class StateChunk(Payload):
    """A source's chunk ``index`` of the state (its one frame: the bytes)."""

    transfer: int
    index: int


@dataclass(frozen=True)
class Kind:
    """A message kind: its payload (None: the header carries only the round) and its frames."""

    payload: type[Payload] | None
    frames: str


PARAMS, PUSH, FINAL = "params", "push", "final"
PAIR_ASK, PAIR_TURN = "pair_ask", "pair_turn"
PAIR_MODEL, PAIR_DIFFERENCE = "pair_model", "pair_difference"
CHOCO_UPDATE, CHOCO_FULL_REQUEST, CHOCO_FULL = "choco", "choco_full_request", "choco_full"
STATE_REQUEST, STATE_MANIFEST, STATE_CHUNK = "state_request", "state_manifest", "state_chunk"

#: every kind the averaging sends; the header's round is the sender's round (a model version for
#: AD-PSGD's reply; 0 for state transfer, which is outside the rounds)
KINDS: dict[str, Kind] = {
    PARAMS: Kind(None, "D-PSGD: the model's vector in its wire layout (Layout.pack)"),
    PUSH: Kind(PushShare, "SGP: the sender's de-biased model z, in the vector's own layout"),
    FINAL: Kind(None, "every algorithm, once training ended: the model in its wire layout"),
    PAIR_ASK: Kind(Exchange, "AD-PSGD: none (an active node asks its passive partner for a turn)"),
    PAIR_TURN: Kind(Exchange, "AD-PSGD: none (the passive's go-ahead: send your model now)"),
    PAIR_MODEL: Kind(Exchange, "AD-PSGD: the active node's model in the wire layout"),
    PAIR_DIFFERENCE: Kind(Exchange, "AD-PSGD: half the passive's model before it mixed less the request's"),
    CHOCO_UPDATE: Kind(ChocoStep, "CHOCO: the codec's frames of q = Q(x - x̂)"),
    CHOCO_FULL_REQUEST: Kind(None, "CHOCO: none (send me your public copy)"),
    CHOCO_FULL: Kind(ChocoStep, "CHOCO: the public copy x̂, float32"),
    STATE_REQUEST: Kind(StateRequest, "none"),
    STATE_MANIFEST: Kind(StateManifest, "none"),
    STATE_CHUNK: Kind(StateChunk, "the chunk's bytes, uint8"),
}
