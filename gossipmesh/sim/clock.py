"""Virtual time for real, blocking code: a conservative discrete-event scheduler.

Every simulated thread (a node's main loop, and the background work an algorithm asks its
network for, such as AD-PSGD's exchanger) is a greenlet: a coroutine with its own stack, so the
algorithms' blocking calls need no change. Only one runs at a time, and only the scheduler hands
over: a simulated thread gives control back only where it would wait in a real mesh (a ``recv``
with nothing to read, a compute step), the scheduler resumes the next ready one, and only when
none is ready does it advance the clock to the next event (a message arriving, a wait timing
out). So virtual time moves only when every simulated thread is blocked, and a run is a
deterministic function of its inputs and seeds. Switching greenlets costs about a microsecond,
which is what makes thousands of nodes affordable.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import greenlet


class Stopped(BaseException):
    """Raised in a failed node's simulated threads at their next wait."""


class DeadlockError(RuntimeError):
    """Every simulated thread waits with no timeout and nothing in flight."""


@dataclass(eq=False)
class SimThread:
    """A simulated thread and its wait state; background work is a ``gossip.network.Background``."""

    name: str
    owner: str  # the node it belongs to
    glet: greenlet.greenlet
    clock: VirtualClock
    wait_id: int = 0  # bumped by every wait, so a stale wake-up (a timer after a message) is ignored
    waiting: bool = False
    woken_by: str = ""  # "timeout", "message", "notify" or "stop"
    stopped: bool = False  # its node failed

    def join(self, timeout: float | None = None) -> None:
        """Unwind the coroutine where it waits (its node's run is over); ``timeout`` is moot."""
        if not self.clock.closed:
            raise RuntimeError(
                f"{self.name}: join simulated background work after VirtualClock.run has returned "
                "(gossipmesh.sim.run closes every averager then)"
            )
        if not self.glet.dead:
            self.glet.throw()


class VirtualClock:
    """The scheduler; ``now`` is the virtual time in seconds. Run it where it was created."""

    def __init__(self) -> None:
        self.now = 0.0
        self.closed = False  # after the run: the simulated code's waits return at once
        self._events: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._ready: deque[SimThread] = deque()
        self._threads: dict[greenlet.greenlet, SimThread] = {}
        self._live_mains = 0
        self._scheduler = greenlet.getcurrent()
        self._failure: BaseException | None = None

    # -- events -------------------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], object]) -> None:
        """Run ``action`` in the scheduler at virtual ``time`` (now, if that has passed)."""
        heapq.heappush(self._events, (max(time, self.now), next(self._seq), action))

    def after(self, seconds: float) -> float:
        """The time ``seconds`` from now, strictly later for any positive ``seconds`` (so a wait
        loop whose deadline is a rounding error away still advances)."""
        later = self.now + seconds
        return later if later > self.now or seconds <= 0 else math.nextafter(self.now, math.inf)

    def wake(self, thread: SimThread, wait_id: int, reason: str) -> bool:
        """Make a waiting thread ready, unless that wait already ended; True if it did."""
        if not thread.waiting or thread.wait_id != wait_id:
            return False
        thread.waiting = False
        thread.woken_by = reason
        self._ready.append(thread)
        return True

    # -- simulated threads --------------------------------------------------------------------

    def spawn(self, name: str, owner: str, target: Callable[[], None], *, main: bool = True) -> SimThread:
        """Add a simulated thread of node ``owner``, ready to start: its main loop, or background
        work (``main=False``), which the run does not wait for."""

        def body() -> None:
            try:
                target()
            except (Stopped, greenlet.GreenletExit):
                pass
            except BaseException as exc:
                self._failure = self._failure or exc
            finally:
                if main:
                    self._live_mains -= 1

        sim = SimThread(name, owner, greenlet.greenlet(body, parent=self._scheduler), self)
        self._threads[sim.glet] = sim
        if main:
            self._live_mains += 1
        self._ready.append(sim)
        return sim

    def enter(self) -> SimThread | None:
        """The simulated thread calling into the simulated network; None once the run is closed."""
        if self.closed:
            return None
        me = self._threads.get(greenlet.getcurrent())
        if me is None:
            raise RuntimeError("a simulated peer was called from outside the simulated nodes")
        return me

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass for the caller."""
        me = self.enter()
        if me is None:
            return
        wait_id = self.begin_wait(me)
        self.at(self.after(seconds), lambda: self.wake(me, wait_id, "timeout"))
        self.block(me)

    def begin_wait(self, me: SimThread) -> int:
        me.wait_id += 1
        me.waiting = True
        return me.wait_id

    def block(self, me: SimThread) -> str:
        """Hand control to the scheduler until ``me`` is woken; returns why it was. Raises
        Stopped once its node has failed."""
        if not me.stopped:
            self._scheduler.switch()
        if me.stopped:
            raise Stopped
        return me.woken_by

    def stop_node(self, owner: str) -> None:
        """The node failed: each of its simulated threads unwinds at its next wait (now, if it
        is waiting)."""
        for sim in self._threads.values():
            if sim.owner == owner:
                sim.stopped = True
                self.wake(sim, sim.wait_id, "stop")

    # -- running ------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until every main loop has finished, then close. Re-raises a loop's error."""
        if greenlet.getcurrent() is not self._scheduler:
            raise RuntimeError("run a VirtualClock in the thread (and greenlet) that created it")
        try:
            while (sim := self._next()) is not None:
                sim.glet.switch()
        finally:
            self.close()
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """End the run: from now on waits return at once (join background work to unwind it)."""
        self.closed = True

    def _next(self) -> SimThread | None:
        """The next thread to resume, advancing the clock through events until one is ready;
        None when the run is over (every main loop finished, an error, or a deadlock)."""
        while self._failure is None:
            if self._ready:
                return self._ready.popleft()
            if self._live_mains == 0:
                return None
            if not self._events:
                self._failure = DeadlockError(
                    f"at t={self.now:.6f} s every simulated thread waits with nothing in flight"
                )
                break
            self.now, _, action = heapq.heappop(self._events)
            action()
        return None
