"""A gang's rank 0 in the calling process (``SliceGang(local_rank0=True)``), answering as a gang actor would.

Example:
    >>> import concurrent.futures
    >>> done = concurrent.futures.Future()
    >>> done.set_result(3)
    >>> _LocalRef(done).future().result()
    3
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any

from rayslice.gang._process import HostContext, _HostProcess


class _LocalRef:
    """A call running on a gang's local rank 0; stands in for the ``ObjectRef`` a gang actor returns.

    Gang code waits on it through :meth:`future`, as on an ``ObjectRef``'s.
    """

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


class _LocalMethod:
    def __init__(self, host: _LocalHost, name: str) -> None:
        self._host, self._name = host, name

    def options(self, **options: Any) -> _LocalMethod:
        if options.get("num_returns", 1) != 1:
            raise NotImplementedError(f"{self._name} with num_returns={options['num_returns']} on a local rank 0")
        return self  # a concurrency group: the local rank answers pings at once anyway

    def remote(self, *args: Any) -> _LocalRef:
        return _LocalRef(self._host.submit(self._name, args))


class _LocalHost:
    """Rank 0 of a gang in the calling process (``SliceGang(local_rank0=True)``), with a gang actor's methods.

    Calls run one at a time on one thread of this process, in order, as on an
    actor; a ping answers at once. An exception from the user's function is
    raised as Ray raises one from an actor (a ``RayTaskError`` that is also an
    instance of the cause), so outcomes are classified the same way.
    """

    def __init__(self, env: dict[str, str], ctx: HostContext) -> None:
        self.body = _HostProcess(env, ctx, notices=False)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayslice-rank0")

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("_") or not callable(getattr(_HostProcess, name, None)):
            raise AttributeError(name)
        return _LocalMethod(self, name)

    def submit(self, name: str, args: tuple) -> concurrent.futures.Future:
        if name == "ping":
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(True)
            return done
        return self.pool.submit(_run_local, getattr(self.body, name), name, args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _run_local(method: Callable[..., Any], name: str, args: tuple) -> Any:
    try:
        return method(*args)
    except Exception as e:
        import traceback

        from ray.exceptions import RayTaskError

        fn = args[0] if name in ("call", "call_split") else None
        where = getattr(fn, "__name__", name)
        raise RayTaskError(where, traceback.format_exc(), e, pid=os.getpid()).as_instanceof_cause() from None
