"""Monarch's telemetry names (`span`, `traced`, `get_meter`): spans and metrics go to OpenTelemetry when its
API is installed (configure an exporter as OpenTelemetry says), and cost nothing otherwise."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

F = TypeVar("F", bound=Callable[..., Any])


def _otel(kind: str) -> Any:
    try:
        if kind == "trace":
            from opentelemetry import trace

            return trace
        from opentelemetry import metrics

        return metrics
    except ImportError:
        return None


@contextlib.contextmanager
def span(name: str) -> Iterator[Any]:
    """A span named `name` around a block: ``with span("load"): ...``."""
    trace = _otel("trace")
    if trace is None:
        yield None
        return
    with trace.get_tracer("monarch").start_as_current_span(name) as s:
        yield s


@overload
def traced(fn: F) -> F: ...


@overload
def traced(*, name: str) -> Callable[[F], F]: ...


def traced(fn: Any = None, *, name: str | None = None) -> Any:
    """Run a function inside a span (named for it, or `name`): ``@traced`` or ``@traced(name="step")``."""

    def wrap(f: F) -> F:
        label = name or getattr(f, "__qualname__", str(f))

        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with span(label):
                return f(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


class _Instrument:
    """A metric instrument that records nothing (OpenTelemetry is not installed)."""

    def add(self, amount: float, attributes: dict[str, Any] | None = None) -> None:
        pass

    def record(self, amount: float, attributes: dict[str, Any] | None = None) -> None:
        pass


class _Meter:
    def create_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        return _Instrument()

    create_up_down_counter = create_counter
    create_histogram = create_counter


def get_meter(name: str) -> Any:
    """A meter (`create_counter`, `create_histogram`, `create_up_down_counter`): OpenTelemetry's if installed."""
    metrics = _otel("metrics")
    return metrics.get_meter(name) if metrics is not None else _Meter()
