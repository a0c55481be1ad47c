"""The cluster's two levels for lionbit's sign collectives.

``hierarchy=`` on :func:`lionbit.all_reduce_sign`,
:func:`lionbit.reduce_scatter_sign` and :class:`lionbit.DistributedLion`:

* ``"flat"`` (default): one all-to-all and one all-gather over every rank.
* ``"node"``: exact. The signs are counted inside each node first; each rank
  then exchanges its node's counts (the fewest bits that hold 0..2L, as
  bit-planes) of its share with the ranks of the same local index on the
  other nodes, votes, and the results come back across nodes, then inside
  the node. The result is the flat one bit for bit (every op, tie rule,
  dtype), with about (M - 1)/M * d/8 * (bits + 1) bytes a node on the slow
  link instead of the flat vote's L * (N - 1)/N * d/8 and more.
* ``"node_vote"``: approximate (op "vote" only). Each node votes, then the
  node votes are voted across nodes: fewer bytes again, a different result.

The first hierarchical call on a group (or the optimizer's construction)
sets it up on every rank, collectively: it learns the topology
(:func:`lionbit.detect_topology`, or the ``topology`` given) and creates a
lionbit process group for each node and one for each local index across
nodes (``torch.distributed.new_group``, which every rank of the default
group runs, in the same order). Only the default group can be hierarchical;
every node must hold the same number of ranks.

:func:`lionbit.stats` then splits the bytes: ``intra_node_bytes_sent`` /
``_received`` and ``inter_node_bytes_sent`` / ``_received`` (this rank's
payload over its node's and its cross-node communicator; the header round
stays in ``bytes_sent``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import _C, torch_internals
from .topology import Topology, check_topology, detect_topology

HIERARCHIES = ("flat", "node", "node_vote")

# process group -> (the Topology its hierarchy was built from, its node and
# cross-node groups, its lionbit backends). Keyed by the group, whose Python
# object torch keeps while the group lives: a backend's Python object can be
# dropped and made anew while its C++ object lives on (torch 2.11 does so),
# so it cannot be the key. The entry keeps the subgroups alive with the group.
_set_up = weakref.WeakKeyDictionary()


def check_hierarchy(hierarchy, where: str, op: str = "vote") -> str:
    """``hierarchy`` itself, or a clear error naming the argument."""
    if not isinstance(hierarchy, str) or hierarchy not in HIERARCHIES:
        raise ValueError(
            f"lionbit.{where}: argument 'hierarchy' must be one of {HIERARCHIES}, got {hierarchy!r}"
        )
    if hierarchy == "node_vote" and op != "vote":
        raise ValueError(
            f"lionbit.{where}: argument 'hierarchy' is 'node_vote', a vote of node votes, which needs "
            f"aggregation / op 'vote', not {op!r}"
        )
    return hierarchy


def optimizer_hierarchy(hierarchy, aggregation: str, group, topology) -> str:
    """DistributedLion's ``hierarchy`` checked against its aggregation, and set
    up on every rank when a process group exists (the optimizer is built on
    every rank at the same point)."""
    check_hierarchy(hierarchy, "DistributedLion", aggregation)
    if hierarchy != "flat":
        if aggregation == "l1":
            raise ValueError(
                "lionbit.DistributedLion: argument 'hierarchy' applies to aggregation 'vote' or 'avg'; 'l1' runs flat"
            )
        if dist.is_initialized():
            ensure_hierarchy(group, "DistributedLion", topology)
    return hierarchy


def _lionbit_backends(pg) -> list:
    """(device, backend) for each distinct lionbit backend of a group (CPU,
    and CUDA when it has one)."""
    found = []
    for name in ("cpu", "cuda"):
        device = torch.device(name)
        try:
            b = torch_internals.backend_object(pg, device)
        except RuntimeError:
            continue
        if isinstance(b, _C.LionBitBackend) and all(b is not f for _, f in found):
            found.append((device, b))
    return found


def ensure_hierarchy(group: Optional[dist.ProcessGroup], where: str, topology: Optional[Topology] = None) -> Topology:
    """Sets up the group's hierarchy unless it has one; returns its topology.
    Collective: every rank of the default group calls it at the same point."""
    default = torch_internals.default_group()
    pg = default if group is None else group
    backends = _lionbit_backends(pg)
    if not backends:
        raise RuntimeError(f"lionbit.{where} on rank {dist.get_rank()}: the group has no lionbit backend")
    if pg is not default:
        raise ValueError(
            f"lionbit.{where} on rank {dist.get_rank()}: argument 'hierarchy' needs the default process group "
            f"(its node groups are made with new_group over every rank); pass group=None"
        )
    if all(b.has_hierarchy for _, b in backends) and pg in _set_up:
        known = _set_up[pg][0]
        if topology is not None and topology != known:
            raise ValueError(
                f"lionbit.{where} on rank {dist.get_rank()}: argument 'topology' ({topology.describe()}) differs from "
                f"the group's hierarchy, set up before ({known.describe()})"
            )
        return known
    topo = check_topology(topology, pg) if topology is not None else detect_topology(pg)
    if not topo.uniform:
        raise ValueError(
            f"lionbit.{where} on rank {dist.get_rank()}: argument 'hierarchy' needs the same number of ranks on "
            f"every node; the group has {topo.describe()}"
        )
    nodes = topo.nodes  # each in rank order, numbered by their smallest rank
    per_node = len(nodes[0])
    # Every rank creates every group, in the same order (new_group's contract).
    node_groups = [dist.new_group(ranks=n, backend="lionbit") for n in nodes]
    cross_members = [sorted(n[j] for n in nodes) for j in range(per_node)]
    cross_groups = [dist.new_group(ranks=c, backend="lionbit") for c in cross_members]
    me = pg.rank()
    mine = topo.node_rank(me)
    local = topo.local_rank(me)
    order = [r for c in cross_members for r in c]
    node_pg, cross_pg = node_groups[mine], cross_groups[local]
    for device, b in backends:
        node_b, cross_b = (torch_internals.backend_object(g, device) for g in (node_pg, cross_pg))
        b.set_hierarchy(node_b, cross_b, order, nodes[mine])
    _set_up[pg] = (topo, node_pg, cross_pg, [b for _, b in backends])
    return topo
