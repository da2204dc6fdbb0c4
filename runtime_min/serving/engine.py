"""The engine of `dsneuron serve`: the scheduler and the one thread that steps it, its Prometheus
metrics, and the followers of a sharded bundle's other ranks.

The HTTP routes (runtime_min/serving/server.py) only submit and cancel requests here and read their outputs
through a listener; every change of the scheduler happens on the engine thread between two steps,
in the order of the events. This module and prometheus_client are loaded by the `serve` command
only (and by tests that drive an engine without HTTP).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dsneuron import UserError

from ..core.prefix_cache import PrefixCache
from ..core.scheduler import QueueFull, Request, RequestError, Scheduler
from ..executors.executor_cpu import release_openmp_threads
from ..session import Session

log = logging.getLogger("dsneuron.serve")

#: seconds of the grace period kept for the step in flight, the closing streams and the shutdown
SHUTDOWN_S = 2.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)


class Closed(UserError):
    """The server is shutting down and admits no new request (503)."""


class Metrics:
    """The Prometheus metrics of one server, in a registry of its own."""

    def __init__(self, scheduler: Scheduler):
        r = self.registry = CollectorRegistry()
        cache = scheduler.prefix_cache
        if cache is not None:  # named as vLLM's prefix-cache metrics (vllm:prefix_cache_queries, _hits)
            _PrefixCacheCollector(cache, r)
        if scheduler.speculation is not None:
            _SpeculationCollector(scheduler.speculation, r)
        Gauge("dsneuron_num_requests_waiting", "Requests in the queue, not yet admitted to a row",
              registry=r).set_function(lambda: scheduler.waiting)
        Gauge("dsneuron_num_requests_running", "Requests decoding in a row of the batch buckets",
              registry=r).set_function(lambda: scheduler.running)
        self.prompt_tokens = Counter("dsneuron_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dsneuron_generation_tokens", "Tokens sampled (EOS included)", registry=r)
        self.finished = Counter("dsneuron_request_finished", "Requests ended, by finish_reason", ["finished_reason"],
                                registry=r)
        self.rejected = Counter("dsneuron_request_rejected", "Requests refused, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("dsneuron_time_to_first_token_seconds", "From arrival to the first token (queue wait "
                              "and prefill)", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dsneuron_inter_token_latency_seconds", "Between two tokens of one request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dsneuron_e2e_request_latency_seconds", "From arrival to the end of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)


class _SpeculationCollector:
    """Speculative decoding's counts (runtime_min/core/speculative.py AcceptanceCounts) read at each
    scrape, as vLLM's spec-decode metrics count them (vllm:spec_decode_num_drafts,
    _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos): the acceptance length
    (tokens a verify step emitted: 1 + the drafts kept) as a histogram with one bucket per length,
    and per draft position how often it was offered and kept."""

    def __init__(self, speculation, registry: CollectorRegistry):
        self.speculation = speculation
        registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        c = self.speculation.counts
        lengths = c.lengths + [0] * (self.speculation.k + 2 - len(c.lengths))
        cumulative, buckets = 0, []
        for L in range(1, len(lengths)):
            cumulative += lengths[L]
            buckets.append((str(float(L)), cumulative))
        buckets.append(("+Inf", cumulative))
        yield HistogramMetricFamily("dsneuron_spec_decode_acceptance_length", "Tokens one verify step emitted for one "
                                    "request: 1 + the drafts kept", buckets=buckets,
                                    sum_value=sum(L * n for L, n in enumerate(lengths)))
        offered = CounterMetricFamily("dsneuron_spec_decode_draft_tokens", "Draft tokens offered to a verify, by "
                                      "position in the block", labels=["position"])
        kept = CounterMetricFamily("dsneuron_spec_decode_accepted_tokens", "Draft tokens kept by a verify, by position "
                                   "in the block", labels=["position"])
        for j in range(self.speculation.k):
            offered.add_metric([str(j)], c.offered[j] if j < len(c.offered) else 0)
            kept.add_metric([str(j)], c.kept[j] if j < len(c.kept) else 0)
        yield offered
        yield kept


class _PrefixCacheCollector:
    """The prefix cache's counters (runtime_min/core/prefix_cache.py PrefixCache.stats) read at each
    scrape: lookups and hits (vLLM counts queries and hits in tokens; here a lookup is one request's
    prompt), the prompt tokens the hits did not prefill, the bytes and entries held, evictions."""

    def __init__(self, cache: PrefixCache, registry: CollectorRegistry):
        self.cache = cache
        registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.cache.stats()
        yield CounterMetricFamily("dsneuron_prefix_cache_queries", "Prompts looked up in the prefix cache",
                                  value=st["hits"] + st["misses"])
        yield CounterMetricFamily("dsneuron_prefix_cache_hits", "Prompts that started from a cached prefix",
                                  value=st["hits"])
        yield CounterMetricFamily("dsneuron_prefix_cache_misses", "Prompts with no cached prefix", value=st["misses"])
        yield CounterMetricFamily("dsneuron_prefix_cache_hit_tokens", "Prompt tokens not prefilled: the cached "
                                  "prefixes' lengths, summed over the hits", value=st["tokens_saved"])
        yield CounterMetricFamily("dsneuron_prefix_cache_evictions", "Snapshots evicted (least recently used)",
                                  value=st["evictions"])
        yield GaugeMetricFamily("dsneuron_prefix_cache_bytes", "Bytes of the snapshots held", value=st["bytes"])
        yield GaugeMetricFamily("dsneuron_prefix_cache_max_bytes", "The budget (--prefix-cache-gib)",
                                value=self.cache.max_bytes)
        yield GaugeMetricFamily("dsneuron_prefix_cache_entries", "Snapshots held", value=st["entries"])


class Engine:
    """The scheduler and the one thread that steps it.

    Every change of the scheduler happens on that thread between two steps: `submit`, `cancel`
    and the end of the grace period only queue an event, which the thread applies before its next
    step. So the steps are a function of the ordered events, which is what lets the ranks of a
    sharded bundle follow rank 0 (`channel`: rank 0 sends each step's events to the others,
    `follow`)."""

    def __init__(self, session: Session, max_queue: int, channel: "Channel | None" = None,
                 prefix_cache_bytes: int = 0, speculation=None):
        # the engine bounds the queue: waiting + events not yet applied. No prefix cache for the
        # ranks of a sharded bundle: each rank's cache would have to evict exactly as rank 0's
        cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and channel is None else None
        self.scheduler = session.scheduler(prefix_cache=cache, speculation=speculation)
        self.session = session
        self.max_queue = max_queue
        self.metrics = Metrics(self.scheduler)
        self.draining = False
        self._channel = channel
        self._lock = threading.Lock()
        self._events: list[tuple] = []
        self._submitted = 0  # submit events in _events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsneuron-engine", daemon=True)
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens counted, perf_counter of the last)

    @property
    def sharded(self) -> bool:
        """Whether the other ranks of a sharded bundle follow this engine's steps."""
        return self._channel is not None

    def start(self) -> None:
        """Start the engine thread; call it on the thread that loaded the session, whose OpenMP
        pool it frees first (executors/executor_cpu.py `release_openmp_threads` says why)."""
        release_openmp_threads()
        self._thread.start()

    def submit(self, reqs: list[Request]) -> None:
        """Queue the requests of one HTTP request for the next step, all or none. Raises
        RequestError (Scheduler.check; more prompts than max_queue), QueueFull when they do not
        fit (max_queue waiting requests beyond the rows free now), Closed while shutting down."""
        if len(reqs) > self.max_queue:
            raise RequestError(f"{len(reqs)} prompts in one request; this server queues at most {self.max_queue} "
                               "(--max-queue)", "prompt")
        for r in reqs:
            self.scheduler.check(r)
        with self._lock:
            if self.draining or self._stop.is_set():
                raise Closed("the server is shutting down and admits no new request")
            free_rows = self.scheduler.max_rows - self.scheduler.running
            if self.scheduler.waiting + self._submitted + len(reqs) > self.max_queue + max(0, free_rows):
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting for a row, --max-queue); "
                                "retry later")
            self._events.extend(("submit", r) for r in reqs)
            self._submitted += len(reqs)
        self.scheduler.wake.set()

    def cancel(self, r: Request) -> None:
        """End `r` at the next step ("abort")."""
        self._event(("cancel", r))

    def drain(self, grace: float) -> None:
        """Stop admitting; end whatever still runs SHUTDOWN_S (or half the grace, if shorter)
        before `grace` seconds are over, so the last step and the shutdown fit in it too."""
        with self._lock:
            if self.draining:
                return
            self.draining = True
        timer = threading.Timer(max(0.0, grace - min(SHUTDOWN_S, grace / 2)), self._event, [("cancel_all",)])
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """End every request, then the engine thread (and the followers of a sharded bundle)."""
        self._event(("cancel_all",))
        self._stop.set()
        self._thread.join(timeout=120)

    def _event(self, ev: tuple) -> None:
        with self._lock:
            self._events.append(ev)
        self.scheduler.wake.set()

    def _loop(self) -> None:
        s = self.scheduler
        idle_since = time.monotonic()
        while True:
            with self._lock:
                events, self._events, self._submitted = self._events, [], 0
            stopping = self._stop.is_set()
            if not events and not s.busy and not stopping:
                s.wake.wait(0.1)
                if self._channel is not None and time.monotonic() - idle_since > HEARTBEAT_S:
                    self._channel.send([])  # else the followers' collective would time out
                    idle_since = time.monotonic()
                continue
            if self._channel is not None:
                self._channel.send([_wire(ev) for ev in events], stop=stopping and not s.busy)
            apply(s, events)
            if stopping and not s.busy:
                return
            if s.busy:
                try:
                    s.step()
                except Exception:  # the step's requests have ended with "error"; the others go on
                    log.exception("a scheduler step failed")
            idle_since = time.monotonic()

    def listener(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> Callable[[Request, str], None]:
        """A Request listener (engine thread) that records metrics and puts (index, piece,
        finish_reason) on `queue` in `loop`: the reason as it is at that call (None until the last
        call), so a reader sees every piece before the end even when the request ended long ago."""
        m = self.metrics

        def on_output(r: Request, piece: str) -> None:
            now = time.perf_counter()
            count, last = self._seen.get(r.id, (0, None))
            if r.sampled > count:
                m.generation_tokens.inc(r.sampled - count)
                if last is None:
                    m.ttft.observe(r.first_token_at - r.arrival)
                else:
                    m.itl.observe(now - last)
                self._seen[r.id] = (r.sampled, now)
            if r.finished:
                self._seen.pop(r.id, None)
                m.finished.labels(r.finish_reason).inc()
                m.e2e.observe(r.finished_at - r.arrival)
            loop.call_soon_threadsafe(queue.put_nowait, (index, piece, r.finish_reason))

        return on_output


def apply(s: Scheduler, events: list[tuple]) -> None:
    """Apply engine events to a scheduler: ("submit", Request), ("cancel", Request), ("cancel_all",)."""
    for ev in events:
        if ev[0] == "submit":
            s.submit(ev[1], checked=True)  # Engine.submit checked it on rank 0, before queueing
        elif ev[0] == "cancel":
            s.cancel(ev[1])
        else:
            s.cancel_all()


#: seconds an idle rank 0 waits before telling the followers it is still there
HEARTBEAT_S = 60.0


def _wire(ev: tuple) -> tuple:
    """An event as plain data for the other ranks (Requests become their fields)."""
    if ev[0] == "submit":
        r = ev[1]
        return ("submit", {"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens, "temperature": r.temperature,
                           "top_p": r.top_p, "seed": r.seed, "stop": list(r.stop), "id": r.id})
    if ev[0] == "cancel":
        return ("cancel", ev[1].id)
    return ev


class Channel:
    """Rank 0's engine events to the other ranks of a sharded bundle (torch.distributed broadcast
    from rank 0, over the process group runtime_min/sharded.py set up)."""

    def send(self, events: list[tuple], stop: bool = False) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([{"events": events, "stop": stop}], src=0)

    def recv(self) -> dict:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def follow(session: Session, channel: Channel) -> None:
    """A rank other than 0 of a sharded bundle: apply rank 0's events, then step whenever requests
    wait or run, as rank 0 does after the same events (so the executables' collectives meet),
    until rank 0 says stop. The seeds come from rank 0 and the logits are gathered, so every rank
    samples the same tokens and its scheduler stays rank 0's."""
    s = session.scheduler()
    live: dict[str, Request] = {}
    while True:
        msg = channel.recv()
        events = []
        for ev in msg["events"]:
            if ev[0] == "submit":
                r = live[ev[1]["id"]] = Request(**ev[1])
                events.append(("submit", r))
            elif ev[0] == "cancel":
                if ev[1] in live:
                    events.append(("cancel", live[ev[1]]))
            else:
                events.append(ev)
        apply(s, events)
        if msg["stop"]:
            return
        if s.busy:
            try:
                s.step()
            except Exception:
                log.exception("a scheduler step failed")
        for rid in [rid for rid, r in live.items() if r.finished]:
            del live[rid]
