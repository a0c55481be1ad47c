"""Context parallelism beside a 1-D FSDP2 mesh, for DistributedLion
(lionbit.fsdp): ``opt.attach(model, context_parallel=cp)``.

With context parallelism (torchtitan's ``cp``, torch's ``context_parallel``)
the ranks of a cp group split one batch's sequences between them, and FSDP
shards over the dp and the cp ranks together (torchtitan's ``fsdp`` dim,
``dp_shard * cp``). A Distributed Lion worker is then the cp ranks of one dp
index: each holds its sequence chunk's part of the worker's gradient. Voting
each rank as a worker would give a different optimizer than the same run
without context parallelism (more workers, each with a part of a sequence);
the user says which ranks split a sequence, and lionbit:

1. in backward, sums FSDP's reduce-scatter input (the unit's local
   gradients, one flat tensor) over the cp group before taking each
   parameter's out of it, and divides by the cp group's size where FSDP
   averages (its default divide factor, or one equal to its group's size:
   the worker's gradient is the mean of its ranks', as each rank's loss is
   a mean over its chunk); with a divide factor of 1.0 (torchtitan's: the
   loss normalized by the global token count) the sum is the worker's
   gradient. ``p.grad`` is the worker's gradient on each of its ranks, and
   each keeps the worker's full-size momentum (the same on all of them);
2. at ``step()``, each cp rank votes only its share of the chunks: FSDP's
   chunk of every dp rank of its own cp index, over the group of those dp
   ranks (:attr:`ContextParallel.vote`), which gives Delta of its own
   chunk, FSDP's shard; the cp ranks then agree whether to step, as a
   tensor-parallel group does. A worker's gradient is voted once:
   (dp - 1)/dp * d/cp/8 bytes a rank.

Under HSDP the node's shard group holds the cp ranks already (a node is
one worker), and nothing changes.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import step_vote, torch_internals

_vote_groups: Dict[tuple, "dist.ProcessGroup"] = {}  # ranks -> the group made for them (a collective: once)


def _ranks(group) -> list:
    return dist.get_process_group_ranks(group)


def group_of(cp, where: str):
    """The process group of ``context_parallel``: a 1-D DeviceMesh's, or a
    ProcessGroup as it is; a clear error otherwise."""
    if isinstance(cp, dist.ProcessGroup):
        return cp
    if hasattr(cp, "get_group") and hasattr(cp, "ndim"):
        if cp.ndim != 1:
            raise ValueError(
                f"{where}: argument 'context_parallel' is a {cp.ndim}-D DeviceMesh; pass the 1-D mesh of the "
                f"context-parallel dim (mesh['cp']) or its process group"
            )
        return cp.get_group()
    raise TypeError(
        f"{where}: argument 'context_parallel' must be a 1-D DeviceMesh (mesh['cp']) or a ProcessGroup, "
        f"not {type(cp).__name__}"
    )


class ContextParallel:
    """The cp group of a 1-D FSDP mesh's ranks and the dp group each cp
    rank votes over: ``group`` (the cp ranks of this rank's worker),
    ``vote`` (the ranks of the FSDP group with this rank's cp index, in
    FSDP's order), ``chunks`` (FSDP's chunk index of each of ``vote``'s
    ranks: the chunks this rank packs, in the vote's order)."""

    def __init__(self, group, fsdp_group, where: str, device: torch.device):
        me = dist.get_rank()
        cp_ranks, fsdp_ranks = _ranks(group), _ranks(fsdp_group)
        if me not in cp_ranks:
            raise ValueError(f"{where}: argument 'context_parallel' is a group without this rank ({me})")
        if not set(cp_ranks) <= set(fsdp_ranks) or len(fsdp_ranks) % len(cp_ranks):
            raise ValueError(
                f"{where}: the context-parallel ranks {cp_ranks} of rank {me} are not a part of its FSDP group "
                f"{fsdp_ranks}; fully_shard over the dp and cp ranks together (torchtitan's fsdp dim, "
                f"dp_shard x cp), the mesh the cp ranks' gradients are reduced over"
            )
        self.group = group
        self.size, self.index = len(cp_ranks), cp_ranks.index(me)
        # Which ranks of the FSDP group share this rank's cp index: gathered over it (no order of the
        # dims assumed: torchtitan's fsdp dim is dp_shard-major, another program's need not be).
        on = torch.device("cpu") if step_vote.flags_on_cpu(fsdp_group) else device  # (NCCL alone: the GPU)
        indices = torch.tensor([self.index], dtype=torch.int64, device=on)
        every = [torch.zeros_like(indices) for _ in fsdp_ranks]
        dist.all_gather(every, indices, group=fsdp_group)
        mine = [r for r, i in zip(fsdp_ranks, every) if int(i) == self.index]
        if len(mine) * self.size != len(fsdp_ranks):
            raise ValueError(
                f"{where}: the context-parallel groups do not split rank {me}'s FSDP group {fsdp_ranks} evenly "
                f"(cp index of each: {[int(i) for i in every]}); every rank passes its own cp group of "
                f"{self.size} ranks"
            )
        self.vote = _vote_group(mine)
        self.chunks = [fsdp_ranks.index(r) for r in mine]

    def worker_gradient(self, flat: torch.Tensor, mean: bool) -> None:
        """The worker's gradient in place of this rank's ``flat`` local
        gradients: their sum over the cp ranks, divided by their number
        where ``mean``."""
        dist.all_reduce(flat, group=self.group)
        if mean:
            flat.div_(self.size)


def _vote_group(ranks: list):
    """A process group of ``ranks`` (this rank among them), made once: only
    its ranks take part (use_local_synchronization), so each cp index's dp
    ranks make theirs on their own."""
    key = tuple(ranks)
    group = _vote_groups.get(key)
    if group is not None:
        try:
            dist.get_rank(group)  # (raises once destroy_process_group() ended it)
            return group
        except (ValueError, RuntimeError):
            pass
    group = _vote_groups[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


def folded(fsdp_mesh) -> Optional["dist.ProcessGroup"]:
    """The group of a "cp" dim whose ranks a 1-D FSDP mesh holds, where the
    mesh was flattened from one with such a dim (torch's way:
    ``mesh["dp", "cp"]._flatten()``); None otherwise (a mesh of its own, as
    torchtitan's fsdp dim, tells nothing)."""
    root = torch_internals.root_mesh(fsdp_mesh)
    names = tuple(getattr(root, "mesh_dim_names", None) or ())
    if root is fsdp_mesh or "cp" not in names or root.size(names.index("cp")) == 1:
        return None
    group = root.get_group("cp")
    inside = set(_ranks(group)) <= set(_ranks(fsdp_mesh.get_group()))
    return group if inside else None


def averages(factor: Optional[float], fsdp_size: int, where: str) -> bool:
    """Whether the worker's gradient is the mean of its cp ranks' (FSDP
    averages: no divide factor, or one equal to its group's size) or their
    sum (a divide factor of 1.0); any other factor is ambiguous: a clear
    error."""
    if factor is None or factor == fsdp_size:
        return True
    if factor == 1.0:
        return False
    raise NotImplementedError(
        f"{where}: the FSDP unit's gradient divide factor is {factor}; with context parallelism DistributedLion "
        f"takes a worker's gradient as the mean of its cp ranks' (no factor, or {fsdp_size}: FSDP averages) or as "
        f"their sum (1.0: the loss normalized across ranks, torchtitan's)"
    )
