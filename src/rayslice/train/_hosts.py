"""What a training run knows about its hosts between attempts (private): slices to avoid, hosts lost.

A run reserves again after each failure. What the failed attempt learned
decides where the next one goes and what it can restore from:

* ``avoid``: slices with a host that stopped answering, or whose process died:
  the next reservation takes other slices where it can;
* ``suspect_slices``: the slices among them avoided only because a process of theirs
  died or went silent (their hosts may well be up);
* ``silent``: the nodes of the suspects' hosts whose heartbeats stopped;
* ``lost``: the nodes of hosts found lost: their RAM checkpoint stores went
  with them (kept for the whole run).

An elastic run asks before it counts the free slices again
(:meth:`HostLedger.confirm`): a slice whose hosts all answer stays in the count.

Example:
    >>> ledger = HostLedger()
    >>> ledger.attempt_on({"s0": ["n0", "n1"], "s1": ["n2", "n3"]})
    >>> ledger.suspect("s0", "n1")            # a process of s0 died: its host may be up
    >>> ledger.suspect("s1", "n3", silent=True)
    >>> sorted(ledger.avoid), sorted(ledger.silent)
    (['s0', 's1'], ['n3'])
    >>> ledger.confirm(lambda nodes: nodes - {"n3"})  # every host answers but n3
    >>> sorted(ledger.avoid), sorted(ledger.lost)
    (['s1'], ['n3'])
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

logger = logging.getLogger("rayslice.train.controller")  # the trainer's messages, under its name


@dataclasses.dataclass
class HostLedger:
    """The slices a run avoids and the hosts it knows lost (see the module's docstring).

    Attributes:
        avoid: Slice names the next reservation avoids where it can.
        suspect_slices: Slices avoided only for a process that died or went silent.
        silent: Nodes whose heartbeats stopped, among the suspects' hosts.
        lost: Nodes of hosts found lost (their RAM stores are gone).
        hosts: The last watched attempt's slices -> their hosts' nodes.
    """

    avoid: set[str] = dataclasses.field(default_factory=set)
    suspect_slices: set[str] = dataclasses.field(default_factory=set)
    silent: set[str] = dataclasses.field(default_factory=set)
    lost: set[str] = dataclasses.field(default_factory=set)
    hosts: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def reserved(self) -> None:
        """A new reservation was made: what it avoided is history (the lost hosts stay known)."""
        self.avoid, self.suspect_slices, self.silent = set(), set(), set()

    def attempt_on(self, hosts: dict[str, list[str]]) -> None:
        """An attempt started on these slices (name -> nodes of its hosts, in worker order)."""
        self.hosts = {name: list(nodes) for name, nodes in hosts.items()}

    def suspect(self, slice_name: str, node_id: str, silent: bool = False) -> None:
        """A process on ``node_id`` died (or, ``silent``, its heartbeats stopped): avoid its slice for now."""
        self.avoid.add(slice_name)
        self.suspect_slices.add(slice_name)
        if silent:
            self.silent.add(node_id)

    def lose(self, nodes: Iterable[str]) -> None:
        """These hosts are lost: their RAM stores are gone for the rest of the run."""
        self.lost.update(nodes)

    def confirm(self, answering: Callable[[set[str]], set[str]] | None) -> None:
        """After an elastic attempt failed: which of its hosts are up, asked of something on each host.

        A gang process also dies alone, e.g. aborted with its collective when a peer host (holding
        JAX's coordination service) went down, and Ray may report that death before the lost host's:
        a slice avoided for its process alone would shrink the run further than the loss, and a lost
        host not named would be counted free. ``answering(nodes)`` says which nodes answer (the RAM
        stores do: a process of their own on each host); a slice whose hosts all answer stays in the
        count, one with a host that does not is avoided and that host is lost. Without ``answering``
        (no RAM tier), or when it raises, nothing on the hosts can be asked: the silent hosts are
        taken for lost and the slices of dead processes stay avoided.

        Args:
            answering: ``nodes -> the nodes among them that answer``, or None.
        """
        hosts, self.hosts = self.hosts, {}
        suspects, self.suspect_slices = self.suspect_slices, set()
        silent, self.silent = self.silent, set()
        nodes = {n for ns in hosts.values() for n in ns}
        up: set[str] | None = None
        if answering is not None and nodes:
            try:
                up = answering(nodes)
            except Exception as e:  # the loss is still handled: slices avoided, hosts asked again later
                logger.debug("could not ask the hosts of %s: %s", sorted(hosts), e)
        if up is None:
            self.lost |= silent
            return
        self.lost |= nodes - up
        for name, ns in hosts.items():
            if set(ns) & self.lost:
                self.avoid.add(name)
            elif name in suspects:
                self.avoid.discard(name)
                logger.debug("elastic: %s stays in the count: a process died but every host of it is up", name)


__all__ = ["HostLedger"]
