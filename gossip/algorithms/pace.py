"""Which neighbours a synchronous round waits for, and when a node behind them skips ahead,
both from what it measures: when each neighbour's values arrive and which rounds they name.

A neighbour's lag for round r is how long after this node sent its own value of round r the
neighbour's value of round r began to arrive (0 when it came first; a value of a round older
than those kept counts from the oldest kept). Its lag is the median of its last ``LAG_SAMPLES``.
A neighbour is a straggler when its lag is above

    max(MIN_LAG_S, typical + LAG_FACTOR * max(typical, step))

where ``typical`` is the lower median of the lags of every member measured (this round's neighbours
and other rounds': on a time-varying graph a round has one neighbour, and its lag is told slow or
not against the others') and ``step`` the median time this node spends between two rounds (its local
steps): waiting for it would cost the round more than one and a half of this node's steps beyond
what the others cost, and more than ``MIN_LAG_S`` (a shorter wait is not worth a value left out, and
is within a busy machine's jitter). A straggler is not waited for; its value is mixed when it is in
(a backup worker), or late, within the age its lag predicts (:meth:`Pace.age_bound`). It is waited
for again as soon as its lag comes down, which its values show whether or not they are waited for.
At most the neighbours above the lower median are stragglers, so a static graph's round always waits
for some.

A neighbour that has sent a value of a later round than this one without one of this round (it
held it back from its busy link, or skipped) will not send this round's: it is not waited for
(:meth:`Pace.moved_on`), and that round counts as a lag without end (:meth:`Pace.not_in`).
Behind a slow uplink a node runs ahead of its neighbours and holds most of its values back; those
that come are ahead of its neighbours' rounds (a lag of 0). Waiting for the values it never sent
cost each neighbour its whole wait limit every round, and, measured by the values that came, it
was the one against which the neighbour's other neighbours looked late.

The straggler itself sees its neighbours ahead of it: with ``catch_up=c`` it skips to the
round after theirs once they are c or more rounds ahead (:meth:`Pace.skip_to`), instead of
working through rounds they have left long ago. Its counterpart bounds running ahead (in
D-PSGD): a node more than c rounds ahead of every neighbour (by the newest round each has sent a
value of: :meth:`Pace.ahead`) whose last round mixed none of their values waits for them before
its round, taking what they send, until one of them is within c rounds or they fall silent.
Such a node (one whose round waits gave up on values held back by slow links) otherwise stepped
on alone, every value of its neighbours coming too many rounds old to be mixed.

Behind a link that carries less than the node sends, its values would queue and each arrive
older than the one before (up to 43 rounds old behind a 0.4 Mbit/s uplink of a local-steps
mesh). Tolerating stragglers, a node therefore holds a round's value back from a neighbour whose
link still has earlier ones leaving (:meth:`Pace.ready`, from the transport's ``backlog``): SGP
keeps the share while one push is leaving (push-sum stays exact with it); D-PSGD lets one value
wait behind the one leaving, so that a neighbour still measuring its lag sees values come, later
and later, rather than none (a value that never comes costs a whole round's wait until the lag
is known). Where every value must arrive (waiting for every neighbour), nothing is held back.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence

LAG_SAMPLES = 8
LAG_FACTOR = 1.5
MIN_LAG_S = 0.01
KEPT_ROUNDS = 64  # rounds whose sending time is kept (a lag older than them counts from the oldest)
CATCH_UP = 2  # the rounds ahead that make a node skip when it tolerates stragglers
STRAGGLERS = ("tolerate", "wait")  # the ``stragglers=`` choices of dpsgd, choco and sgp


class Pace:
    """Arrival lags and rounds heard of one node's neighbours.

    Args:
        tolerate: whether measured stragglers are left out of the wait (else: none are).
        catch_up: skip ahead when the neighbours are this many rounds ahead; 0: never.
        holds_back: whether the algorithm holds values back from a busy link (:meth:`ready`).
    """

    def __init__(self, *, tolerate: bool, catch_up: int, holds_back: bool = False) -> None:
        self.tolerate = tolerate
        self.catch_up = catch_up
        self.holds_back = holds_back
        self.newest: dict[str, int] = {}  # sender -> the newest round it sent a value of
        self.passed_over = 0  # neighbour-rounds not waited for (stragglers)
        self.sends_held = 0  # values not sent: an earlier one to that neighbour was still leaving
        self.rounds_skipped = 0
        self._sent_at: dict[int, float] = {}  # round -> when this node sent its value (in order)
        self._lags: dict[str, deque[float]] = {}
        self._steps: deque[float] = deque(maxlen=LAG_SAMPLES * 4)
        self._mixed_at: float | None = None

    def sent(self, r: int, now: float) -> None:
        """This node sent its value of round ``r`` at ``now``."""
        if self._mixed_at is not None:
            self._steps.append(now - self._mixed_at)
        self._sent_at[r] = now
        while len(self._sent_at) > KEPT_ROUNDS:
            del self._sent_at[next(iter(self._sent_at))]

    def ready(self, targets: Sequence[str], backlog: Callable[[str], int], behind: int = 0) -> list[str]:
        """The ``targets`` to send this round's value to: all, unless tolerating stragglers;
        then those with at most ``behind`` values still leaving for them (``backlog``: see above)."""
        if not self.tolerate:
            return list(targets)
        ready = [target for target in targets if backlog(target) <= behind]
        self.sends_held += len(targets) - len(ready)
        return ready

    def mixed(self, now: float) -> None:
        """This node's round ended (the training loop takes its local steps now)."""
        self._mixed_at = now

    def arrived(self, sender: str, r: int, now: float) -> None:
        """A value of round ``r`` from ``sender`` began to arrive (each value counts once)."""
        if r <= self.newest.get(sender, -1):
            return
        self.newest[sender] = r
        if not self._sent_at or r > next(reversed(self._sent_at)):
            lag = 0.0  # ahead of this node
        else:
            lag = max(0.0, now - self._sent_at.get(r, next(iter(self._sent_at.values()))))
        self._lags.setdefault(sender, deque(maxlen=LAG_SAMPLES)).append(lag)

    def lag(self, sender: str) -> float | None:
        """The median of ``sender``'s recent lags; None before half of ``LAG_SAMPLES``."""
        lags = self._lags.get(sender)
        return statistics.median(lags) if lags and len(lags) >= LAG_SAMPLES // 2 else None

    def stragglers(self, neighbours: Iterable[str]) -> set[str]:
        """The neighbours not to wait for this round (none unless tolerating)."""
        if not self.tolerate or not self._steps:
            return set()
        lags = {j: lag for j in self._lags if (lag := self.lag(j)) is not None}
        if len(lags) < 2:
            return set()
        typical = statistics.median_low(lags.values())
        limit = max(MIN_LAG_S, typical + LAG_FACTOR * max(typical, statistics.median(self._steps)))
        slow = {j for j in neighbours if lags.get(j, 0.0) > limit}
        self.passed_over += len(slow)
        return slow

    def keep(self, members: Collection[str]) -> None:
        """Forget what was measured of nodes no longer ``members`` (a departed node's lag is no
        measure of the others')."""
        self.newest = {j: k for j, k in self.newest.items() if j in members}
        self._lags = {j: lags for j, lags in self._lags.items() if j in members}

    def ahead(self, r: int, neighbours: Collection[str]) -> bool:
        """Whether round ``r`` is more than ``catch_up`` rounds ahead of the newest value of
        every one of ``neighbours`` (never, without ``catch_up``, or while one of them has sent
        none: where it is is not known)."""
        if not self.catch_up or not neighbours:
            return False
        return all(self.newest.get(j, r) < r - self.catch_up for j in neighbours)

    def moved_on(self, sender: str, r: int) -> bool:
        """Whether ``sender`` has sent a value of a round after ``r`` (its values come in order:
        one of round ``r`` that has not begun to arrive will not come)."""
        return self.newest.get(sender, -1) > r

    def coming(self, sender: str, r: int, *, complete: bool, begun: bool) -> bool:
        """Whether the rest of ``sender``'s value of round ``r`` may still come: not once it is
        ``complete``, nor when none of it has ``begun`` to arrive and the sender moved on."""
        return not complete and (begun or not self.moved_on(sender, r))

    def not_in(self, sender: str, r: int) -> None:
        """``sender``'s value of round ``r``, waited for, is not in when the round's wait ends:
        if it has moved on without it, a lag without end. Its values come ahead of this node's
        (a lag of 0) when they come; counted by those alone, a neighbour that sends one round
        in twenty would be the measure against which every other neighbour looked late."""
        if self.moved_on(sender, r):
            self._lags.setdefault(sender, deque(maxlen=LAG_SAMPLES)).append(math.inf)

    def age_bound(self, sender: str, now: float) -> int:
        """The oldest (in rounds) a straggler's late value may be and still be mixed: twice the
        rounds this node sent during the straggler's lag, and at least one."""
        lag = self.lag(sender) or 0.0
        rounds = sum(1 for t in self._sent_at.values() if t >= now - lag)
        return max(1, 2 * rounds)

    def mixes_late(self, sender: str, age: int, now: float) -> bool:
        """Whether ``sender``'s value ``age`` rounds late is still mixed: only when tolerating
        stragglers (a round that waited for every neighbour drops what missed it), and then
        within :meth:`age_bound`, whoever sent it."""
        return self.tolerate and 0 < age <= self.age_bound(sender, now)

    def skip_to(
        self, r: int, members: Callable[[int], Collection[str]], limit: int | None = None
    ) -> int | None:
        """The round to skip to from round ``r``: the one after the median of the newest rounds
        the neighbours taking part in round ``r`` sent (``members``: those of a round), when
        that is ``catch_up`` or more ahead; None to go on with ``r``. The median, so one
        neighbour naming a round far ahead cannot throw the node forward. Where none of them
        takes part in the round after (they left after it: their step budgets ended), the
        median itself, whose values are here: a round after theirs would mix nothing. Never
        past ``limit`` (the round at which the node's step budget ends, where it is known)."""
        taking_part = members(r)
        self.keep(taking_part)
        if not self.catch_up or not self.newest:
            return None
        ahead = statistics.median_low(self.newest.values())
        if ahead - r < self.catch_up:
            return None
        going_on = members(ahead + 1)
        target = ahead + 1 if any(j in going_on for j in self.newest) else ahead
        if limit is not None:
            target = min(target, limit)
        if target <= r:
            return None
        self.rounds_skipped += target - r
        return target

    def report(self) -> dict[str, float]:
        """The counters a node reports (those of the features in use)."""
        figures: dict[str, float] = {}
        if self.tolerate:
            figures["stragglers_passed_over"] = self.passed_over
            if self.holds_back:
                figures["sends_held"] = self.sends_held
        if self.catch_up:
            figures["rounds_skipped"] = self.rounds_skipped
        return figures


def pace_option(
    algorithm: str, stragglers: str, catch_up: int | None, *, may_skip: bool = True, holds_back: bool = False
) -> Pace:
    """The pace of a synchronous algorithm's options ``stragglers=`` and ``catch_up=``; an
    unset ``catch_up`` is ``CATCH_UP`` for a node that tolerates stragglers (which leave it
    behind when it is the slow one) where the algorithm ``may_skip`` rounds, else 0.
    ``holds_back``: see :class:`Pace`."""
    if stragglers not in STRAGGLERS:
        raise ValueError(f"{algorithm} stragglers is one of {', '.join(STRAGGLERS)}, got {stragglers!r}")
    tolerate = stragglers == "tolerate"
    if catch_up is None:
        catch_up = CATCH_UP if tolerate and may_skip else 0
    return Pace(tolerate=tolerate, catch_up=catch_up, holds_back=holds_back)
