"""The mean of N saved momenta, for a run of M != N workers.

A checkpoint of N workers holds N momenta a parameter (each worker's own:
it follows the worker's data). On M != N workers no worker continues a saved
momentum of its own, so every worker starts from their mean: what a momentum
synchronization (Lion Cub's lever) leaves behind (docs/checkpoints.md).

Three ways the saved momenta reach a loader, one mean:

- :func:`of_stacked`: a plain (N, *shape) tensor that every rank holds whole
  (a consolidated ``full_state_dict=True`` file read by every rank and given
  to ``opt.load_state_dict``, directly or through torch's
  ``set_optimizer_state_dict``): every rank adds the rows in order in
  float32, with no communication, and gets the same bits.
- :func:`of_distributed`: an (N, *shape) DTensor whose rows torch split over
  the rows' mesh dim (torch's ``set_optimizer_state_dict`` with
  ``full_state_dict=True`` distributes a consolidated file that way): each
  rank adds its own rows, then :func:`finish`.
- lionbit.elastic's planner: ``dcp.load`` adds worker w's saved rows w, w + M,
  ... into a float32 sum of its own, then :func:`finish`.

:func:`finish` all-reduces the workers' float32 sums over the rows' mesh
dim and divides by N. The result is the float64 mean to float32's rounding
(to the momentum dtype's after the cast), the same bits on every rank.
"""

import torch
import torch.distributed as dist

from . import user_warning


def are_rows(value, p: torch.Tensor) -> bool:
    """Whether ``value`` is a tensor of workers' momenta of parameter ``p``,
    stacked: shape (workers, *p.shape), any number of workers."""
    return isinstance(value, torch.Tensor) and value.dim() == p.dim() + 1 and value.shape[1:] == p.shape


def rows_mesh_dim(placements) -> int:
    """The mesh dim over which an (N, *shape) DTensor's rows (the workers)
    are placed: the one placement Shard(0)."""
    from torch.distributed.tensor import Shard  # optional: imported already wherever a DTensor exists

    return next(k for k, pl in enumerate(placements) if isinstance(pl, Shard) and pl.dim == 0)


def of_stacked(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mean of the rows of a plain (N, *shape) tensor, as a new tensor
    of ``dtype``: float32 sums in row order (elementwise, so the same bits
    on every rank that holds the same rows, whatever its thread count)."""
    acc = rows[0].to(torch.float32, copy=True)
    for row in rows[1:]:
        acc.add_(row)
    return acc.div_(rows.shape[0]).to(dtype)


def of_distributed(rows, mesh_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The mean of the rows of an (N, *shape) DTensor whose dim 0 is split
    over ``mesh_dim`` of its mesh (a rank may hold several rows, or none):
    this rank's part of it (the local shape without dim 0), as a new tensor
    of ``dtype``. Collective over that mesh dim: every rank of it calls this
    for the same parameters in the same order."""
    local = rows.to_local()
    acc = torch.zeros(local.shape[1:], dtype=torch.float32, device=local.device)
    for row in local:
        acc.add_(row)
    return finish(acc, rows.device_mesh, mesh_dim, rows.shape[0], dtype)


def finish(acc: torch.Tensor, mesh, mesh_dim: int, saved: int, dtype: torch.dtype) -> torch.Tensor:
    """The workers' float32 sums ``acc`` (this rank's, in place) added over
    ``mesh_dim`` of ``mesh`` (None: this rank's is every worker's) and
    divided by the ``saved`` number of momenta, in ``dtype``."""
    if mesh is not None:
        dist.all_reduce(acc, group=mesh.get_group(mesh_dim))
    return acc.div_(saved).to(dtype)


def warn(where: str, saved: int, now: int, name: str, plain: bool = False) -> None:
    """Says once a load that a checkpoint of ``saved`` workers starts this
    run's ``now`` workers from the saved momenta's mean. ``plain``: the
    checkpoint holds one plain momentum a parameter, whoever's."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    held, start = ((f"the momenta of {saved} workers", f"the mean of the {saved} saved momenta") if saved > 1 else
                   ("one momentum a parameter (a run of one worker's; or, where the script handed DCP a dict it "
                    "made, one rank's copy of each)" if plain else "the momentum of 1 worker", "the saved momentum"))
    user_warning.warn(
        f"{where} on rank {rank}: the checkpoint holds {held} and this run has {now} (e.g. '{name}'), so every "
        f"worker starts from {start} (a momentum synchronization); the parameters load as saved"
    )
