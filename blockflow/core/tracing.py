"""OpenTelemetry traces of requests across BlockFlow's processes (README, "Traces").

Off unless ``BLOCKFLOW_OTLP_ENDPOINT`` is set. Then:

- the dispatcher decides per request whether it is traced: as the client's W3C ``traceparent``
  says when it sends one (its sampled flag), else with probability ``BLOCKFLOW_TRACE_RATIO``;
- for a traced request it records the root span (arrival to answer, parented to the client's span)
  and the data header carries that span's context to every block on the path (``DataHeader.trace``,
  a traceparent string);
- each block records one span per traced request from the clock readings its KPI record holds (the
  arrival's wall-clock time and the stage durations, as attributes), so a trace and ``/metrics``
  agree; a batching block records one span per request of the batch, each with the batch's size.

A request that is not traced carries no context and costs a block one ``is None`` test. With the
endpoint unset no process imports this module's OpenTelemetry side (``tracer_for`` returns None
before importing anything), and nothing is recorded. Each process exports its spans itself, on the
SDK's BatchSpanProcessor thread, over OTLP/HTTP (protobuf).
"""
from __future__ import annotations

import logging
import random
import re
import time

from blockflow.core import settings

log = logging.getLogger("blockflow.tracing")

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
#: Length of a version-00 traceparent: what the data header allows in ``trace``.
TRACEPARENT_LENGTH = 55


def parse_traceparent(value) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C version-00 ``traceparent``, or None for
    anything else (a malformed header starts a trace of our own; it never fails a request)."""
    if not isinstance(value, str) or len(value) != TRACEPARENT_LENGTH:
        return None
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return None
    trace_id, span_id = int(m[1], 16), int(m[2], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(int(m[3], 16) & 1)


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class Tracer:
    """One process's span recorder and exporter."""

    def __init__(self, service: str, endpoint: str, ratio: float, export_delay_s: float, **resource):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self._api = trace
        self._SpanContext, self._NonRecordingSpan, self._TraceFlags = SpanContext, NonRecordingSpan, TraceFlags
        self._Status, self._ERROR, self._SpanKind = Status, StatusCode.ERROR, SpanKind
        self.ratio = ratio
        self._draw = random.Random().random
        # the decision is ours (sample); every span started here is recorded
        self.provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}),
                                       sampler=ALWAYS_ON)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                            schedule_delay_millis=export_delay_s * 1e3))
        self.tracer = self.provider.get_tracer("blockflow")

    def _context(self, trace_id: int, span_id: int):
        parent = self._SpanContext(trace_id, span_id, is_remote=True, trace_flags=self._TraceFlags(1))
        return self._api.set_span_in_context(self._NonRecordingSpan(parent))

    def start_request(self, client_traceparent, task: str, rid: int):
        """The root span of a request the dispatcher accepted, and the traceparent the blocks get,
        or (None, None) when the request is not traced."""
        parent = parse_traceparent(client_traceparent)
        if parent is not None:
            if not parent[2]:
                return None, None
            context = self._context(parent[0], parent[1])
        elif self._draw() < self.ratio:
            context = None
        else:
            return None, None
        span = self.tracer.start_span("blockflow request", context=context, kind=self._SpanKind.SERVER,
                                      attributes={"blockflow.task": task, "blockflow.rid": str(rid)})
        ctx = span.get_span_context()
        return span, traceparent(ctx.trace_id, ctx.span_id)

    def end_request(self, span, status: str, code: str | None = None, error: str | None = None) -> None:
        span.set_attribute("blockflow.status", status)
        if code is not None:
            span.set_attribute("blockflow.code", code)
            span.set_status(self._Status(self._ERROR, error or code))
        span.end()

    def record_hop(self, parent: str, name: str, start_wall_s: float, total_ms: float, attributes: dict,
                   error: str | None = None) -> None:
        """A block's span of one request: from its arrival (wall clock, the KPI record's ``ts``)
        for ``total_ms``, a child of the span named by the header's traceparent."""
        ids = parse_traceparent(parent)
        if ids is None:
            return
        start = int(start_wall_s * 1e9)
        span = self.tracer.start_span(f"block {name}", context=self._context(ids[0], ids[1]),
                                      kind=self._SpanKind.INTERNAL, start_time=start, attributes=attributes)
        if error is not None:
            span.set_status(self._Status(self._ERROR, error))
        span.end(end_time=start + int(total_ms * 1e6))

    def flush(self) -> None:
        """Export the finished spans now (a block's shutdown step, before its process exits)."""
        if not self.provider.force_flush(timeout_millis=5000):
            log.warning("tracing: spans not exported within 5 s of shutting down")

    def shutdown(self) -> None:
        """Export what is left (bounded by the exporter's own timeout) and stop its thread."""
        try:
            self.provider.shutdown()
        except Exception as exc:  # a collector that went away must not block a clean exit
            log.warning("tracing: could not export the last spans: %s", exc)


def tracer_for(service: str, **resource) -> Tracer | None:
    """This process's tracer, or None when tracing is off (nothing imported then)."""
    if not settings.OTLP_ENDPOINT:
        return None
    started = time.monotonic()
    tracer = Tracer(service, settings.OTLP_ENDPOINT, settings.TRACE_RATIO, settings.TRACE_EXPORT_DELAY, **resource)
    log.info("tracing to %s (ratio %g; set up in %.0f ms)", settings.OTLP_ENDPOINT, settings.TRACE_RATIO,
             (time.monotonic() - started) * 1e3)
    return tracer
