"""Resuming a torch.distributed.checkpoint checkpoint on another number of
workers.

Each worker's momentum follows its own data, so a checkpoint of N workers
holds N momenta a parameter: the rows of one (N, *shape) DTensor that
lionbit presents to torch's state dicts (lionbit.attachment under DDP and
plain modules, lionbit.fsdp_checkpoint under FSDP2). On M != N workers no
worker continues a saved momentum of its own, and DCP's default planner
refuses the rows ("Size mismatch between saved torch.Size([N, ...]) and
current: torch.Size([M, ...])"). :class:`ElasticLoadPlanner` loads them
instead as their mean: every worker starts from the average of the N saved
momenta, what a momentum synchronization (Lion Cub's lever) leaves behind.
The parameters and everything else load as DCP loads them (resharded as
usual).

The mean is taken in two halves, as the load runs:

- ``dcp.load`` (the planner): worker w of M reads the saved rows w, w + M,
  w + 2M, ... (each in its own part: under HSDP its shard of every row) and
  adds them in float32, in the order it reads them, into a sum of its own
  (one float32 momentum's memory a parameter while the load lasts). The
  rows are read once over all workers: the checkpoint's size, not N times
  it.
- ``opt.load_state_dict`` (also through ``set_state_dict``; run on every rank,
  the parameters in the same order): one all-reduce a parameter over the
  rows' ranks sums the M sums and divides by N (in float32), written in the
  momentum's dtype (lionbit.momentum_mean.finish). Every worker gets the
  same bits.

A run of one worker (world size 1, or no process group) presents each
momentum plain, of its parameter's shape (as lionbit always has: one
worker's checkpoint is a plain optimizer's); the planner reads all N saved
rows into it, and a plain checkpoint (one worker's) loads on M workers as
one saved row. On the same number of workers the planner is DCP's default
planner: an exact resume.
"""

import dataclasses
import weakref
from typing import Dict, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from . import momentum_mean

#: The rows DTensors lionbit presented, and one worker's plain momenta (by id: a Tensor's == is elementwise).
_PRESENTED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

#: Momenta that dcp.load filled with a sum of saved rows (by id), and the sums.
_SUMS: Dict[int, "_RowSum"] = {}

#: HSDP's mesh layouts lionbit presented (lionbit.fsdp_checkpoint.MESH_SHAPE_KEY), and those
#: that dcp.load met against a checkpoint of another mesh (left as they were: this run's).
_LAYOUTS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_REMESHED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

#: The names of HSDP's records of its mesh (lionbit.fsdp_checkpoint.MESH_KEY): a checkpoint
#: written on a 1-D mesh has none.
_RECORD_NAMES: set = set()


def presented(rows: torch.Tensor) -> torch.Tensor:
    """Marks ``rows`` (worker r's momentum as row r of an (N, *shape)
    DTensor placed Shard(0) on one mesh dim; or a plain momentum of the
    only worker) as lionbit's: the only entries :class:`ElasticLoadPlanner`
    loads as a mean."""
    _PRESENTED[id(rows)] = rows
    return rows


def is_presented(value) -> bool:
    """Whether ``value`` is a momentum that lionbit presented (and that
    dcp.load may have filled), not one that torch made from a file."""
    return _PRESENTED.get(id(value)) is value


def presented_layout(layout: torch.Tensor, record_name: str) -> torch.Tensor:
    """Marks an HSDP state dict's mesh layout (a plain (M, L) tensor, ahead
    of the momenta) as lionbit's, and ``record_name`` as the name of its
    records of the mesh (strings): :class:`ElasticLoadPlanner` leaves them as
    they are where the checkpoint's mesh has another shape (or, written on a
    1-D mesh, has none)."""
    _LAYOUTS[id(layout)] = layout
    _RECORD_NAMES.add(record_name)
    return layout


def remeshed(layout) -> bool:
    """Whether ``layout`` (an HSDP state dict's mesh layout) was loaded by
    :class:`ElasticLoadPlanner` against a checkpoint of another mesh: then
    the loaders take the momenta as it left them, on this run's mesh."""
    return _REMESHED.get(id(layout)) is layout


class _RowSum:
    """The saved rows this rank reads into one float32 sum: its part of each.
    ``value`` is a rows DTensor, or the only worker's plain momentum (which
    reads every row whole); ``saved`` rows, or one plain momentum where
    ``plain_saved`` (one worker's checkpoint)."""

    def __init__(self, value: torch.Tensor, saved: int, plain_saved: bool):
        self.saved, self.plain_saved = saved, plain_saved
        if isinstance(value, DTensor):
            self.mesh, self.mesh_dim = value.device_mesh, momentum_mean.rows_mesh_dim(value.placements)
            self.workers = self.mesh.size(self.mesh_dim)
            self.worker = self.mesh.get_local_rank(self.mesh_dim)
            self.chunk = value.__create_chunk_list__()[0]  # this rank's part: (1, *its block) at (worker, *offsets)
            device = value.to_local().device
        else:
            self.mesh, self.mesh_dim, self.workers, self.worker = None, 0, 1, 0
            self.chunk = ChunkStorageMetadata(offsets=torch.Size([0] * (value.dim() + 1)),
                                              sizes=torch.Size((1, *value.shape)))
            device = value.device
        self.sum = torch.zeros(tuple(self.chunk.sizes), dtype=torch.float32, device=device)

    def chunks(self) -> list:
        """The same part of every saved row this worker reads."""
        rest, rows = tuple(self.chunk.offsets[1:]), range(self.worker, self.saved, self.workers)
        if self.plain_saved:  # one row, without the rows' dim: worker 0 reads it
            return [ChunkStorageMetadata(offsets=torch.Size(rest), sizes=self.chunk.sizes[1:]) for _ in rows]
        return [ChunkStorageMetadata(offsets=torch.Size((i, *rest)), sizes=self.chunk.sizes) for i in rows]

    def add(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        block = self.sum[0] if self.plain_saved else self.sum
        for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            block = block.narrow(d, start, length)
        block.add_(tensor.to(device=block.device, dtype=torch.float32))


def _saved_rows(value, md) -> Optional[tuple]:
    """(saved momenta, whether saved plain, this run's workers) where
    dcp.load sums saved rows into ``value``, a momentum lionbit presented,
    from checkpoint entry ``md``: rows of another number of workers, or
    another layout (one worker's plain momentum against rows, or rows
    against it). None: DCP's own load (and its size check)."""
    if not (is_presented(value) and isinstance(md, TensorStorageMetadata)):
        return None
    rows = isinstance(value, DTensor)
    if rows and value.device_mesh.get_coordinate() is None:
        return None  # (not on this rank's mesh)
    saved, now = tuple(md.size), tuple(value.shape)
    shape, workers = (now[1:], now[0]) if rows else (now, 1)  # one momentum's shape; this run's workers
    if saved == now:
        return None  # (the same layout of the same number)
    if len(saved) == len(shape) + 1 and saved[1:] == shape:
        return saved[0], False, workers
    return (1, True, workers) if saved == shape else None


class ElasticLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(state_dict, checkpoint_id=path, planner=lionbit.ElasticLoadPlanner())``:
    DCP's default load planner, except that DistributedLion's momenta saved
    by another number of workers load as their mean (this module's
    docstring); ``opt.load_state_dict`` (or torch's ``set_state_dict``)
    afterwards completes the mean. Takes DefaultLoadPlanner's arguments."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.row_sums: Dict[str, _RowSum] = {}
        self.hidden = set()  # entries DCP's own plan does not see: the row sums, other meshes' layouts
        saved_of = {}
        for fqn, value in self.state_dict.items():
            md = metadata.state_dict_metadata.get(fqn) if metadata is not None else None
            if _LAYOUTS.get(id(value)) is value and (md is None or getattr(md, "size", None) != value.shape):
                self.hidden.add(fqn)  # another mesh's checkpoint: this run's layout stays
                _REMESHED[id(value)] = value
                continue
            if md is None and isinstance(value, str) and fqn.rsplit(".", 1)[-1] in _RECORD_NAMES:
                self.hidden.add(fqn)  # a 1-D mesh's checkpoint records no mesh: this run's record stays
                continue
            layout = _saved_rows(value, md)
            if layout is not None:
                saved, plain_saved, now = layout
                self.row_sums[fqn] = _SUMS[id(value)] = _RowSum(value, saved, plain_saved)  # every worker's: all sum
                self.hidden.add(fqn)
                weakref.finalize(value, _SUMS.pop, id(value), None)
                if saved != now:  # (the same number in another layout, a plain one's and rows: an exact copy)
                    saved_of.setdefault((saved, now, plain_saved), fqn)
        for (saved, now, plain_saved), fqn in saved_of.items():
            momentum_mean.warn("dcp.load with lionbit.ElasticLoadPlanner", saved, now, fqn, plain_saved)

    def create_local_plan(self) -> LoadPlan:
        if not self.hidden:
            return super().create_local_plan()
        # DCP's plan for everything else: the rows and layouts hidden from it (its size check would refuse them) ...
        state_dict, metadata = self.state_dict, self.metadata
        self.state_dict = {k: v for k, v in state_dict.items() if k not in self.hidden}
        self.metadata = dataclasses.replace(metadata, state_dict_metadata={
            k: v for k, v in metadata.state_dict_metadata.items() if k not in self.hidden})
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict, self.metadata = state_dict, metadata
        # ... and the saved rows this worker sums.
        items = [item for fqn, rs in self.row_sums.items()
                 for item in create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], rs.chunks())]
        return dataclasses.replace(plan, items=list(plan.items) + items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        rs = self.row_sums.get(read_item.dest_index.fqn)
        if rs is None:
            return super().resolve_tensor(read_item)
        dtype = self.metadata.state_dict_metadata[read_item.dest_index.fqn].properties.dtype
        return torch.empty(tuple(read_item.lengths), dtype=dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        rs = self.row_sums.get(read_item.dest_index.fqn)
        if rs is None:
            super().commit_tensor(read_item, tensor)
            return
        rs.add(read_item, tensor)


def mean_loaded(value) -> Optional[torch.Tensor]:
    """Where ``value`` is a momentum that :class:`ElasticLoadPlanner`
    loaded as a sum of saved rows: the all-reduce of the workers' sums over
    the rows' ranks (a plain momentum's worker has them all), divided by the
    saved workers' number, as a new tensor of ``value``'s local shape and
    dtype (this rank's momentum; the loader
    copies it in once every entry is checked). None for any other value.
    Called by every rank's loader, the parameters in the same order."""
    rs: Optional[_RowSum] = _SUMS.pop(id(value), None) if isinstance(value, torch.Tensor) else None
    if rs is None:  # (an entry leaves _SUMS when its tensor dies, before its id can be reused)
        return None
    local = value.to_local() if isinstance(value, DTensor) else value  # (a plain one's sum: one row of it)
    return momentum_mean.finish(rs.sum, rs.mesh, rs.mesh_dim, rs.saved, local.dtype).view(local.shape)
