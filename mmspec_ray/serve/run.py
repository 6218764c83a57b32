"""One request's decoding on the replica's decode thread, handed step by step to the event loop.

The decode thread runs `SpecDecoder.stream` and puts each step's tokens on an asyncio queue; the event loop sends
them. `cancel()` (client gone) makes the thread stop after the step it is in and close the engine's generator.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from dataclasses import dataclass

from mmspec_ray.decoding.output import Generation


@dataclass(frozen=True)
class Step:
    """What the decode thread reports: tokens of one step, the final Generation, or an exception."""

    tokens: list[int] | None = None
    generation: Generation | None = None
    error: BaseException | None = None
    at: float = 0.0  # perf_counter when the step was committed


class DecodeRun:
    """Drives one engine generator on `executor` (one thread: batch-size-1 decoding) and queues its steps."""

    def __init__(self, start: Callable[[], Generator[list[int], None, Generation]], executor: Executor,
                 on_step: Callable[[list[int]], None] | None = None, every_step: bool = True) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Step] = asyncio.Queue()
        self._cancel = threading.Event()
        self._on_step = on_step
        self._every_step = every_step  # False: queue only the end (or an error): no per-step wake-ups
        self.first_at: float | None = None  # perf_counter of the first committed token (set by the thread)
        self.cancelled = False  # True when the thread stopped early because of cancel()
        self.queued_s = 0.0  # how long the request waited for the decoder (set by the server)
        self.read_s = 0.0  # how long reading the request body took (set by the server)
        self._head: Step | None = None  # a step looked at by peek() and not yet consumed
        self.future = self.loop.run_in_executor(executor, self._produce, start)

    def cancel(self) -> None:
        """Stop decoding after the current step (safe to call at any time, more than once)."""
        self._cancel.set()

    async def next(self) -> Step:
        """The next step, in order."""
        if self._head is not None:
            step, self._head = self._head, None
            return step
        return await self.queue.get()

    async def peek(self) -> Step:
        """The next step, left in place for next()."""
        if self._head is None:
            self._head = await self.queue.get()
        return self._head

    def _put(self, step: Step) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, step)

    def _produce(self, start: Callable[[], Generator[list[int], None, Generation]]) -> None:
        try:
            steps = start()
            while True:
                if self._cancel.is_set():
                    steps.close()
                    self.cancelled = True
                    return
                try:
                    tokens = next(steps)
                except StopIteration as done:
                    self._put(Step(generation=done.value, at=time.perf_counter()))
                    return
                now = time.perf_counter()
                self.first_at = self.first_at or now
                if self._on_step is not None:
                    self._on_step(tokens)
                if self._every_step:
                    self._put(Step(tokens=tokens, at=now))
        except BaseException as e:  # reported to the request; the replica keeps serving
            self._put(Step(error=e, at=time.perf_counter()))


async def drain(run: DecodeRun) -> Generation:
    """Wait for the whole answer. Raises the thread's exception."""
    while True:
        step = await run.next()
        if step.error is not None:
            raise step.error
        if step.generation is not None:
            return step.generation
