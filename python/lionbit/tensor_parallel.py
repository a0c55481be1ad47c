"""Where a tensor-parallel parameter's pieces live, for DistributedLion on
FSDP2 with tensor parallelism beside it (lionbit.fsdp).

``fully_shard(model, mesh=mesh["dp"])`` of a model whose parameters a
tensor-parallel plan split over ``mesh["tp"]`` (torchtitan's 2-D
parallelism) makes each such parameter a DTensor on the (dp, tp) mesh,
placed (FSDP's Shard(0) of the tensor-parallel-local tensor, the
tensor-parallel placement): ``Shard(0)``, or ``_StridedShard(0)`` where the
tensor-parallel plan also splits dim 0, then ``Shard(k)`` or
``Replicate()``; under HSDP (``mesh=mesh["replicate", "shard"]``) on the
(replicate, shard, tp) mesh, ``Replicate()`` first. FSDP reduces each
rank's tensor-parallel-local gradient over the dp (shard) group;
DistributedLion votes that part (under HSDP, FSDP's shard of the node's
mean of it) over the dp (replicate) group instead. These are the
placements of what it shows of that part: the local gradient in
``p.grad`` (1-D), and in a checkpoint the momentum with one row per
worker. All of them are pure functions of the parameter.
"""

from typing import Tuple

import torch
from torch.distributed.tensor import Replicate, Shard


def _fsdp_shards(placement) -> bool:
    """FSDP's placement of a tensor-parallel parameter over its shard dim:
    Shard(k), or _StridedShard(k) (a private class of torch: told by name);
    k is 0 unless a shard_placement_fn chose another (torchtitan's Shard(1)
    experts)."""
    return type(placement).__name__ in ("Shard", "_StridedShard")


def check_placements(p, name: str, where: str, hsdp: bool = False, replicated: bool = False) -> None:
    """A clear error unless p is placed ([HSDP: Replicate(),] FSDP's shard,
    Shard(k) or Replicate()) on a ([replicate,] dp, tp) mesh, or
    (``replicated``: FSDP2's replicate()) (Replicate(), Shard(k) or
    Replicate()) on a (dp, tp) mesh: the layouts of torch's tensor-parallel
    styles under FSDP2."""
    placements = tuple(p.placements)
    lead = (Replicate(),) if hsdp or replicated else ()
    dp = placements[len(lead):-1]  # FSDP's shard over dp: one, none under replicate()
    if (len(placements) != len(lead) + (1 if replicated else 2) or placements[:len(lead)] != lead
            or not all(map(_fsdp_shards, dp)) or type(placements[-1]) not in (Shard, Replicate)):
        raise NotImplementedError(
            f"{where}: parameter '{name}' is placed {placements} on the mesh {p.device_mesh}; with tensor or "
            f"expert parallelism DistributedLion supports FSDP's Shard(k) over the dp dim and Shard(k) or "
            f"Replicate() over the tensor- or expert-parallel dim (torch's ColwiseParallel, RowwiseParallel and "
            f"SequenceParallel; torchtitan's ExpertParallel)"
        )


def grad_placements(p) -> Tuple:
    """How p's local gradient is placed: Replicate() over the dp dim (each
    rank's own gradient, as on a 1-D mesh), and as p over the
    tensor-parallel dim (its local tensor is the tensor-parallel-local
    gradient)."""
    return (Replicate(), *tuple(p.placements)[1:])


def rows_placements(p) -> Tuple:
    """How a checkpoint's (workers, *p.shape) momentum of p is placed: its
    rows over the mesh's first dim (row r is worker r's: dp rank r's on a
    1-D FSDP mesh, node r's under HSDP), each row placed as p over the
    other dims (HSDP's shard dim, the tensor-parallel dim), one tensor dim
    further on. The momentum of a parameter without tensor parallelism on a
    1-D mesh: (Shard(0),); on HSDP: (Shard(0), Shard(1))."""
    return (Shard(0), *(_one_dim_on(t, p.dim()) for t in tuple(p.placements)[1:]))


def _one_dim_on(placement, ndim: int):
    """A placement of a tensor of ``ndim`` dims, on the dim after (Shard(k)
    -> Shard(k + 1), and _StridedShard alike, with its split factor);
    Replicate() as it is."""
    if type(placement).__name__ == "_StridedShard":
        return type(placement)(placement.dim % ndim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim % ndim + 1)
    return placement


def part(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel part of ``full`` (a tensor of p's global
    shape): along each Shard(k) of p's tensor-parallel dims, the piece
    torch.chunk gives this rank (DTensor's split: ceil(size / n) rows a
    rank, the last ones shorter or empty)."""
    mesh = p.device_mesh
    first = mesh.ndim - 1  # the tensor-parallel dim: the mesh's last
    for i, placement in enumerate(tuple(p.placements)[first:], start=first):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % full.dim()
        size, n = full.shape[dim], mesh.size(i)
        rows = -(-size // n)
        start = min(mesh.get_local_rank(i) * rows, size)
        full = full.narrow(dim, start, min(rows, size - start))
    return full
