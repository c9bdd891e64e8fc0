"""OpenTelemetry traces: one span per API request, with GenAI semantic-convention attributes.

The span (kind SERVER, named ``"{operation} {model}"``, e.g. ``"chat smollm2"``) is the child
of the client's W3C ``traceparent`` header when one is sent. Attributes:
``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.{model, max_tokens,
temperature, top_p, top_k, seed, stop_sequences, choice.count, stream}``,
``gen_ai.response.{id, model, finish_reasons}``, ``gen_ai.usage.{input,output}_tokens``,
``http.response.status_code``. Events mark each choice's life in the engine: ``scheduled``
(left the queue; prefill begins), ``first_token`` (prefill done; decode begins), ``finished``,
and, when they happened, ``prefix_cache_hit`` (tokens), ``kv_tier_hit`` (tokens loaded from the KV
cache tiers), ``preempted`` (times) and
``kv_pruned`` (evicted tokens).

Off unless asked for (:func:`make_tracing` returns None, and the server then makes no
OpenTelemetry call): ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
export by OTLP over HTTP (the standard ``OTEL_*`` variables configure it), ``trace_file``
writes one JSON span per line. Tests pass their own ``TracerProvider``.
"""
from __future__ import annotations

import json
import os
import threading
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class JsonLinesExporter(SpanExporter):
    """Spans as JSON lines appended to ``path`` (``ReadableSpan.to_json`` on one line)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        open(path, "a").close()  # fail now (OSError) rather than at the first export

    def export(self, spans) -> SpanExportResult:
        with self._lock, open(self.path, "a") as f:
            for s in spans:
                f.write(json.dumps(json.loads(s.to_json(indent=None))) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def make_tracing(trace_file: str | None = None, service_name: str = "devin-compile") -> "Tracing | None":
    """A :class:`Tracing` exporting by OTLP (when an ``OTEL_EXPORTER_OTLP_*`` endpoint is set) and/or
    to ``trace_file``; None when neither is asked for."""
    otlp = any(os.environ.get(v) for v in OTLP_VARIABLES)
    if not otlp and trace_file is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file is not None:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(trace_file)))
    return Tracing(provider)


class Tracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("devin_compile.serve")
        self.propagator = TraceContextTextMapPropagator()
        # engine times are perf_counter seconds; spans want epoch nanoseconds
        self._epoch_offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def _ns(self, perf: float) -> int:
        return self._epoch_offset_ns + int(perf * 1e9)

    def start(self, headers, req, chat: bool, model: str, received: float):
        op = "chat" if chat else "text_completion"
        attrs = {
            "gen_ai.operation.name": op, "gen_ai.provider.name": "devin_compile", "gen_ai.request.model": req.model,
            "gen_ai.request.temperature": req.temperature, "gen_ai.request.top_p": req.top_p,
            "gen_ai.request.choice.count": req.n, "gen_ai.request.stream": req.stream,
        }
        if req.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = req.max_tokens
        if req.seed is not None:
            attrs["gen_ai.request.seed"] = req.seed
        if req.top_k:
            attrs["gen_ai.request.top_k"] = req.top_k
        if req.stop:
            attrs["gen_ai.request.stop_sequences"] = list(req.stop)
        parent = self.propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        return self.tracer.start_span(f"{op} {model}", context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                      start_time=self._ns(received))

    def finish(self, span, gen, status: int, model: str, error: str | None = None) -> None:
        """End ``span`` with the request's outcome (``gen`` None: refused before it ran)."""
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        if gen is None:
            span.end()
            return
        usage = gen.usage()
        span.set_attribute("gen_ai.response.id", gen.request_id)
        span.set_attribute("gen_ai.response.model", model)
        span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
        span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
        span.set_attribute("gen_ai.response.finish_reasons", [c.finish_reason or "abort" for c in gen.choices])
        for c in gen.choices:
            m = getattr(c.output, "metrics", None)
            if m is None:
                continue
            who = {"gen_ai.choice.index": c.index}
            if m.first_scheduled is not None:
                span.add_event("scheduled", who, timestamp=self._ns(m.first_scheduled))
            if m.prefix_hit_tokens:
                span.add_event("prefix_cache_hit", {**who, "tokens": m.prefix_hit_tokens},
                               timestamp=self._ns(m.first_scheduled or m.arrival))
            if m.tier_hit_tokens:
                span.add_event("kv_tier_hit", {**who, "tokens": m.tier_hit_tokens},
                               timestamp=self._ns(m.first_scheduled or m.arrival))
            if m.first_token is not None:
                span.add_event("first_token", who, timestamp=self._ns(m.first_token))
            if m.preemptions:
                span.add_event("preempted", {**who, "times": m.preemptions})
            if m.kv_evicted_tokens:
                span.add_event("kv_pruned", {**who, "evicted_tokens": m.kv_evicted_tokens,
                                             "freed_blocks": m.kv_freed_blocks})
            if m.finished is not None:
                span.add_event("finished", {**who, "finish_reason": c.finish_reason or "abort"},
                               timestamp=self._ns(m.finished))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()

