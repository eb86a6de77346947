"""The spelling of named, parameterised choices: ``NAME`` or ``NAME:key=value,...``.

Topologies (``random-regular:degree=4``), averaging algorithms (``dpsgd:backup=1``), robust
rules (``clip:b=2``) and codecs (``topk:0.01``) are all spelt this way, on the command line, in
config files and in library calls, and all are read by :func:`parse_spec`, which raises
:class:`SpecError` naming what is accepted. A name may have a *positional* parameter that a
bare first value sets: ``topk:0.01`` is ``topk:fraction=0.01``; a name whose only parameter is
positional takes the whole rest as its value (``file:PATH``, commas and all).

The value parsers below (:func:`number`, :func:`choice`) serve the parameters here and the
options of the command line alike, so a bound reads the same wherever it is checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

Parse = Callable[[str], Any]
N = TypeVar("N", int, float)
S = TypeVar("S", bound="Spec")


class SpecError(ValueError):
    """A spelling that does not parse; the message names what is accepted instead."""


@dataclass(frozen=True)
class Params:
    """What one name accepts: each parameter's parser, the positional one, the required ones."""

    accepted: Mapping[str, Parse] = field(default_factory=dict)
    positional: str | None = None
    required: tuple[str, ...] = ()


def parse_spec(text: str, choices: Mapping[str, Params], what: str) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of ``text``; every value parsed by its parameter's parser."""
    name, _, rest = text.strip().partition(":")
    if name not in choices:
        raise SpecError(f"unknown {what} {name!r}; choose one of {', '.join(spellings(choices))}")
    accepted = choices[name]
    params: dict[str, Any] = {}
    for key, value in _items(rest, accepted):
        if key not in accepted.accepted:
            known = ", ".join(accepted.accepted) or "none"
            raise SpecError(f"{name}: unknown parameter {key!r}; it takes: {known}")
        try:
            params[key] = accepted.accepted[key](value)
        except ValueError as exc:
            raise SpecError(f"{name}: {key}: {exc}") from None
    missing = [key for key in accepted.required if key not in params]
    if missing:
        raise SpecError(f"{name}: needs {', '.join(missing)}, as in {spellings({name: accepted})[0]}")
    return name, params


def format_spec(name: str, params: Mapping[str, Any], accepted: Params) -> str:
    """The spelling :func:`parse_spec` reads back as ``(name, params)``."""
    items = [
        _text(value) if key == accepted.positional else f"{key}={_text(value)}"
        for key, value in sorted(params.items(), key=lambda kv: (kv[0] != accepted.positional, kv[0]))
    ]
    return name + (":" + ",".join(items) if items else "")


def spellings(choices: Mapping[str, Params]) -> list[str]:
    """How each name is written, its required positional value in capitals (``file:PATH``)."""
    return [
        f"{name}:{p.positional.upper()}" if p.positional in p.required else name
        for name, p in choices.items()
    ]


@dataclass(frozen=True)
class Spec:
    """A name with its parameters, spelt ``NAME:key=value,...``; a subclass says what it is
    called in messages and which names exist: ``class Topology(Spec, what=..., choices=...)``."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    what: ClassVar[str]
    choices: ClassVar[Mapping[str, Params]]

    def __init_subclass__(cls, *, what: str, choices: Mapping[str, Params], **options: Any) -> None:
        super().__init_subclass__(**options)
        cls.what, cls.choices = what, choices

    @classmethod
    def parse(cls: type[S], text: str) -> S:
        """The one place a spelling becomes an object; :class:`SpecError` if it is not one."""
        name, params = parse_spec(text, cls.choices, cls.what)
        return cls(name, tuple(sorted(params.items())))

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.params)

    def __str__(self) -> str:
        return format_spec(self.name, self.options, self.choices[self.name])


def number(
    kind: Callable[[str], N],
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> Callable[[str], N]:
    """A parser of a finite int or float within the given bounds; its ValueError says which."""
    bounds = _bounds(above, at_least, below, at_most)
    noun = "whole number" if kind is int else "number"

    def parse(text: str) -> N:
        try:
            value = kind(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a {noun}") from None
        within = (
            (above is None or value > above)
            and (at_least is None or value >= at_least)
            and (below is None or value < below)
            and (at_most is None or value <= at_most)
        )
        if not (math.isfinite(value) and within):
            raise ValueError(f"must be {bounds or 'finite'}, got {value}")
        return value

    return parse


def choice(names: Iterable[str]) -> Callable[[str], str]:
    """A parser that accepts one of ``names``."""
    known = tuple(names)

    def parse(text: str) -> str:
        if text not in known:
            raise ValueError(f"choose one of {', '.join(known)}, not {text!r}")
        return text

    return parse


def _bounds(above: float | None, at_least: float | None, below: float | None, at_most: float | None) -> str:
    """``> 0``, ``>= 1``, ``in [0, 1)``...; empty when unbounded."""
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else ""
    high = f"{below:g})" if below is not None else f"{at_most:g}]" if at_most is not None else ""
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""


def _items(rest: str, accepted: Params) -> list[tuple[str, str]]:
    """``(key, value)`` pairs of what follows the colon; a bare first value is the positional."""
    positional = accepted.positional
    if not rest:
        return []
    only_positional = positional is not None and set(accepted.accepted) == {positional}
    if only_positional and not rest.startswith(f"{positional}="):
        return [(str(positional), rest)]
    pairs = []
    for index, item in enumerate(filter(None, rest.split(","))):
        key, equals, value = item.partition("=")
        if not equals and index == 0 and positional is not None:
            key, value = positional, item
        pairs.append((key, value))
    return pairs


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
