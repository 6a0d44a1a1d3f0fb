"""JAX's compile timings and its persistent compilation cache, in a gang process (private; the worker's).

A restart's cost includes compiling the step again. Each attempt of a run
points JAX's persistent compilation cache at one directory of the run
(:func:`enable_compilation_cache`), so a restart loads its programs instead
of compiling them; :func:`compile_clock` reads JAX's own timings
(``jax.monitoring``) of tracing, lowering and XLA compiling, and the cache's
hits and misses, which ``report()`` turns into the goodput's compile time.

Example:
    >>> c = CompileClock()
    >>> c.on_span("/jax/core/compile/backend_compile_duration", 1.0, 1.5)
    >>> c.on_event("/jax/compilation_cache/cache_misses")
    >>> c.totals
    (0.5, 0.0, 0, 1)
"""

from __future__ import annotations

import threading


class CompileClock:
    """JAX's own compile timings in this process, from ``jax.monitoring`` (see :func:`compile_clock`).

    ``totals`` is ``(xla_s, trace_lower_s, cache_hits, cache_misses)`` since
    the process started: XLA compile or persistent-cache load
    (``/jax/core/compile/backend_compile_duration``), Python tracing plus
    lowering to MLIR (``jaxpr_trace_duration`` + ``jaxpr_to_mlir_module_duration``),
    and the persistent cache's hits and misses. Spans of one event nested in
    another of the same event on the same thread count once. ``totals`` is
    replaced whole, so a reader (``report()``) needs no lock.

    Example:
        >>> c = CompileClock()
        >>> c.on_span("/jax/core/compile/jaxpr_trace_duration", 10.0, 10.5)
        >>> c.on_span("/jax/core/compile/jaxpr_trace_duration", 9.75, 11.0)  # encloses the first: counted once
        >>> c.on_span("/jax/core/compile/backend_compile_duration", 11.0, 13.0)
        >>> c.on_event("/jax/compilation_cache/cache_hits")
        >>> c.totals
        (2.0, 1.25, 1, 0)
    """

    XLA = "/jax/core/compile/backend_compile_duration"
    TRACE_LOWER = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
    HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

    def __init__(self) -> None:
        self.totals: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)
        self._lock = threading.Lock()
        self._spans = threading.local()  # per event: recent spans not yet inside a longer one

    def on_span(self, event: str, start_time: float, end_time: float, **_: str | int) -> None:
        if event != self.XLA and event not in self.TRACE_LOWER:
            return
        spans: dict[str, list[tuple[float, float]]] = self._spans.__dict__.setdefault("by_event", {})
        recent = spans.setdefault(event, [])
        inner = [sp for sp in recent if sp[0] >= start_time and sp[1] <= end_time]  # already counted
        seconds = max(0.0, (end_time - start_time) - sum(e - s for s, e in inner))
        recent[:] = [sp for sp in recent if sp not in inner][-31:] + [(start_time, end_time)]
        with self._lock:
            xla, tl, hits, misses = self.totals
            if event == self.XLA:
                xla += seconds
            else:
                tl += seconds
            self.totals = (xla, tl, hits, misses)

    def on_event(self, event: str, **_: str | int) -> None:
        if event not in (self.HITS, self.MISSES):
            return
        with self._lock:
            xla, tl, hits, misses = self.totals
            self.totals = (xla, tl, hits + (event == self.HITS), misses + (event == self.MISSES))


_COMPILE_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
    """This process's :class:`CompileClock`, its ``jax.monitoring`` listeners registered on the first call."""
    global _COMPILE_CLOCK
    if _COMPILE_CLOCK is None:
        import jax.monitoring

        clock = CompileClock()
        jax.monitoring.register_event_time_span_listener(clock.on_span)
        jax.monitoring.register_event_listener(clock.on_event)
        _COMPILE_CLOCK = clock
    return _COMPILE_CLOCK


def enable_compilation_cache(directory: str) -> bool:
    """Points JAX's persistent compilation cache at ``directory`` for this process; False if it cannot.

    Every program is cached (no minimum compile time or size), so the next
    attempt of the run loads its programs instead of compiling them.
    """
    import jax

    try:
        if "://" not in directory:
            import os

            os.makedirs(directory, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from jax._src import compilation_cache

        if compilation_cache.is_initialized():  # something compiled before: start over with the directory
            compilation_cache.reset_cache()
        return True
    except Exception as e:  # reported once per process, never fails the run
        global _CACHE_WARNED
        if not _CACHE_WARNED:
            _CACHE_WARNED = True
            import logging

            logging.getLogger("rayslice.train.worker").warning(  # the worker's messages, under its name
                "JAX compilation cache %s not usable (%s): compiling from scratch", directory, e
            )
        return False


_CACHE_WARNED = False


__all__ = ["CompileClock", "compile_clock", "enable_compilation_cache"]
