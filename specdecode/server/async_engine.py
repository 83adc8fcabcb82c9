"""Run a BatchEngine on a background thread and deliver each request's news to asyncio.

The engine is not thread-safe, so only its thread touches it: the event loop sends it
commands (add, abort, stop) through a thread-safe queue; the thread drains the queue
before every step, runs ``BatchEngine.step()`` while there is work (and blocks on the queue
when there is none), and hands each request's updates to its ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. Because aborts are drained before every step, a request whose
consumer goes away leaves the batch, and frees its cache row, before the next step runs.

A request the engine failed alone (its proposal, grammar or sampling raised: finish_reason "error") gets
its error update and the others go on. No request waits on a thread that is gone: a failing ``step()``
fails the requests in flight and the loop goes on; any other exception on the thread (its bookkeeping, the
queue) leaves the engine in an unknown state, so the thread fails every request in flight and every one not
yet queued, refuses new ones, and calls ``on_death(1)`` (the server exits non-zero there, so that a
supervisor restarts it).
The loop's heartbeat tells a step that hangs (``stalled``) from one that works.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.logprobs import TokenLogprob
from specdecode.engine.sequence import Sequence
from specdecode.metrics import SpecStats
from specdecode.model.openmp import release_thread_workers
from specdecode.server.metrics import ServerMetrics, snapshot

logger = logging.getLogger("specdecode.server")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or never started)."""


@dataclass
class Update:
    """News of one request after a step. ``text`` is new text safe to stream (never part of a stop string)."""

    text: str
    num_output: int
    """Output tokens generated so far (EOS and tokens completing a stop string included)."""
    prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    """``SpecStats.to_dict()`` of the request; set on the final update."""
    error: str | None = None
    """Set when the engine failed this request (the server turns it into a 500-style error)."""
    logprobs: list[TokenLogprob] | None = None
    """Logprobs of the tokens generated since the last update, when the request asks for them."""


class RequestStream:
    """Async iterator of one request's updates; ``close()`` aborts the request unless it finished."""

    def __init__(self, engine: AsyncEngine, seq: Sequence) -> None:
        self._engine = engine
        self.seq = seq
        self.request_id = seq.request_id
        self.prompt_tokens = seq.prompt_len
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self.done = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Update:
        if self.done:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.finished or update.error is not None:
            self.done = True
        return update

    def close(self) -> None:
        """Abort the request if it is still queued or running (idempotent, safe from any task)."""
        if not self.done and not self._closed:
            self._closed = True
            self._engine.abort(self.request_id)


@dataclass
class _Live:
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    t_admit: float
    last_output: int = 0
    spec: SpecStats | None = None
    first_token_seen: bool = False
    seen_step: int = field(default=-1)
    sent_logprobs: int = 0


_STOP = object()


class AsyncEngine:
    """Owner of a BatchEngine's thread. Start with ``start()``, end with ``stop()``.

    Args:
        stall_timeout_s: ``stalled`` turns true when one pass of the loop (a step with its bookkeeping) has
            run this long; None or 0: never.
        on_death: called on the engine thread with the exit code (1) after the loop failed outside
            ``step()`` and every request in flight got its error; None: the engine just stays dead.
    """

    def __init__(self, engine: BatchEngine, metrics: ServerMetrics | None = None, idle_poll_s: float = 1.0,
                 stall_timeout_s: float | None = None, on_death: Callable[[int], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.idle_poll_s = idle_poll_s
        self.stall_timeout_s = stall_timeout_s
        self.on_death = on_death
        pool = engine.prefix_cache
        self._pool_seen = (pool.queried_tokens, pool.hit_tokens) if pool is not None else (0, 0)
        """The prefix cache's counters already exported (the pool may predate this server)."""
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        """Orders ``add_group``'s check-and-queue against the thread closing: nothing is queued after it closed."""
        self._stopping = False
        self._closed = False
        self._idle = True
        self._beat = time.monotonic()
        """When the loop's current pass began (it has work then; ``_idle`` while it waits for work)."""
        self.died: str | None = None
        """Why the loop failed, when it did."""
        self._steps = 0

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        release_thread_workers()  # every forward runs on the engine thread from now on
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish; pending requests get an error update."""
        with self._lock:
            self._stopping = True
        if self._thread is not None:
            self._cmds.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not (self._stopping or self._closed)

    @property
    def busy_seconds(self) -> float:
        """How long the loop's current pass has run (0 while it waits for work)."""
        return 0.0 if self._idle or not self.alive else time.monotonic() - self._beat

    @property
    def stalled(self) -> bool:
        """True when a pass of the loop (a step) has run past ``stall_timeout_s``: requests wait, none advance."""
        limit = self.stall_timeout_s
        return limit is not None and limit > 0 and self.busy_seconds > limit

    # ---- event-loop side ---------------------------------------------------------------------------

    async def add(self, seq: Sequence, k_override: int | None = None) -> RequestStream:
        """Queue a request; raises QueueFullError (queue bound) or ValueError (can never fit) from the engine."""
        return (await self.add_group([seq], k_override))[0]

    async def add_group(self, seqs: list[Sequence], k_override: int | None = None) -> list[RequestStream]:
        """Queue requests together (the choices of one request: queued in one command, they are admitted in
        the same step and share their prompt's prefill); all or none are queued."""
        release_thread_workers()  # a request's set-up (its penalty counts) may have run a parallel region here
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[None] = loop.create_future()
        streams = [RequestStream(self, seq) for seq in seqs]
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"the engine is not running ({self.died})" if self.died
                                      else "the engine is not running")
            self._cmds.put(("add", seqs, k_override, streams, loop, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            for seq in seqs:  # the client left before admission: drop them if they got in
                self.abort(seq.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Drop a request before the engine's next step (thread-safe; unknown ids are ignored)."""
        self._cmds.put(("abort", request_id))

    # ---- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # outside step(): the engine's state is unknown, it cannot go on
            logger.exception("the engine loop failed; failing every request and stopping the engine")
            self.died = f"the engine failed: {type(exc).__name__}: {exc}"
            try:
                self._close(self.died)
            finally:
                if self.on_death is not None:
                    try:
                        self.on_death(1)
                    except Exception:
                        logger.exception("the engine's on_death hook failed")

    def _loop(self) -> None:
        while True:
            self._idle = not self.engine.has_work()
            cmds = self._take_commands(block=self._idle)
            self._beat = time.monotonic()
            self._idle = False
            for i, cmd in enumerate(cmds):
                if cmd is _STOP:
                    self._close("the server is shutting down", cmds[i + 1 :])
                    return
                self._handle(cmd)
            if self.engine.has_work():
                self._step()
            self._update_gauges()

    def _close(self, message: str, unread: list[Any] | None = None) -> None:
        """Refuse every command not yet handled and fail every request in flight, then take no more."""
        with self._lock:
            self._closed = True  # add_group queues nothing from now on
        for cmd in [*(unread or []), *self._take_commands(block=False)]:
            if cmd is not _STOP and cmd[0] == "add":
                self._call(cmd[4], _resolve, cmd[5], EngineDeadError(message))
        self._fail_all(message)
        try:
            self._update_gauges()
        except Exception:
            logger.exception("the metrics update failed")

    def _take_commands(self, block: bool) -> list[Any]:
        cmds: list[Any] = []
        if block:
            try:
                cmds.append(self._cmds.get(timeout=self.idle_poll_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "add":
            _, seqs, k_override, streams, loop, admitted = cmd
            added: list[Sequence] = []
            try:
                for seq in seqs:
                    self.engine.add(seq, k_override)
                    added.append(seq)
            except Exception as exc:  # QueueFullError / ValueError: the handler maps them to 429 / 400
                for seq in added:
                    self.engine.abort(seq.request_id)
                self._call(loop, _resolve, admitted, exc)
                return
            try:
                for seq, stream in zip(seqs, streams, strict=True):
                    self._live[seq.request_id] = _Live(stream, loop, time.perf_counter())
                    self.metrics.prompt_tokens.inc(seq.prompt_len)
            except BaseException:  # the loop dies of it: its caller must not wait for an admission
                self._call(loop, _resolve, admitted, EngineDeadError("the engine failed while queueing it"))
                raise
            self._call(loop, _resolve, admitted, None)
        elif cmd[0] == "abort":
            live = self._live.pop(cmd[1], None)
            if live is None:
                return  # finished already, or never admitted
            try:
                self.engine.abort(cmd[1])
            except Exception:
                logger.exception("abort of request %s failed", cmd[1])
            self._account(live.stream.seq, live)
            self.metrics.requests_finished.labels(finish_reason="abort").inc()

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            touched = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(f"internal error in the engine step: {type(exc).__name__}: {exc}")
            return
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self.metrics.engine_steps.inc()
        self._steps += 1
        for seq in touched:
            live = self._live.get(seq.request_id)
            if live is None or live.seen_step == self._steps:
                continue  # aborted, or listed twice (admitted and then stepped in the same step)
            live.seen_step = self._steps
            self._account(seq, live)
            text = seq.take_stream_text()
            if not (text or seq.finished):
                continue
            update = Update(text, seq.num_output, seq.prompt_len, seq.finished, seq.finish_reason, error=seq.error)
            if seq.logprobs is not None:
                update.logprobs = seq.logprobs[live.sent_logprobs :]
                live.sent_logprobs = len(seq.logprobs)
            if seq.finished:
                del self._live[seq.request_id]
                update.stats = seq.stats.to_dict()
                self.metrics.requests_finished.labels(finish_reason=seq.finish_reason or "stop").inc()
                self.metrics.request_latency.observe(time.perf_counter() - live.t_admit)
            if not self._call(live.loop, live.stream._queue.put_nowait, update) and not seq.finished:
                self._handle(("abort", seq.request_id))  # its event loop is gone: nobody will read it

    def _account(self, seq: Sequence, live: _Live) -> None:
        """Add the request's new tokens and speculative counters since the last look to the metrics."""
        new = seq.num_output - live.last_output
        if new > 0:
            self.metrics.generation_tokens.inc(new)
            live.last_output = seq.num_output
            if not live.first_token_seen:
                live.first_token_seen = True
                self.metrics.time_to_first_token.observe(time.perf_counter() - live.t_admit)
        self.metrics.observe_spec_delta(live.spec, seq.stats)
        live.spec = snapshot(seq.stats)

    def _fail_all(self, message: str) -> None:
        """Send every request in flight its error, whatever else fails on the way."""
        for rid, live in list(self._live.items()):
            seq = live.stream.seq
            try:
                update = Update("", seq.num_output, seq.prompt_len, True, None, error=message)
            except Exception:  # a broken sequence still gets its error
                update = Update("", 0, 0, True, None, error=message)
            self._call(live.loop, live.stream._queue.put_nowait, update)
            try:
                self.metrics.requests_finished.labels(finish_reason="error").inc()
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of request %s failed", rid)
        self._live.clear()
        # Whatever state the failed step left behind, start clean: no row or queue entry survives.
        try:
            self.engine.running.clear()
            self.engine.prefilling = None
            self.engine.waiting.clear()
            self.engine.cache.reset()
        except Exception:  # pragma: no cover
            logger.exception("engine reset failed")

    def _update_gauges(self) -> None:
        m = self.metrics
        m.requests_running.set(len(self.engine.running) + (self.engine.prefilling is not None))
        m.requests_waiting.set(len(self.engine.waiting))
        pool = self.engine.prefix_cache
        if pool is not None:
            ServerMetrics._inc(m.prefix_cache_queries, pool.queried_tokens - self._pool_seen[0])
            ServerMetrics._inc(m.prefix_cache_hits, pool.hit_tokens - self._pool_seen[1])
            self._pool_seen = (pool.queried_tokens, pool.hit_tokens)
            m.prefix_cache_hit_rate.set(pool.hit_rate)
            m.prefix_cache_usage.set(pool.bytes_used / pool.max_bytes if pool.max_bytes else 0.0)
        m.kv_cache_usage.set(self.engine.kv_usage)
        store = self.engine.lookup.store if self.engine.lookup is not None else None
        if store is not None:
            m.suffix_cache_tokens.set(store.tokens)
            m.suffix_cache_max_tokens.set(store.max_tokens)
            m.suffix_cache_bytes.set(store.approx_bytes)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed
            return False


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
