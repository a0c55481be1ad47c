"""Which ranks of a process group share a node.

A cluster is nodes of several ranks (GPUs) joined by a fast link inside the
node and a slower network between nodes. :class:`Topology` records, for every
rank of a group, the node it runs on; :func:`detect_topology` learns it from
the launch, and checks that every rank learned the same:

* ``LIONBIT_NODE`` (any string), when set on every rank: ranks with the same
  value share a node. For launches that neither torchrun's variables nor the
  host names describe.
* torchrun's ``GROUP_RANK`` (the node's rank in the rendezvous), when set on
  every rank: ranks with the same value share a node. This holds for several
  "nodes" on one machine too (``torchrun --nnodes 2 --node-rank 0/1`` on one
  host, as the tests and an emulated cluster run).
* else the host name (``socket.gethostname()``) of every rank.

``LOCAL_WORLD_SIZE`` alone is never trusted: benchmarks unset it (so that
Gloo cannot take a shared-memory shortcut), and it says how many ranks a node
has, not which.

The keys are exchanged once with ``all_gather_object`` on the group (the
group's standard path: on lionbit's backend, Gloo underneath). A topology the
user gives (``Topology.from_nodes``) is checked the same way: every rank must
pass the same one, else every rank raises naming the ranks that differ.

Nodes are numbered by their smallest rank. A node's ranks are in rank order:
``local_rank(r)`` is r's place among them. Uneven nodes (different numbers of
ranks) are a valid topology; ``uniform`` says whether every node has the same
number (what a hierarchical collective over L ranks a node needs).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

SOURCES = ("auto", "env", "torchrun", "hostname")


@dataclass(frozen=True)
class Topology:
    """The node of every rank of a group: ``node_of[r]`` for group rank r.

    Build one with :meth:`from_nodes` (the ranks of each node) or learn it
    with :func:`detect_topology`."""

    node_of: Tuple[int, ...]

    def __post_init__(self):
        n = len(self.node_of)
        if n == 0:
            raise ValueError("lionbit.Topology: argument 'node_of' is empty: a group has at least one rank")
        seen = sorted(set(self.node_of))
        if seen != list(range(len(seen))):
            raise ValueError(f"lionbit.Topology: argument 'node_of' must number the nodes 0..M-1, got node ids {seen}")
        first = [min(r for r in range(n) if self.node_of[r] == m) for m in range(len(seen))]
        if first != sorted(first):
            raise ValueError(
                "lionbit.Topology: argument 'node_of' must number the nodes by their smallest rank "
                f"(node 0 holds rank 0, ...), got {list(self.node_of)}; use Topology.from_nodes"
            )

    @classmethod
    def from_nodes(cls, nodes: Sequence[Sequence[int]]) -> "Topology":
        """The topology whose node i holds the ranks ``nodes[i]``: every rank
        0..N-1 exactly once. The nodes may be given in any order; they are
        renumbered by their smallest rank."""
        groups = [sorted(int(r) for r in node) for node in nodes]
        if any(not g for g in groups):
            raise ValueError("lionbit.Topology.from_nodes: argument 'nodes' has an empty node")
        ranks = sorted(r for g in groups for r in g)
        n = len(ranks)
        if ranks != list(range(n)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks)) if ranks else []
            raise ValueError(
                "lionbit.Topology.from_nodes: argument 'nodes' must hold every rank 0..N-1 exactly once"
                + (f"; repeated: {dup}" if dup else "")
                + (f"; missing: {missing}" if missing else "")
            )
        node_of = [0] * n
        for m, g in enumerate(sorted(groups, key=lambda g: g[0])):
            for r in g:
                node_of[r] = m
        return cls(tuple(node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def nodes(self) -> List[List[int]]:
        """The ranks of each node, node by node, each in rank order."""
        out: List[List[int]] = [[] for _ in range(self.num_nodes)]
        for r, m in enumerate(self.node_of):
            out[m].append(r)
        return out

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks."""
        return len({len(g) for g in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """L, the ranks of every node; raises for uneven nodes."""
        sizes = sorted({len(g) for g in self.nodes})
        if len(sizes) != 1:
            raise ValueError(f"lionbit.Topology: the nodes have different numbers of ranks ({self.nodes})")
        return sizes[0]

    def node_rank(self, rank: int) -> int:
        """The node of group rank ``rank``."""
        return self.node_of[self._check_rank(rank)]

    def local_rank(self, rank: int) -> int:
        """``rank``'s place among its node's ranks (0-based, rank order)."""
        return self.nodes[self.node_rank(rank)].index(rank)

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"lionbit.Topology: rank {rank} is outside the group's 0..{self.world_size - 1}")
        return rank

    def describe(self) -> str:
        """For logs: '2 nodes x 2 ranks: [[0, 1], [2, 3]]'."""
        sizes = sorted({len(g) for g in self.nodes})
        per = f"{sizes[0]} ranks" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} ranks"
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} x {per}: {self.nodes}"

    def fingerprint(self) -> str:
        """A short digest, equal on two ranks iff their topologies are equal."""
        return hashlib.sha256(repr(self.node_of).encode()).hexdigest()[:16]


def _node_key(source: str) -> Tuple[str, str]:
    """This process's (source used, node key) for ``source``."""
    if source in ("auto", "env") and os.environ.get("LIONBIT_NODE"):
        return "env", os.environ["LIONBIT_NODE"]
    if source == "env":
        raise ValueError("lionbit.detect_topology: source='env' but LIONBIT_NODE is not set on this rank")
    if source in ("auto", "torchrun") and os.environ.get("GROUP_RANK") is not None:
        return "torchrun", os.environ["GROUP_RANK"]
    if source == "torchrun":
        raise ValueError("lionbit.detect_topology: source='torchrun' but GROUP_RANK is not set (not under torchrun?)")
    return "hostname", socket.gethostname()


def detect_topology(group: Optional[dist.ProcessGroup] = None, source: str = "auto") -> Topology:
    """The topology of ``group`` (default: the default group), learned from
    the launch (see the module's text): ``source`` "auto" (LIONBIT_NODE, else
    torchrun's GROUP_RANK, else the host name), "env", "torchrun" or
    "hostname". A collective: every rank of the group calls it. Every rank
    must have used the same kind of key, else every rank raises."""
    if source not in SOURCES:
        raise ValueError(f"lionbit.detect_topology: argument 'source' must be one of {SOURCES}, got {source!r}")
    rank = dist.get_rank(group)
    used, key = _node_key(source)
    keys: List[Optional[Tuple[str, str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, (used, key), group=group)
    kinds = sorted({k[0] for k in keys})
    if len(kinds) != 1:
        by_kind = {kind: [r for r, k in enumerate(keys) if k[0] == kind] for kind in kinds}
        raise RuntimeError(
            f"lionbit.detect_topology on rank {rank}: the ranks learned their nodes from different sources "
            f"({by_kind}); set LIONBIT_NODE on every rank, or none"
        )
    first_rank = {}
    for r, (_, k) in enumerate(keys):
        first_rank.setdefault(k, r)
    order = sorted(first_rank, key=first_rank.get)
    index = {k: m for m, k in enumerate(order)}
    return Topology(tuple(index[k] for _, k in keys))


def check_topology(topology: Topology, group: Optional[dist.ProcessGroup] = None) -> Topology:
    """Checks that every rank of ``group`` holds the same ``topology``, of the
    group's size. A collective. Raises on every rank, naming the ranks whose
    topology differs from rank 0's."""
    if not isinstance(topology, Topology):
        raise TypeError(f"lionbit.check_topology: argument 'topology' must be a lionbit.Topology, got {topology!r}")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    prints: List[Optional[Tuple[int, str]]] = [None] * size
    dist.all_gather_object(prints, (topology.world_size, topology.fingerprint()), group=group)
    bad_size = [r for r, p in enumerate(prints) if p[0] != size]
    if bad_size:
        raise ValueError(
            f"lionbit.check_topology on rank {rank}: the topology of rank(s) {bad_size} has "
            f"{[prints[r][0] for r in bad_size]} ranks, the group {size}"
        )
    differ = [r for r, p in enumerate(prints) if p[1] != prints[0][1]]
    if differ:
        raise ValueError(
            f"lionbit.check_topology on rank {rank}: rank(s) {differ} hold a different topology than rank 0 "
            f"(this rank: {topology.describe()}); every rank must pass the same one"
        )
    return topology
