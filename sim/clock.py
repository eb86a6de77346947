"""Virtual time for real, blocking code: a conservative discrete-event scheduler.

Each node's main loop runs in a greenlet (a coroutine with its own stack, so the algorithms'
blocking calls need no change) and any thread the algorithm starts itself (AD-PSGD's exchanger)
stays an OS thread. Only one of them runs at a time, and only the scheduler hands over: a
simulated thread gives control back only where it would wait in a real mesh (a ``recv`` with
nothing to read, a compute step), the scheduler resumes the next ready one, and only when none
is ready does it advance the clock to the next event (a message arriving, a wait timing out).
So virtual time moves only when every simulated thread is blocked, and a run is a deterministic
function of its inputs and seeds. Switching greenlets costs about a microsecond, which is what
makes thousands of nodes affordable; switching OS threads costs tens and depends on the load.

A thread the simulated code starts is adopted at its first call into the clock (``enter``);
before resuming anything the scheduler waits until every such newcomer has been adopted, so
when it joins does not depend on the OS scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import greenlet

ADOPT_POLL_S = 0.0005  # how often the scheduler looks for newcomers it is waiting for


class Stopped(BaseException):
    """Raised in a node's main loop at its next wait once the node has failed."""


class DeadlockError(RuntimeError):
    """Every simulated thread waits with no timeout and nothing in flight."""


@dataclass(eq=False)
class SimThread:
    """A simulated thread (a node's main greenlet, or an adopted OS thread) and its wait state."""

    name: str
    owner: str  # the node it belongs to
    glet: greenlet.greenlet | None = None  # None: an adopted OS thread, resumed through ``go``
    go: threading.Lock = field(default_factory=threading.Lock)  # held while the OS thread must wait
    wait_id: int = 0  # bumped by every wait, so a stale wake-up (a timer after a message) is ignored
    waiting: bool = False
    woken_by: str = ""  # "timeout", "message", "notify" or "stop"
    parked: bool = False  # its node failed: never resumed again

    def __post_init__(self) -> None:
        self.go.acquire()


class VirtualClock:
    """The scheduler; ``now`` is the virtual time in seconds. Create and run it in one thread."""

    def __init__(self) -> None:
        self.now = 0.0
        self.closed = False  # after the run: waits return at once, threads run freely
        self._events: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._ready: deque[SimThread] = deque()
        self._mains: dict[greenlet.greenlet, SimThread] = {}
        self._threads: dict[int, SimThread] = {}  # adopted OS threads, by ident
        self._live_mains = 0
        self._outside = threading.active_count()  # OS threads that are not simulated
        self._newcomers: list[tuple[int, SimThread]] = []
        self._adopt = threading.Condition()
        self._home = threading.get_ident()
        self._scheduler = greenlet.getcurrent()
        self._back = threading.Lock()  # released by an OS thread that hands control back
        self._back.acquire()
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
        if not thread.waiting or thread.wait_id != wait_id or thread.parked:
            return False
        thread.waiting = False
        thread.woken_by = reason
        self._ready.append(thread)
        return True

    # -- simulated threads --------------------------------------------------------------------

    def spawn(self, name: str, owner: str, target: Callable[[], None]) -> None:
        """Add a node's main loop; it starts when the scheduler first resumes it."""

        def body() -> None:
            try:
                target()
            except Stopped:
                pass
            except BaseException as exc:
                self._failure = self._failure or exc
            finally:
                self._live_mains -= 1

        sim = SimThread(name, owner, greenlet.greenlet(body, parent=self._scheduler))
        self._mains[sim.glet] = sim
        self._live_mains += 1
        self._ready.append(sim)

    def enter(self, owner: str) -> SimThread | None:
        """Called at every entry into the simulated network: the caller, adopting (and pausing
        until resumed) an OS thread the simulated code started; None once the run is closed."""
        if self.closed:
            return None
        ident = threading.get_ident()
        if ident == self._home:
            me = self._mains.get(greenlet.getcurrent())
            if me is None:
                raise RuntimeError("a simulated peer was called from outside the simulated nodes")
            return me
        if (me := self._threads.get(ident)) is not None:
            return me
        me = SimThread(threading.current_thread().name, owner)
        with self._adopt:
            if self.closed:
                return None
            self._newcomers.append((ident, me))
            self._adopt.notify_all()
        me.go.acquire()
        return None if self.closed else me

    def sleep(self, owner: str, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass for the caller."""
        me = self.enter(owner)
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
        """Hand control to the scheduler until ``me`` is woken; returns why it was ("closed"
        once the run is over). Raises Stopped in the main loop of a failed node."""
        if me.glet is not None:
            self._scheduler.switch()
        else:
            self._back.release()
            me.go.acquire()
        if self.closed:
            return "closed"
        if me.woken_by == "stop":
            raise Stopped
        return me.woken_by

    def stop_node(self, owner: str) -> None:
        """The node failed: its main loop unwinds at its next wait, its other threads are never
        resumed (they end when the run is closed)."""
        for sim in self._mains.values():
            if sim.owner == owner and not self.wake(sim, sim.wait_id, "stop"):
                sim.woken_by = "stop"
        for sim in self._threads.values():
            if sim.owner == owner:
                sim.parked = True
                if sim in self._ready:
                    self._ready.remove(sim)

    # -- running ------------------------------------------------------------------------------

    def run(self) -> None:
        """Run until every main loop has finished, then close. Re-raises a loop's error."""
        if threading.get_ident() != self._home:
            raise RuntimeError("run a VirtualClock in the thread that created it")
        try:
            while (sim := self._next()) is not None:
                if sim.glet is not None:
                    sim.glet.switch()
                else:
                    sim.go.release()
                    self._back.acquire()
        finally:
            self.close()
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Release every adopted thread: from now on waits return at once."""
        with self._adopt:
            if self.closed:
                return
            self.closed = True
            for sim in [*self._threads.values(), *(s for _, s in self._newcomers)]:
                if sim.go.locked():
                    sim.go.release()
            self._newcomers.clear()

    def _next(self) -> SimThread | None:
        """The next thread to resume, advancing the clock through events until one is ready;
        None when the run is over (every main loop finished, an error, or a deadlock)."""
        while self._failure is None:
            self._adopt_newcomers()
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

    def _adopt_newcomers(self) -> None:
        """Wait until every OS thread the simulated code started has entered the clock (or
        ended), then queue the newcomers in name order."""
        if threading.active_count() <= self._outside + len(self._threads) and not self._newcomers:
            return
        with self._adopt:
            while threading.active_count() > self._outside + len(self._threads) + len(self._newcomers):
                self._adopt.wait(ADOPT_POLL_S)
            for ident, sim in sorted(self._newcomers, key=lambda pair: pair[1].name):
                self._threads[ident] = sim
                self._ready.append(sim)
            self._newcomers.clear()
