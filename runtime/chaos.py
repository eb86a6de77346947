"""Scheduled faults for a local mesh: kill, pause and join nodes at given times.

Written the way users type them: ``--kill RANK@SECONDS`` (kill -9), ``--leave RANK@SECONDS``
(SIGTERM: a graceful leave), ``--pause RANK@SECONDS:DURATION`` (SIGSTOP, then SIGCONT) and
``--join COUNT@SECONDS``; times are on the mesh clock (seconds since the mesh started).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ChaosAction:
    at: float
    action: str  # kill | leave | pause | resume | join
    rank: int = -1  # the node acted on (kill, pause, resume)
    count: int = 0  # nodes started (join)


def parse_kill(text: str) -> ChaosAction:
    rank, at = _split(text, "@", "--kill", "RANK@SECONDS, e.g. 3@10")
    return ChaosAction(_seconds(at, "--kill", text), "kill", rank=_whole(rank, "--kill", text))


def parse_leave(text: str) -> ChaosAction:
    rank, at = _split(text, "@", "--leave", "RANK@SECONDS, e.g. 3@10")
    return ChaosAction(_seconds(at, "--leave", text), "leave", rank=_whole(rank, "--leave", text))


def parse_join(text: str) -> ChaosAction:
    count, at = _split(text, "@", "--join", "COUNT@SECONDS, e.g. 2@15")
    joined = _whole(count, "--join", text)
    if joined < 1:
        raise ValueError(f"--join {text!r}: COUNT must be >= 1")
    return ChaosAction(_seconds(at, "--join", text), "join", count=joined)


def parse_pause(text: str) -> list[ChaosAction]:
    rank, when = _split(text, "@", "--pause", "RANK@SECONDS:DURATION, e.g. 2@5:0.8")
    at, duration = _split(when, ":", "--pause", "RANK@SECONDS:DURATION, e.g. 2@5:0.8")
    start = _seconds(at, "--pause", text)
    length = _seconds(duration, "--pause", text)
    node = _whole(rank, "--pause", text)
    return [ChaosAction(start, "pause", rank=node), ChaosAction(start + length, "resume", rank=node)]


def _split(text: str, separator: str, flag: str, form: str) -> tuple[str, str]:
    left, found, right = text.partition(separator)
    if not found:
        raise ValueError(f"{flag} {text!r}: expected {form}")
    return left, right


def _whole(text: str, flag: str, whole: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} {whole!r}: {text!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"{flag} {whole!r}: {value} must be >= 0")
    return value


def _seconds(text: str, flag: str, whole: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} {whole!r}: {text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag} {whole!r}: seconds must be >= 0")
    return value
