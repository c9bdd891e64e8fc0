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
``kv_pruned`` (evicted tokens). A request that speculated also gets ``devin.spec.{proposer,
drafted_tokens, accepted_tokens, acceptance_rate}`` (summed over its choices).

Engine steps (``trace_steps=True``, ``devin-compile serve --trace-steps``): every engine step a
request took part in becomes a span ``devin.engine.step`` (kind INTERNAL), a *child of that
request's span*, with ``devin.step.{index, batch_size, prefill_tokens, decode_tokens,
drafted_tokens, accepted_tokens}`` (the whole batch's) and ``devin.step.request_tokens`` (this
request's). Why children and not one span per step linked to the request spans (the
OpenTelemetry pattern for batch work): a user opens one request's trace and expects its
timeline (queue, prefill chunks, decode steps, their batch sizes) in that trace's waterfall;
links are shown by few backends, and one span per step would start a trace of its own per step.
The price is one span per request per step (a batch of 16 makes 16 spans a step), hence off
by default: then the engine has no step hook and builds nothing.

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
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
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


def make_tracing(trace_file: str | None = None, service_name: str = "devin-compile",
                 trace_steps: bool = False) -> "Tracing | None":
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
    return Tracing(provider, trace_steps=trace_steps)


class Tracing:
    def __init__(self, provider: TracerProvider, trace_steps: bool = False) -> None:
        self.provider = provider
        self.trace_steps = trace_steps
        self._watched: dict[str, object] = {}  # engine request id → its API request's span (trace_steps)
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

    # -- engine steps (trace_steps) --------------------------------------------------------
    def watch(self, span, request_ids) -> None:
        """Steps running these engine requests get child spans of ``span`` (until :meth:`unwatch`)."""
        for rid in request_ids:
            self._watched[rid] = span

    def unwatch(self, request_ids) -> None:
        for rid in request_ids:
            self._watched.pop(rid, None)

    def on_step(self, info) -> None:
        """A step hook (engine thread): one ``devin.engine.step`` span under each watched request's span."""
        watched = self._watched
        if not watched:
            return
        batch = {"devin.step.index": info.index, "devin.step.batch_size": info.batch_size,
                 "devin.step.prefill_tokens": info.prefill_tokens, "devin.step.decode_tokens": info.decode_tokens,
                 "devin.step.drafted_tokens": info.drafted_tokens,
                 "devin.step.accepted_tokens": info.accepted_tokens}
        start, end = self._ns(info.start), self._ns(info.end)
        for rid, tokens in zip(info.request_ids, info.request_tokens):
            parent = watched.get(rid)
            if parent is None:
                continue
            span = self.tracer.start_span("devin.engine.step", context=set_span_in_context(parent),
                                          kind=SpanKind.INTERNAL, start_time=start,
                                          attributes={**batch, "devin.step.request_tokens": tokens,
                                                      "devin.request.id": rid})
            span.end(end_time=end)

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
        self._spec_attributes(span, gen)
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

    @staticmethod
    def _spec_attributes(span, gen) -> None:
        specs = [m.spec for c in gen.choices if (m := getattr(c.output, "metrics", None)) is not None
                 and m.spec is not None]
        if not specs:
            return
        drafted, accepted = sum(s.drafted for s in specs), sum(s.accepted for s in specs)
        span.set_attribute("devin.spec.proposer", specs[0].proposer)
        span.set_attribute("devin.spec.drafted_tokens", drafted)
        span.set_attribute("devin.spec.accepted_tokens", accepted)
        span.set_attribute("devin.spec.acceptance_rate", accepted / drafted if drafted else 0.0)

    def shutdown(self) -> None:
        self.provider.shutdown()

