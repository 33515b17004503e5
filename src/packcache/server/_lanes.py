"""The worker's application threads (*lanes*): a queue each, and how the ``main`` lane runs the model.

A :class:`Lane` runs its requests one at a time, in a thread of its own or in whoever calls :meth:`Lane.serve`
(the worker's main thread runs the ``main`` lane: see :meth:`~packcache.server.worker.BufferingWorker.run`).

Batching (:class:`~packcache.server.app.Batching`): the ``main`` lane takes every request queued for it
and runs their texts in one forward (the application's ``prepare`` and ``complete``), up to
``max_batch_tokens`` tokens; a request that would pass the budget waits for the next forward (one over
the budget alone runs alone). Requests that come while a forward runs are queued and make the next one:
under load batches form without waiting. Before a forward with room left the lane waits up to
``batch_wait`` for more, only while another connection of the worker could still send one (it is sending
a request, or it got an answer within the last second): a lone client never waits. ``max_batch_tokens=0``
turns batching off: one request per forward.

A worker serving a causal LM runs :class:`GenerateLane` instead: the engine's loop in the main thread, and a
thread that reads each request and hands it to the engine.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ._http1 import Request
from .app import Batching

__all__ = ["BatchLane", "GenerateLane", "Lane"]


class Lane:
    """One application thread and its queue; ``started`` says since when its current request runs.

    ``own_thread=False``: the lane makes no thread; whoever calls :meth:`serve` runs it (the
    worker's main thread runs the ``main`` lane, see :meth:`BufferingWorker.run`).
    """

    def __init__(self, name: str, run: Callable[[Request], None], *, own_thread: bool = True) -> None:
        self.queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self.pending = 0  # queued or running; the loop's thread alone changes it
        self.started: float | None = None
        self._run = run
        # The main thread must come back to the interpreter now and then: a signal the kernel gave
        # another thread (the loop's) interrupts no wait of the main thread, yet only the main thread
        # runs Python's signal handlers (gunicorn's SIGTERM handler among them).
        self._poll = None if own_thread else 0.05
        if own_thread:
            threading.Thread(target=self.serve, name=f"packcache-{name}", daemon=True).start()

    running = 0  # requests the lane has taken from its queue and not answered yet (its thread alone changes it)

    def submit(self, request: Request) -> None:
        request.lane = self
        self.pending += 1
        self.queue.put(request)

    def serve(self) -> None:
        """Run the lane's requests until :meth:`stop`."""
        while True:
            request: Request | None = None
            if not self._has_held():
                try:
                    request = self.queue.get(timeout=self._poll)
                except queue.Empty:
                    continue
                if request is None:
                    return
            self.started = time.monotonic()
            try:
                stopped = self._step(request)
            finally:
                self.started = None
                self.running = 0
            if stopped:
                return

    def _has_held(self) -> bool:
        """Whether work taken from the queue earlier waits to run (then :meth:`serve` steps without a request)."""
        return False

    def _step(self, request: Request | None) -> bool:
        """Run one request; True when the lane was told to stop meanwhile."""
        assert request is not None
        self._run(request)
        return False

    def stop(self) -> None:
        self.queue.put(None)


class BatchLane(Lane):
    """The ``main`` lane with batching: every queued request up to the token budget, in one forward.

    ``prepare`` turns a request into a job (or answers it: a bad request never waits for a forward);
    ``complete`` runs a list of jobs and answers each. A job that does not fit the budget is held for
    the next forward, ahead of the queue, so requests are answered in the order they came.
    """

    def __init__(
        self,
        prepare: Callable[[Request], Any],
        complete: Callable[[list[tuple[Request, Any]]], None],
        batching: Batching,
        could_send: Callable[[], bool],
    ) -> None:
        super().__init__("main", lambda request: None, own_thread=False)
        self._prepare, self._complete, self._could_send = prepare, complete, could_send
        self._budget, self._wait = batching.max_batch_tokens, batching.batch_wait
        self._held: list[tuple[Request, Any]] = []

    def _has_held(self) -> bool:
        return bool(self._held)

    def _step(self, first: Request | None) -> bool:
        """One forward: gather jobs from ``first``, the held ones and the queue, then run them; True when told to
        stop."""
        jobs, self._held = self._held, []
        tokens = sum(job.tokens for _, job in jobs)
        incoming = [first] if first is not None else []
        self.running = len(jobs) + len(incoming)
        until = time.monotonic() + self._wait
        stopped = False
        request: Request | None
        while True:
            for request in incoming:
                job = self._prepare(request)
                if job is None:
                    continue  # answered already
                if self._held or (jobs and tokens + job.tokens > self._budget):
                    self._held.append((request, job))
                else:
                    jobs.append((request, job))
                    tokens += job.tokens
            if self._held or tokens >= self._budget:
                break
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                left = until - time.monotonic()
                if left <= 0 or not jobs or not self._could_send():
                    break
                try:
                    request = self.queue.get(timeout=left)
                except queue.Empty:
                    break
            if request is None:
                stopped = True
                break
            self.running += 1
            incoming = [request]
        if jobs:
            self._complete(jobs)
        return stopped


class GenerateLane(Lane):
    """The ``main`` lane of a worker serving a causal LM: the engine's loop runs in the main thread (continuous
    batching: every running generation advances one token per step), and a thread of its own reads each request
    (:meth:`~packcache.server.completions.CompletionApp.prepare`: the JSON, the chat template, the tokenizer) and
    hands it to the engine, so a long prompt never holds a step.

    ``pending`` counts the generations from their request's arrival to their last bytes; ``started`` is when the
    engine's current step began (the master's ``timeout`` bounds a step, not a generation, which may run for
    minutes).
    """

    def __init__(self, engine: Any, start: Callable[[Request], None]) -> None:
        self.engine = engine
        self.reader = Lane("prepare", start)  # its own thread
        super().__init__("main", lambda request: None, own_thread=False)

    def submit(self, request: Request) -> None:
        request.lane = self
        self.pending += 1
        self.reader.queue.put(request)

    @property
    def started(self) -> float | None:
        """Since when the engine's current step or the reading thread's request runs (the earlier)."""
        times = [t for t in (self.engine.busy_since(), self.reader.started) if t is not None]
        return min(times) if times else None

    @started.setter
    def started(self, value: float | None) -> None:
        pass  # :class:`Lane` sets it; here it is the engine's and the reader's

    def serve(self) -> None:
        """Run the engine's loop (the worker's main thread) until :meth:`stop`."""
        self.engine.run()

    def stop(self) -> None:
        self.reader.stop()
        self.engine.stop(drain=False)

    def cancel_all(self) -> None:
        """End every generation now (a shutdown past its grace): each answer ends with an error event."""
        self.engine.stop(drain=False)


# ---------------------------------------------------------------- the worker
