"""How an environment's calls run (``rlflow/multiturn.py`` drives the episodes): ``async def`` steps on one event
loop, sync ones in daemon threads, each bounded by the timeout from the moment it starts, and an ``async def``
that blocks the loop timed slice by slice, so that its stall is its own timeout and not the episodes it held up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import logging
import queue
import threading
import time

log = logging.getLogger("rlflow")


class EnvTimeout(Exception):
    """An environment's start or step outlasted ``MultiTurnConfig.timeout_s`` (its own TimeoutError is an error)."""


class Slices:
    """An ``async def`` call run slice by slice (each ``send`` to its coroutine is the time it holds the event loop
    without yielding), timed: ``longest`` is its longest slice. ``held`` (shared by the calls of one loop) adds
    up the slices long enough to have stalled the other calls (over ``STALL_S``), so that their timeouts do not
    count the time this call kept the loop from them."""

    def __init__(self, coro, held: list):
        self.coro, self.held, self.longest, self.charged = coro, held, 0.0, 0.0

    def __await__(self):
        it, send, err = self.coro.__await__(), None, None
        while True:
            t0 = time.perf_counter()
            try:
                got = it.throw(err) if err is not None else it.send(send)
            except StopIteration as stop:
                self._took(time.perf_counter() - t0)
                return stop.value
            except BaseException:
                self._took(time.perf_counter() - t0)
                raise
            self._took(time.perf_counter() - t0)
            try:
                send, err = (yield got), None
            except BaseException as e:  # noqa: BLE001 -- a cancellation (or a throw) goes to the coroutine
                send, err = None, e

    def _took(self, dt: float) -> None:
        self.longest = max(self.longest, dt)
        if dt > STALL_S:
            self.held[0] += dt
            self.charged += dt


STALL_S = 0.1  # an async slice this long stalls every other episode: reported once, and not charged to them


class Threads:
    """Up to ``n`` daemon threads, started as calls need them, that run sync environment calls (daemon: a call
    that never returns cannot keep the process from exiting, as a ThreadPoolExecutor's joined threads would; it
    keeps its thread, which is lost to the others)."""

    def __init__(self, n: int):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._n, self._started, self._idle = n, 0, 0
        self._lock = threading.Lock()

    def run(self, loop, fn, args):
        """(an asyncio future set when a thread starts the call, one with its outcome), of ``loop``."""
        started, done = loop.create_future(), loop.create_future()
        with self._lock:
            if self._idle == 0 and self._started < self._n:
                self._started += 1
                threading.Thread(target=self._work, name=f"rlflow-env-{self._started}", daemon=True).start()
            else:
                self._idle -= 1 if self._idle else 0
        self._q.put((loop, fn, args, started, done))
        return started, done

    def close(self) -> None:
        for _ in range(self._started):
            self._q.put(None)

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            loop, fn, args, started, done = job
            loop.call_soon_threadsafe(_settle, started, None, None)
            try:
                out, err = fn(*args), None
            except BaseException as e:  # noqa: BLE001
                out, err = None, e if isinstance(e, Exception) else RuntimeError(repr(e))
            loop.call_soon_threadsafe(_settle, done, out, err)
            with self._lock:
                self._idle += 1


def _settle(fut, out, err) -> None:
    if not fut.done():
        fut.set_exception(err) if err is not None else fut.set_result(out)


class EnvCalls:
    """The environments' calls of one rank's episodes, on one event loop (its own thread): ``async def`` calls run
    on it slice by slice (``Slices``), sync ones in up to ``concurrency`` threads (``Threads``); each is bounded by
    ``timeout_s`` from the moment it starts. ``env`` names the environment in the one warning it may give."""

    def __init__(self, env: str, *, concurrency: int, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlflow-env", daemon=True)
        self._thread.start()
        self._sync = Threads(concurrency)
        self._held, self._warned_blocking = [0.0], False  # seconds async calls held the loop (``Slices``)

    def submit(self, fn, *args, then=None) -> cf.Future:
        """``fn(*args)`` for an environment, bounded by the timeout from the moment it starts (a sync call: once a
        thread runs it); ``then(future)``, on the event loop's thread, once it is settled."""
        timeout = self.timeout_s

        async def bounded():
            timed = None
            if inspect.iscoroutinefunction(fn):
                timed = Slices(fn(*args), self._held)
                task = asyncio.ensure_future(timed)
            else:
                started, done = self._sync.run(self._loop, fn, args)
                await started
                task = done
            # asyncio.wait, not wait_for: a step that swallows its cancellation cannot hold the driver. The time
            # another async call held the loop (a blocking call in its async def) is given back to this one.
            held0, given, budget = self._held[0], 0.0, timeout
            while True:
                finished, _ = await asyncio.wait({task}, timeout=budget)
                if finished:
                    break
                stolen = self._held[0] - held0 - (0.0 if timed is None else timed.charged)  # its own are its own
                if stolen <= given:
                    task.cancel()
                    raise EnvTimeout(f"took over {timeout} s")
                budget, given = stolen - given, stolen
            if timed is not None and timed.longest > STALL_S:
                self._blocked(timed.longest)
                if timed.longest > timeout:
                    raise EnvTimeout(f"blocked the event loop for {timed.longest:.1f} s, over the {timeout} s timeout "
                                     f"(a blocking call inside async def step)")
            out = task.result()
            if inspect.isawaitable(out):  # a sync step that returned a coroutine
                out = await asyncio.wait_for(out, timeout)
            return out

        async def settled():
            try:
                out = cf.Future()
                out.set_result(await bounded())
            except BaseException as e:  # noqa: BLE001  (the environment's failure is the episode's, not the run's)
                out = cf.Future()
                out.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if then is not None:
                then(out)
            return out
        # its result: a settled future of the call's outcome (``result()`` gives it or raises its exception)
        return asyncio.run_coroutine_threadsafe(settled(), self._loop)

    def _blocked(self, seconds: float) -> None:
        """One line, once a run: an async step that holds the event loop stalls every other episode."""
        if not self._warned_blocking:
            self._warned_blocking = True
            log.warning("multi-turn: an async step of %s held the event loop for %.1f s without awaiting (a blocking "
                        "call such as time.sleep or requests inside async def): every episode waits while it does; "
                        "await it (asyncio.sleep, asyncio.to_thread) or make step a plain def (run in a thread)",
                        self.env, seconds)

    def close(self) -> None:
        self._sync.close()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
