"""Where a tensor-parallel parameter's pieces live, for DistributedLion on
FSDP2 with tensor parallelism beside it (lionbit.fsdp).

``fully_shard(model, mesh=mesh["dp"])`` of a model whose parameters a
tensor-parallel plan split over ``mesh["tp"]`` (torchtitan's 2-D
parallelism) makes each such parameter a DTensor on the (dp, tp) mesh,
placed (FSDP's Shard(0) of the tensor-parallel-local tensor, the
tensor-parallel placement): ``Shard(0)``, or ``_StridedShard(0)`` where the
tensor-parallel plan also splits dim 0, then ``Shard(k)`` or
``Replicate()``. FSDP reduces each rank's tensor-parallel-local gradient
over the dp group; DistributedLion votes that part over the dp group
instead. These are the placements of what it shows of that part: the
local gradient in ``p.grad``, and in a checkpoint the momentum with one row
per dp rank. All of them are pure functions of the parameter.
"""

from typing import Tuple

import torch
from torch.distributed.tensor import Replicate, Shard


def _fsdp_shards_dim0(placement) -> bool:
    """FSDP's placement of a tensor-parallel parameter over the dp dim:
    Shard(0), or _StridedShard(0) (a private class of torch: told by name)."""
    return type(placement).__name__ in ("Shard", "_StridedShard") and getattr(placement, "dim", None) == 0


def check_placements(p, name: str, where: str) -> None:
    """A clear error unless p is placed (FSDP's dim-0 shard, Shard(k) or
    Replicate()) on a (dp, tp) mesh: the layouts of torch's tensor-parallel
    styles under FSDP2."""
    placements = tuple(p.placements)
    if (len(placements) != 2 or not _fsdp_shards_dim0(placements[0])
            or type(placements[1]) not in (Shard, Replicate)):
        raise NotImplementedError(
            f"{where}: parameter '{name}' is placed {placements} on the mesh {p.device_mesh}; with tensor "
            f"parallelism DistributedLion supports FSDP's Shard(0) over the dp dim and Shard(k) or Replicate() "
            f"over the tensor-parallel dim (torch's ColwiseParallel, RowwiseParallel and SequenceParallel; "
            f"no shard_placement_fn)"
        )


def grad_placements(p) -> Tuple:
    """How p's local gradient is placed: Replicate() over the dp dim (each
    rank's own gradient, as on a 1-D mesh), and as p over the
    tensor-parallel dim (its local tensor is the tensor-parallel-local
    gradient)."""
    return (Replicate(), *tuple(p.placements)[1:])


def rows_placements(p) -> Tuple:
    """How a checkpoint's (dp ranks, *p.shape) momentum of p is placed: its
    rows over the dp dim (row r is dp rank r's), each row placed as p over
    the tensor-parallel dim (a Shard's dim one further on)."""
    return (Shard(0), *(Shard(t.dim % p.dim() + 1) if isinstance(t, Shard) else t for t in tuple(p.placements)[1:]))


def part(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel part of ``full`` (a tensor of p's global
    shape): along each Shard(k) of p's tensor-parallel dims, the piece
    torch.chunk gives this rank (DTensor's split: ceil(size / n) rows a
    rank, the last ones shorter or empty)."""
    mesh = p.device_mesh
    for i, placement in enumerate(tuple(p.placements)[1:], start=1):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % full.dim()
        size, n = full.shape[dim], mesh.size(i)
        rows = -(-size // n)
        start = min(mesh.get_local_rank(i) * rows, size)
        full = full.narrow(dim, start, min(rows, size - start))
    return full
