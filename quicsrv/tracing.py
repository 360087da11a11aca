"""Optional OpenTelemetry spans, one tree per generation: off unless someone asks for them.

Tracing is on when the ``opentelemetry`` packages are installed (``pip install 'quicsrv[otel]'``)
*and* a tracer provider with an exporter is set: by ``quicsrv serve --otel-exporter console|otlp``
(:func:`configure_exporter`), by the embedding application, or by a test handing its own tracer
to :class:`quicsrv.metrics.ServerMetrics`. Otherwise :func:`configured_tracer` returns None and a
generation costs no tracing work at all.

A session object's life is one ``generation`` span (attributes ``quicsrv.session_id``,
``quicsrv.resumed``) with children, each a phase: ``queue`` (waiting for an engine slot),
``prefill`` (submitted until the first token), ``decode`` (tokens flowing), ``pause`` (the engine
sequence left the batch: flow control, or the reader went away) and ``resume`` (until the engine
has the KV cells back; attribute ``quicsrv.resume_path``).
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

__all__ = ["GenerationSpans", "OtelExporter", "configure_exporter", "configured_tracer"]

_otel_trace: Any
try:  # an optional dependency: the `otel` extra
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    _otel_trace = None


class OtelExporter(StrEnum):
    NONE = "none"
    CONSOLE = "console"  # spans printed to stdout
    OTLP = "otlp"  # to the endpoint of the standard OTEL_EXPORTER_OTLP_* variables


EXPORTERS = tuple(e.value for e in OtelExporter)


def configured_tracer() -> Any | None:
    """quicsrv's tracer, or None unless opentelemetry is installed and a real (SDK) tracer
    provider has been set: the API's default provider records nothing, so spans would be
    wasted work."""
    if _otel_trace is None:
        return None
    provider = _otel_trace.get_tracer_provider()
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None
    return provider.get_tracer("quicsrv")


def configure_exporter(exporter: str) -> None:
    """Install an SDK tracer provider exporting to ``exporter`` ("console": stdout; "otlp":
    the OTLP endpoint from the standard ``OTEL_EXPORTER_OTLP_*`` variables; "none": nothing).

    Raises ValueError when the packages it needs are missing, so ``serve`` fails at start-up
    instead of silently tracing nothing.
    """
    if exporter == "none":
        return
    if exporter not in EXPORTERS:
        raise ValueError(f"otel_exporter must be one of {', '.join(EXPORTERS)}, not {exporter!r}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise ValueError(
            "otel_exporter needs the opentelemetry SDK: pip install 'quicsrv[otel]'"
        ) from None
    span_exporter: Any
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "otel_exporter = otlp needs opentelemetry-exporter-otlp-proto-http"
            ) from None
        span_exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "quicsrv"}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    assert _otel_trace is not None  # the SDK imported, so the API is there
    _otel_trace.set_tracer_provider(provider)


class GenerationSpans:
    """One session object's span tree (see the module docstring). At most one phase is open
    at a time; opening the next ends the current one. Times are given as ``time.monotonic``
    readings (the event loop's clock) and converted to the wall clock spans carry."""

    def __init__(self, tracer: Any, session_id: str, *, resumed: bool) -> None:
        assert _otel_trace is not None
        self._tracer = tracer
        self._root = tracer.start_span(
            "generation",
            attributes={"quicsrv.session_id": session_id, "quicsrv.resumed": resumed},
        )
        self._context = _otel_trace.set_span_in_context(self._root)
        self._phase: Any | None = None
        self._phase_name = ""

    @property
    def phase(self) -> str:
        """The open phase's name ("" when none)."""
        return self._phase_name

    def begin(self, name: str, since: float | None = None, **attributes: Any) -> None:
        """End the open phase (at ``since``, else now) and open ``name`` from then on."""
        start_ns = _wall_ns(since)
        self._end_phase(start_ns)
        self._phase = self._tracer.start_span(
            name,
            context=self._context,
            start_time=start_ns,
            attributes={f"quicsrv.{k}": v for k, v in attributes.items()},
        )
        self._phase_name = name

    def annotate(self, **attributes: Any) -> None:
        """Attributes of the open phase learnt while it runs (a resume's path)."""
        if self._phase is not None:
            for key, value in attributes.items():
                self._phase.set_attribute(f"quicsrv.{key}", value)

    def end(self, **attributes: Any) -> None:
        """End the open phase and the generation span."""
        now_ns = time.time_ns()
        self._end_phase(now_ns)
        for key, value in attributes.items():
            self._root.set_attribute(f"quicsrv.{key}", value)
        self._root.end(end_time=now_ns)

    def _end_phase(self, end_ns: int) -> None:
        if self._phase is not None:
            self._phase.end(end_time=end_ns)
            self._phase = None
            self._phase_name = ""


def _wall_ns(monotonic_s: float | None) -> int:
    now_ns = time.time_ns()
    if monotonic_s is None:
        return now_ns
    return now_ns - max(0, int((time.monotonic() - monotonic_s) * 1e9))
