"""What XLA built in this process: how many programs it compiled, and which collectives cross hosts.

Serving promises that nothing recompiles after warm-up: :func:`compile_count`
counts every XLA compilation in the process (from JAX's monitoring events),
so a test or a replica's stats can check it. A slice whose programs have no
collective between hosts lets each host run only its own slots' programs:
:func:`collectives_spanning` finds, in a compiled program's HLO text, the
collectives whose device groups lie on more than one host.

Example:
    >>> hlo = "%r = f32[2] all-reduce(%x), replica_groups={{0,1}}"
    >>> collectives_spanning(hlo, [0, 1])  # partition ids 0 and 1 on two hosts
    ['%r = f32[2] all-reduce(%x), replica_groups={{0,1}}']
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np

_COMPILES = 0
_LISTENING = False
_LOCK = threading.Lock()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _on_event(event: str, duration_secs: float, **kwargs: Any) -> None:
    global _COMPILES
    if event == _COMPILE_EVENT:
        with _LOCK:
            _COMPILES += 1


def compile_count() -> int:
    """XLA compilations in this process since :func:`count_compiles` was first called (by the first runner).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> count_compiles()
        >>> x = jnp.arange(5)  # made first: it may compile a program of its own
        >>> before = compile_count()
        >>> _ = jax.jit(lambda x: x * 3 + 1)(x)
        >>> compile_count() - before
        1
    """
    return _COMPILES


def count_compiles() -> None:
    """Starts counting this process's XLA compilations (see :func:`compile_count`); calling it again does nothing."""
    global _LISTENING
    import jax

    with _LOCK:
        if not _LISTENING:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _LISTENING = True


_COLLECTIVE = re.compile(
    r"(?<![%\w.-])(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast)"
    r"(-start)?\("
)
_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=(\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


def _parse_groups(text: str, num_ids: int) -> list[list[int]]:
    if text.startswith("["):  # iota form: [groups,size]<=[dims]T(perm)
        m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        assert m is not None
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
    groups = [g for g in groups if g]
    return groups or [list(range(num_ids))]  # {} means every device


def collectives_spanning(hlo: str, group_of: list[int]) -> list[str]:
    """Lines of ``hlo`` holding a collective between devices of different groups.

    ``group_of[i]`` is the group (e.g. the host) of the device with
    partition id ``i`` (the mesh's devices in row-major order). A collective
    with no explicit groups spans every device.

    Example:
        >>> hlo = ("%a = f32[2] all-reduce(%x), replica_groups={{0,1},{2,3}}\\n"
        ...        "%b = f32[2] all-gather(%a), replica_groups=[1,4]<=[4]")
        >>> [line[:2] for line in collectives_spanning(hlo, [0, 0, 1, 1])]
        ['%b']
        >>> collectives_spanning(hlo, [0, 0, 0, 0])
        []
        >>> len(collectives_spanning("%c = f32[2] all-reduce(%x), replica_groups={}", [0, 1]))
        1
    """
    out = []
    for line in hlo.splitlines():
        if not _COLLECTIVE.search(line):
            continue
        m = _GROUPS.search(line)
        groups = _parse_groups(m.group(1) if m else "{}", len(group_of))
        if any(len({group_of[i] for i in g}) > 1 for g in groups):
            out.append(line.strip())
    return out
