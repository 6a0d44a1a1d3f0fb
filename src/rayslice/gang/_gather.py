"""Results of a gang's calls, gathered in rank order under one deadline.

A host lost on the way is a :class:`~rayslice.errors.GangError` with its
outcome and rank; the user's own exception is raised as Ray raises it.

Example:
    >>> import concurrent.futures
    >>> from rayslice._deadline import Deadline
    >>> futures = [concurrent.futures.Future() for _ in range(2)]
    >>> for rank, f in enumerate(futures):
    ...     f.set_result(rank * 10)
    >>> _ordered_result(futures, Deadline(1.0), "example")
    [0, 10]
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

from rayslice._deadline import Deadline
from rayslice.errors import GangError, Outcome, classify
from rayslice.gang._local import _LocalRef


def _ordered_get(refs: Sequence[Any], deadline: Deadline, what: str) -> list[Any]:
    """ray.get over refs in rank order, raising at the first failure (no waiting on the rest)."""
    import ray

    if any(isinstance(ref, _LocalRef) for ref in refs):
        return _ordered_result([ref.future() for ref in refs], deadline, what)
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        timeout = None if deadline.timeout_s is None else deadline.remaining
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise GangError(
                f"{what}: {len(pending)} host(s) did not finish within {deadline.timeout_s:g} s", Outcome.TIMEOUT
            )
        for ref in ready:
            results[index[ref]] = _result(functools.partial(ray.get, ref), index[ref], what)
    return results


def _result(get: Callable[[], Any], rank: int, what: str) -> Any:
    try:
        return get()
    except Exception as exc:
        outcome = classify(exc)
        if outcome is Outcome.FAILED:
            raise  # the user's own exception, as Ray re-raises it
        raise GangError(f"{what}: host rank {rank} lost ({outcome.value}): {exc}", outcome, rank=rank) from exc


def _ordered_result(futures: Sequence[concurrent.futures.Future], deadline: Deadline, what: str) -> list[Any]:
    """:func:`_ordered_get` over futures (a gang with a local rank 0: its refs and the actors' ``ref.future()``)."""
    index = {f: i for i, f in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    pending = set(futures)
    try:
        while pending:
            timeout = None if deadline.timeout_s is None else deadline.remaining
            done, pending = concurrent.futures.wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")
            if not done:
                raise GangError(
                    f"{what}: {len(pending)} host(s) did not finish within {deadline.timeout_s:g} s", Outcome.TIMEOUT
                )
            for f in sorted(done, key=index.__getitem__):
                results[index[f]] = _result(f.result, index[f], what)
    finally:
        for f in pending:
            f.cancel()
    return results
