"""DistributedLion on FSDP2 (``fully_shard``) models: each rank's own local
gradient in ``p.grad`` after backward, and a 1-bit sign reduce-scatter of
the Lion directions at ``step()`` in place of FSDP's gradient reduce-scatter.

``opt.attach(model)`` installs, on every FSDP unit of the model, a custom
reduce-scatter (FSDP2's ``set_custom_reduce_scatter``) and, on every sharded
parameter, a post-accumulate-grad hook. In backward FSDP hands the custom
reduce-scatter the unit's local unsharded gradients, laid out as N per-rank
chunks (each parameter's dim 0 padded to a multiple of N and cut into N
rows-blocks). It reduces nothing: it copies each parameter's full local
gradient out of that layout (padding dropped, in the dtype FSDP gives the
sharded gradient) and writes zeros into FSDP's output; the hook, which FSDP
calls right after it assigns the sharded gradient, replaces ``p.grad`` by
that local gradient as a DTensor of the parameter's global shape placed
``Replicate()`` (its local tensor is this rank's own gradient; no collective
ever makes it so). (On one rank FSDP calls no reduce-scatter: its own
sharded gradient is then the whole local gradient, and step() reads it
alike.) So, as under DDP, ``p.grad`` after backward is this rank's local
gradient, and ``clip_grad_norm_(model.parameters(), ...)``,
``get_total_norm`` and ``GradScaler.unscale_`` work on it per rank, with no
collective: each rank clips its own gradient by its own norm.

``step()`` (:func:`fsdp_step`) then, for every unit in the order FSDP
reduced them in backward (the same on every rank):

1. packs the Lion direction ``sign(b1 m + (1 - b1) g)`` of every element of
   the gradients as they stand (``p.grad.to_local()``, after any clipping or
   unscaling) into bit-planes, chunk r of FSDP's layout at word
   r * ceil(S / 64) (S = elements per chunk, padding included; padding
   elements are not packed and their results are discarded); the momentum
   is only read;
2. runs lionbit's sign reduce-scatter (phase 1 of the sign all-reduce only:
   an all-to-all of packed shards, then a count / vote of the own shard):
   (N - 1)/N * S*N/8 bytes per rank; it gives Delta of this rank's shard;
3. only after every unit's collective succeeded (a NaN/Inf direction on any
   rank is reported to every rank by the header round: with a GradScaler
   every rank skips the step and backs off, without one every rank raises,
   nothing changed anywhere), updates each parameter's full-size momentum
   from its local gradient and applies ``x = x * (1 - lr * wd) - lr * Delta``
   to the local shard of each DTensor parameter. The next all-gather of
   parameters spreads the update; no phase 2 is needed.

Semantics (the same as DDP + DistributedLion, so both give bitwise the same
parameters from the same seed in float32, with or without clipping):

- ``p.grad`` lives until the user clears it (``zero_grad``), as under DDP;
  a backward without ``zero_grad`` before it adds to it (the custom
  reduce-scatter takes the old local gradient out of FSDP's way and adds
  it to the new one), so gradients accumulate across backward calls,
  synchronized or not; ``model.set_requires_gradient_sync(False)`` on all
  micro-batches but the last accumulates inside FSDP (as DDP's ``no_sync``);
- a parameter whose ``p.grad`` is None at ``step()`` (unused: FSDP did not
  reduce it) is not updated (no weight decay either); DDP with
  ``find_unused_parameters=True`` votes a zero gradient instead: call
  ``model.set_reduce_scatter_unused_params(True)`` for that behaviour;
- memory: the full-size local gradient of every parameter lives from its
  backward until it is cleared (as under DDP), beside the full-size per-rank
  momentum (it follows the local gradient): docs/fsdp.md has the figures.

Checkpoints (lionbit.fsdp_checkpoint): ``opt.state_dict()`` and
``opt.sharded_state_dict()`` present each rank's momentum as one DTensor of
shape (N, *param_shape) sharded on dim 0 of the FSDP mesh, so
``torch.distributed.checkpoint`` stores every rank's own momentum.

Tensor parallelism beside a 1-D FSDP mesh (``fully_shard`` over the dp dim
of a (dp, tp) mesh) or HSDP (over the (replicate, shard) dims of a
(replicate, shard, tp) mesh; lionbit.tensor_parallel): all of the above on
each rank's tensor-parallel-local tensors, which are what FSDP shards and
reduces; ``p.grad`` (1-D) and the checkpoints' rows are placed over the
tensor-parallel dim as the parameter, and the ranks that hold parts of one
worker (a tensor-parallel group; under HSDP the node's shard and
tensor-parallel ranks) agree whether to step.

Expert parallelism (torchtitan's MoE): the experts split over an ep dim and
``fully_shard``-ed over dp_mod_ep, the other parameters over the whole dp
mesh (dp_mod_ep x ep); under HSDP both with the replicate dim first. Each
parameter has its own mesh (``mesh_of``): the experts are handled as
tensor-parallel parameters of the ([replicate,] dp_mod_ep, ep) mesh and
voted over dp_mod_ep (HSDP: their replicate group), the rest over the dp
mesh (its replicate group); each group's units vote together; the ranks
agree over the shard groups and the ep group (whose rounds, after the
votes, reach every rank), and a NonFinite names ranks as the default group
does. On a 1-D mesh a parameter may be sharded Shard(k) for any k
(shard_placement_fn): FSDP's chunk r is then block r along dim k of every
index of the dims before it (:func:`_spans`).
"""

from operator import attrgetter
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import (
    context_parallel,
    fsdp_checkpoint,
    fsdp_plan,
    lion_math,
    step_vote,
    tensor_parallel,
    torch_internals,
)
from ._backend import backend_for
from .attachment import Attachment, take_over
from .voter import end_to_end, runs

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - optional: a torch without FSDP2
    FSDPModule = None

_WHERE = "DistributedLion.attach (FSDP2)"


# -- FSDP2 ------------------------------------------------------------------


def _fsdp2_modules(model) -> list:
    if FSDPModule is None:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp2(model) -> bool:
    return FSDPModule is not None and isinstance(model, FSDPModule)


def check_not_partly_sharded(model) -> None:
    """attach() of a model that is no FSDP2 root but holds fully_shard-ed parts: say so."""
    if _fsdp2_modules(model):
        raise ValueError(
            "DistributedLion.attach: the model contains fully_shard-ed submodules but is not itself "
            "fully_shard-ed; call fully_shard on the root module too and attach the root"
        )


# -- the reduce-scatter ------------------------------------------------------
# (torch's FSDP2 internals that it needs: lionbit.torch_internals)


class _SignReduceScatter(torch_internals.LayoutLearner):
    """The custom reduce-scatter of one FSDP parameter group. On a 1-D mesh
    it takes the unit's local gradients for ``step()`` and reduces nothing.
    On an HSDP mesh it is FSDP's own reduce-scatter over the shard group
    (the node's mean gradient, sharded) and FSDP runs no all-reduce over the
    replicate group after it (``skips_all_reduce``): the replicas vote at
    ``step()`` instead."""

    def __init__(self, att, param_group):
        self.att = att
        self.pg = param_group
        self.skips_all_reduce = att.replicas is not None
        self.layout = None  # (fsdp_params, padded unsharded sizes) of the pending call
        self.params: List = []  # the FSDPParams of the last reduce-scatter, in FSDP's layout order
        self.group = None  # its process group
        self.default_comm = torch_internals.fsdp2_reduce_scatter_comm(param_group, _WHERE)
        self.undo_learning = torch_internals.fsdp2_learn_layouts(param_group, self, _WHERE)
        self._vote_layout = None  # (key, the FSDPParams it holds alive, vote_layout's answer)

    def learn_layout(self, fsdp_params, sizes) -> None:
        """FSDP is about to reduce the unit's gradients, laid out as ``sizes``
        (FSDP does so on every reduction, and calls the custom reduce-scatter
        only on more than one rank: on one, p.grad is FSDP's own, whole)."""
        self.layout = (list(fsdp_params), tuple(sizes))
        self.params = self.layout[0]
        self.att.reduced(self)

    def vote_layout(self, fsdp_params, group, hsdp: bool, chunks: Optional[list] = None):
        """Where the step's vote puts the unit's parameters that have a
        gradient (``fsdp_params``, in FSDP's order) in the chunks of
        ``group``'s ranks: per parameter (its first element in a chunk, this
        rank's elements of it, its spans for Voter.sharded_vote), and a
        chunk's elements. ``chunks``: FSDP's chunks of the vote's ranks, in
        its order, where the vote is over a part of ``group`` (context
        parallelism); all of them by default. The same every step while
        those parameters and the group's size stay (integers only: the
        tensors are read each step)."""
        n, rank = group.size(), group.rank()
        chunks = tuple(range(n)) if chunks is None else tuple(chunks)
        key = (tuple(map(id, fsdp_params)), n, rank, hsdp, chunks)
        if self._vote_layout is not None and self._vote_layout[0] == key:
            return self._vote_layout[2]
        pieces, s = _pieces(fsdp_params, n)
        layout = []
        for fp, off, rows, row in pieces:
            own = sum(count for _, count, _ in _spans(fp, n, rows, row, rank))
            if hsdp:  # g, m: this rank's chunk alone; the replicas hold the same chunk
                spans = [(0, 0, own, off)]
            else:  # FSDP's chunk r of the parameter (Shard(0): its rows [r * rows, (r + 1) * rows)), no padding
                spans = [(i, start, count, off + at)
                         for i, r in enumerate(chunks) for start, count, at in _spans(fp, n, rows, row, r)]
            layout.append((off, own, spans))
        self._vote_layout = (key, list(fsdp_params), (layout, s))
        return layout, s

    def uninstall(self) -> None:
        """Gives FSDP its own reduce-scatter back."""
        self.undo_learning()
        torch_internals.fsdp2_restore_reduce_scatter_comm(self.pg, self.default_comm)

    # FSDP's Comm interface
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        layout, self.layout = self.layout, None
        where = f"DistributedLion (FSDP2 reduce-scatter) on rank {dist.get_rank()}"
        if layout is None:
            raise RuntimeError(f"{where}: called without FSDP's gradient layout (an unsupported FSDP code path)")
        if self.skips_all_reduce:  # HSDP: FSDP's own reduction inside the node, unchanged
            self.group = group
            return self.default_comm(output_tensor, input_tensor, group, op, async_op)
        if async_op:
            raise NotImplementedError(f"{where}: async_op=True is not supported")
        if not _unscaled(op, input_tensor.dtype):
            raise RuntimeError(
                f"{where}: FSDP reduces {input_tensor.dtype} gradients with {op}, dividing them before the "
                f"reduction, which would change the local gradient; reduce in float32 or bfloat16"
            )
        mesh = _unit_mesh(self.att, self)
        if mesh.cp is not None or mesh.cp_parts > 1:  # the worker's gradient, its cp ranks' (context_parallel)
            mean = context_parallel.averages(torch_internals.fsdp2_divide_factor(self.pg), group.size(), where)
            if mesh.cp is not None:
                mesh.cp.worker_gradient(input_tensor, mean)
            elif mean:  # experts whose ep group gathered the cp ranks' tokens: the sum of their chunks' losses'
                input_tensor.div_(mesh.cp_parts)
        fsdp_capture(self.att, layout, input_tensor, output_tensor, group, where)
        self.group = group
        return None


def _sign_comm(install) -> Optional[_SignReduceScatter]:
    """The (module, FSDP parameter group)'s reduce-scatter where it is lionbit's."""
    comm = torch_internals.fsdp2_reduce_scatter_comm(install[1], _WHERE)
    return comm if isinstance(comm, _SignReduceScatter) else None


def _unscaled(op, dtype) -> bool:
    """Whether FSDP handed its reduce-scatter the local gradients as they
    are. FSDP divides them before the reduction only where it reduces with
    SUM in a dtype other than float32 / bfloat16 (float16: it splits the
    division around the sum); AVG and PREMUL_SUM (a divide factor, such as
    torchtitan's 1.0) carry the division inside the collective, and SUM in
    float32 / bfloat16 (set_force_sum_reduction_for_comms) divides after it."""
    if op == dist.ReduceOp.AVG or op == dist.ReduceOp.PREMUL_SUM:
        return True
    return op == dist.ReduceOp.SUM and dtype in (torch.float32, torch.bfloat16)


class FSDP2Attachment(Attachment):
    """An FSDP2 model's attachment: lionbit's reduce-scatter on every FSDP
    parameter group (it keeps each rank's local gradients for ``p.grad``),
    the hooks that put them there, each parameter's full-size momentum, and
    the order of the units' votes at ``step()``."""

    kind = "FSDP2"

    @staticmethod
    def accepts(model) -> bool:
        return is_fsdp2(model)

    def __init__(self, opt, model, overlap: bool = True, context_parallel=None):
        self.managed, self.fqns, installs, mesh, self.mesh_of = _managed(opt, model, context_parallel)
        self.dp = mesh  # how the ranks shard and vote (_Mesh); with expert parallelism the whole dp mesh's
        # each parameter's _Mesh: dp's, or (expert parallelism) the experts' mesh for theirs
        kinds = list(dict.fromkeys(self.mesh_of.values()))
        self.multi = len(kinds) > 1
        # the groups whose ranks hold parts of one worker, and agree whether to step, in turn
        self.agree = tuple(dict.fromkeys(g for m in kinds for g in m.agree))
        # HSDP: the replicate group, over which the replicas vote; None on a 1-D mesh.
        self.replicas = mesh.replicas
        # a 1-D mesh: the optimizer's group, if it names one
        own = mesh.replicas is None and mesh.tp is None and mesh.cp is None and not self.multi
        super().__init__(opt, opt.group if opt.group is not None and own else mesh.vote_group)
        self.model = model
        self.mesh = mesh.device_mesh  # FSDP's
        self.mesh_size = self.mesh.size()  # (DeviceMesh.size() is not a stored number)
        # the parameters tensor parallelism splits (their mesh has a dim beside FSDP's)
        self.split = {p for p in self.managed if p.device_mesh.ndim > self.mesh_of[p].device_mesh.ndim}
        # 1-D: a split parameter -> how its local gradient is placed (Replicate() over FSDP's dim)
        self.tp = {p: tensor_parallel.grad_placements(p) for p in self.split if mesh.replicas is None}
        # sharded parameter -> its local gradient, from the reduce-scatter
        # until FSDP's grad hook puts it into p.grad
        self.captured: Dict[torch.Tensor, torch.Tensor] = {}
        self.order: List[_SignReduceScatter] = []  # units in the order of their last reduce-scatters
        self.stepped = True  # a step() came after the last reduce-scatter (the next one starts a new order)
        self.comms = []
        self.plan = fsdp_plan.FSDP2Plan()  # the step, replayed where it is the step before again
        take_over(c.att for c in map(_sign_comm, installs) if c is not None)
        for module, pg in installs:
            comm = _SignReduceScatter(self, pg)
            torch_internals.fsdp2_set_reduce_scatter_comm(module, pg, comm, _WHERE)
            self.comms.append(comm)
        # 1-D: p.grad becomes the local gradient. HSDP: p.grad is FSDP's own (the node's mean, sharded).
        self.hooks = {}  # parameter -> its grad hook's handle
        if self.replicas is None:
            for p in self.managed:
                if p.requires_grad:  # (a frozen one's when it first has a gradient: fsdp_capture)
                    self.hook(p)

    def is_attached_to(self, model) -> bool:
        return model is self.model

    def holds_local_gradients(self) -> bool:
        return not self.stepped  # (a reduce-scatter of lionbit's since the last step)

    def detach(self) -> None:
        for comm in self.comms:
            comm.uninstall()
        for h in self.hooks.values():
            h.remove()
        self.comms, self.hooks, self.order, self.captured = [], {}, [], {}
        self.plan = fsdp_plan.FSDP2Plan()

    def reduced(self, comm: _SignReduceScatter) -> None:
        """A unit's reduce-scatter ran: note its place in the order of votes."""
        if self.stepped:
            self.order, self.stepped = [], False
        if comm not in self.order:
            self.order.append(comm)

    def hook(self, p: torch.Tensor) -> None:
        """Registers :meth:`grad_hook` on p once (torch refuses a hook on a
        parameter that does not require a gradient: a frozen one gets its
        hook when it first has a gradient to reduce)."""
        if p not in self.hooks:
            self.hooks[p] = p.register_post_accumulate_grad_hook(self.grad_hook)

    def grad_hook(self, p: torch.Tensor) -> None:
        """FSDP assigned p's sharded gradient (zeros): put the local one in its place."""
        full = self.captured.pop(p, None)
        if full is None:
            return
        placements = self.tp.get(p)
        if placements is None:
            p.grad = DTensor.from_local(full, p.device_mesh, [Replicate()], run_check=False)
        else:  # its tensor-parallel part of this rank's gradient, the global shape the parameter's
            p.grad = DTensor.from_local(full, p.device_mesh, placements, run_check=False, shape=p.shape,
                                        stride=p.stride())

    def step(self, grad_scaler=None, abstain: bool = False) -> bool:
        return fsdp_step(self, grad_scaler)

    def momenta(self):
        return [
            self.momentum(p) for g in self.opt.param_groups for p in g["params"]
            if p in self.managed and p.requires_grad
        ]

    def momentum_groups(self) -> list:
        """With expert parallelism each mesh's momenta average over its own
        vote group (the experts' over the dp ranks that hold the same experts)."""
        if not self.multi:
            return super().momentum_groups()
        momenta = self.momenta()  # (every one created, in the optimizer's order)
        trained = [p for g in self.opt.param_groups for p in g["params"] if p in self.managed and p.requires_grad]
        by_group = {}
        for p, m in zip(trained, momenta):
            by_group.setdefault(self.mesh_of[p].vote_group, []).append(m)
        return [(ms, group) for group, ms in by_group.items()]

    def flat_momenta(self, ps: list) -> list:
        """:meth:`momentum` of each of ps, flat (1-D views): an existing one
        read from the state without its shape's lookup."""
        state = self.opt.state
        out = []
        for p in ps:
            m = state[p].get("exp_avg")
            out.append((self.momentum(p) if m is None else m).view(-1))
        return out

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """p's momentum: full-size on a 1-D mesh (it follows this rank's local
        gradient; with tensor parallelism, its tensor-parallel part); on HSDP
        this rank's shard of its node's momentum (the shape of p's local
        shard)."""
        if self.replicas is not None:
            return self.opt.momentum_of(p, p.to_local().shape)
        return self.opt.momentum_of(p, torch_internals.fsdp2_orig_size(self.managed[p]))

    def marker(self):
        return {"rank": self.dp.row, "world_size": self.dp.rows}

    def state_dict(self) -> dict:
        return fsdp_checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        fsdp_checkpoint.load_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict:
        return fsdp_checkpoint.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        fsdp_checkpoint.load_sharded_state_dict(self, state_dict)


class _OneRank:
    """The shard group of FSDP2's replicate(), which shards over no one:
    FSDP's chunk layout over this rank alone."""

    @staticmethod
    def size() -> int:
        return 1

    @staticmethod
    def rank() -> int:
        return 0


_ALONE = _OneRank()


class _Mesh:
    """How the ranks of an FSDP2 model shard and vote, the one thing the 1-D
    and the HSDP case do differently.

    1-D mesh of N ranks: every rank is a worker. It packs the directions of
    all N chunks of its local gradient (full-size momentum) and the sign
    reduce-scatter over the FSDP group gives Delta of its shard.

    HSDP, a 2-D mesh (replicate, shard) of M x L ranks: every replica (the L
    ranks of one replicate index, a node) is a worker. FSDP's own
    reduce-scatter gives each rank its shard of the node's mean gradient;
    the rank packs the direction of that shard alone (its shard of the
    node's momentum) and the sign all-reduce over the replicate group (the
    M ranks holding the same shard) gives Delta of the shard.

    FSDP2's replicate() (a 1-D mesh of DDPMeshInfo, parameters placed
    Replicate()) is HSDP with one rank a node: FSDP's reduction inside the
    node is a copy, each rank a worker with its own local gradient and a
    full-size momentum, and the replicate group votes, as under DDP.

    Either way the unit's layout is FSDP's chunk layout over the L (= N)
    ranks of the shard group, Delta is this rank's chunk, and the apply is
    the same. In a checkpoint the momentum has one row per worker
    (``rows``; this rank's worker is ``row``).

    Tensor parallelism beside either (``tp``: the group of the
    tensor-parallel dim, the mesh's last; a (dp, tp) mesh of N x P ranks, or
    (replicate, shard, tp) of M x L x P): the same on the
    tensor-parallel-local tensors. A worker is the P ranks of one dp index
    (under HSDP the L x P ranks of a node): each rank holds the part of the
    worker's gradient and momentum that its tensor-parallel rank computes
    (its shard of it), and the ranks of one tensor-parallel index vote on
    that part. The ranks of a worker step or skip together: ``agree``, the
    groups they agree over in turn.

    Context parallelism beside a 1-D mesh (``cp``, lionbit.context_parallel):
    a worker is the cp ranks of one dp index, each with the worker's whole
    gradient and momentum; each votes FSDP's chunks of the dp ranks of its
    cp index over their group (``vote_group``), and the cp ranks agree. An
    experts' mesh beside it, whose ep group spans the cp ranks, needs no
    cp round: its local gradients already gather the worker's cp ranks'
    tokens (``cp_parts`` of them, each its own chunk's loss)."""

    def __init__(self, device_mesh, replicate_dim: Optional[int], tp=None):
        self.device_mesh = device_mesh  # FSDP's mesh
        self.replicas = None if replicate_dim is None else device_mesh.get_group(replicate_dim)
        if replicate_dim is not None and device_mesh.ndim == 1:
            self.shard_group = _ALONE  # FSDP2's replicate(): no shard dim, a node is one rank
        else:
            self.shard_group = device_mesh.get_group(0 if replicate_dim is None else 1 - replicate_dim)
        self.tp = tp
        self.vote_group = self.shard_group if self.replicas is None else self.replicas
        # the groups whose ranks hold parts of one worker, and agree whether to step (in turn: HSDP's
        # node is its shard groups' ranks, with tensor parallelism each shard's tensor-parallel ranks)
        node = (self.shard_group,) if self.replicas is not None and self.shard_group is not _ALONE else ()
        self.agree = node + ((tp,) if tp is not None else ())
        self.shards, self.shard = self.shard_group.size(), self.shard_group.rank()
        workers = self.shard_group if self.replicas is None else self.replicas
        self.rows, self.row = workers.size(), workers.rank()
        self.cp: Optional[context_parallel.ContextParallel] = None
        # expert parallelism beside context parallelism: the cp ranks whose tokens this mesh's local
        # gradients gather (its ep group spans them), each a loss of its own chunk
        self.cp_parts = 1

    def split_context(self, cp) -> None:
        """Context parallelism beside this 1-D mesh: each rank votes its cp
        index's chunks over ``cp.vote``, and the cp ranks agree."""
        self.cp = cp
        self.vote_group = cp.vote
        self.agree = self.agree + (cp.group,)

    def describe(self) -> str:
        own = describe_mesh(self.device_mesh)
        if self.cp is not None:
            own = f"{own} (dp x {self.cp.size} context parallel)"
        return own if self.tp is None else f"{own} x {self.tp.size()} (tensor parallel)"


def describe_mesh(mesh) -> str:
    """A mesh as errors name it: '2x2 (replicate, shard)', '4 (shard)'."""
    shape = "x".join(str(n) for n in mesh.shape)
    if mesh.mesh_dim_names:
        return f"{shape} ({', '.join(mesh.mesh_dim_names)})"
    return f"{shape} (1-D)" if mesh.ndim == 1 else f"{shape} (unnamed dims)"


def _mesh_kind(fp, p, name: str):
    """(the replicate dim of p's FSDP mesh: None on a 1-D FSDP mesh, 0 on
    HSDP and FSDP2's replicate(); the group of p's tensor-parallel dim, None without one), or a
    clear error naming what works for any other mesh."""
    mesh, kind = p.device_mesh, type(fp.mesh_info).__name__
    works = ("supported: a 1-D FSDP mesh or HSDP (fully_shard over a 2-D mesh (replicate, shard)), each with or "
             "without tensor parallelism beside it (fully_shard over mesh['dp'] or mesh['replicate', 'shard'] of a "
             "mesh whose last dim is tp)")
    spmd = getattr(fp.mesh_info, "is_spmd_mesh", False) and not _spmd_as_plain(fp, mesh)
    if kind == "FSDPMeshInfo" and fp.mesh_info.mesh.ndim == 1 and not spmd:
        if mesh.ndim == 1:
            if len(p.placements) != 1 or not isinstance(p.placements[0], Shard):  # (shard_placement_fn: Shard(k))
                raise NotImplementedError(
                    f"{_WHERE}: parameter '{name}' is sharded as {tuple(p.placements)}; only Shard(k) is supported"
                )
            return None, None
        if mesh.ndim == 2:
            tensor_parallel.check_placements(p, name, _WHERE)
            return None, mesh.get_group(1)
    if kind == "HSDPMeshInfo" and fp.mesh_info.mesh.ndim == 2 and mesh.ndim == 3 and not spmd:
        tensor_parallel.check_placements(p, name, _WHERE, hsdp=True)
        return 0, mesh.get_group(2)
    if kind == "HSDPMeshInfo" and mesh.ndim == 2 and not spmd:
        placements = tuple(p.placements)
        if len(placements) != 2 or placements[0] != Replicate() or not isinstance(placements[1], Shard):
            raise NotImplementedError(
                f"{_WHERE}: parameter '{name}' is placed {placements} on the HSDP mesh "
                f"{describe_mesh(mesh)}; only (Replicate(), Shard(k)) is supported"
            )
        return 0, None
    if kind == "DDPMeshInfo" and fp.mesh_info.mesh.ndim == 1 and mesh.ndim == 1 and not spmd:
        if tuple(p.placements) != (Replicate(),):  # FSDP2's replicate(): each rank holds the whole parameter
            raise NotImplementedError(
                f"{_WHERE}: parameter '{name}' is placed {tuple(p.placements)} by FSDP2's replicate() over "
                f"{describe_mesh(mesh)}; only Replicate() is supported"
            )
        return 0, None
    if kind == "DDPMeshInfo" and fp.mesh_info.mesh.ndim == 1 and mesh.ndim == 2 and not spmd:
        tensor_parallel.check_placements(p, name, _WHERE, replicated=True)  # replicate() beside tensor parallelism
        return 0, mesh.get_group(1)
    if kind == "DDPMeshInfo":
        raise NotImplementedError(
            f"{_WHERE}: parameter '{name}' is replicated by FSDP2's replicate() over {describe_mesh(mesh)}, "
            f"which is not supported; {works}, or FSDP2's replicate() over a 1-D mesh (with or without tensor "
            f"parallelism beside it)"
        )
    storage = (", dp_mesh_dims with several replicate dims, or a storage mesh whose dims are not "
               "[replicate,] shard dims[, tp or ep]") if spmd else ""
    raise NotImplementedError(
        f"{_WHERE}: parameter '{name}' lives on the {mesh.ndim}-D mesh {describe_mesh(mesh)} ({kind}{storage}"
        f": FSDP with another layout), which is not supported; {works}"
    )


def _spmd_as_plain(fp, mesh) -> bool:
    """Whether a parameter that fully_shard(..., dp_mesh_dims=...) placed on
    a storage mesh (torchtitan's spmd_types backend, its default) lies as it
    would without dp_mesh_dims: FSDP or HSDP over one shard dim (and one
    replicate dim) on a storage mesh of those dims in that order, with at
    most one dim after them (torchtitan's tp of the dense storage mesh, its
    ep of the experts'). Then FSDP keeps p on the storage mesh exactly as on
    the plain meshes (tensor and expert parallelism included: the same
    placements on a mesh of the same dims) and reduces alike. Several shard
    dims (context parallelism folded into FSDP's: shard=("dp_shard", "cp"))
    FSDP flattens into one ("dp_shard_cp"), p's mesh being that dim's
    (and the replicate and tensor-parallel dims'): the plain meshes'
    too."""
    dims = fp.mesh_info.dp_mesh_dims
    if type(fp.mesh_info).__name__ not in ("FSDPMeshInfo", "HSDPMeshInfo") or dims is None:
        return False
    shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
    names = tuple(mesh.mesh_dim_names or ())
    return (len(shard) >= 1 and len(replicate) <= 1 and names[:len(replicate) + 1] == replicate + ("_".join(shard),)
            and len(names) <= len(replicate) + 2)


def _folded_shard_dims(fp) -> tuple:
    """The dims FSDP shards a 1-D (non-HSDP) unit over, where it shards
    over several of a storage mesh (spmd_types: dp_mesh_dims' shard
    names, context parallelism folded in); () otherwise."""
    dims = getattr(fp.mesh_info, "dp_mesh_dims", None)
    if dims is None or type(fp.mesh_info).__name__ != "FSDPMeshInfo" or len(dims.shard_names) < 2:
        return ()
    return tuple(dims.shard_names)


def _managed(opt, model, cp=None):
    """Checks an FSDP2 model; returns (sharded parameter -> FSDPParam,
    parameter -> name, [(module, FSDP parameter group)], its _Mesh), the
    context-parallel group ``cp`` (attach's argument) taken in."""
    modules = _fsdp2_modules(model)
    fqns = {p: n for n, p in model.named_parameters()}
    known = opt.param_group_of()
    managed = {}
    installs = []
    kinds = {}  # (replicate dim, FSDP mesh) -> a parameter's name
    kind_of = {}  # parameter -> (replicate dim, FSDP mesh)
    tp_of_kind = {}  # (replicate dim, FSDP mesh) -> (its tensor-parallel group, a split parameter's name, its mesh)
    for module in modules:
        pgs = torch_internals.fsdp2_param_groups(module, _WHERE)
        if not pgs:
            continue
        for pg in pgs:
            comm = torch_internals.fsdp2_reduce_scatter_comm(pg, _WHERE)
            if isinstance(comm, _SignReduceScatter):
                comm = comm.default_comm  # another DistributedLion's: taken over at install
            if type(comm).__name__ != "DefaultReduceScatter":
                raise ValueError(
                    f"{_WHERE}: FSDP unit '{torch_internals.fsdp2_unit_name(pg)}' already has a custom "
                    f"reduce-scatter ({type(comm).__name__}); lionbit needs to install its own"
                )
            if torch_internals.fsdp2_all_reduce_hook(pg) is not None:
                raise ValueError(
                    f"{_WHERE}: set_all_reduce_hook is not supported (the output is Lion's update, not a gradient)"
                )
            for fp in pg.fsdp_params:
                p = fp.sharded_param
                name = fqns.get(p, "<unnamed>")
                if not isinstance(p, DTensor):
                    raise ValueError(f"{_WHERE}: parameter '{name}' is not a DTensor (unexpected FSDP state)")
                replicate_dim, tp = _mesh_kind(fp, p, name)
                kind = (replicate_dim, fp.mesh_info.mesh)
                kinds.setdefault(kind, name)
                kind_of[p] = kind
                if tp is not None:
                    other = tp_of_kind.setdefault(kind, (tp, name, p.device_mesh))
                    if other[0] is not tp and _ranks(other[0]) != _ranks(tp):  # (torch may hand out twins)
                        raise NotImplementedError(
                            f"{_WHERE}: parameters '{other[1]}' and '{name}' are sharded over one FSDP mesh and "
                            f"split over different tensor-parallel groups; DistributedLion votes a mesh's "
                            f"parameters over one (dp, tp) mesh"
                        )
                if fp.offload_to_cpu:
                    raise NotImplementedError(f"{_WHERE}: CPUOffloadPolicy is not supported (parameter '{name}')")
                opt.check_params([p], "attach (FSDP2)")  # CPU, or CUDA where this build has the CUDA path
                if len(torch_internals.fsdp2_orig_size(fp)) == 0:
                    raise NotImplementedError(f"{_WHERE}: 0-dim parameter '{name}' is not supported")
                if p.requires_grad and p not in known:
                    raise ValueError(
                        f"{_WHERE}: the FSDP model's parameter '{name}' is not in this optimizer; "
                        f"it would be voted with no momentum or hyperparameters"
                    )
                managed[p] = fp
            installs.append((module, pg))
    if not modules or not managed:
        raise ValueError(f"{_WHERE}: the model has no fully_shard-ed parameters")
    unsharded = [fqns[p] for p in known if p not in managed and p in fqns]
    if unsharded:  # the root is fully_shard-ed, so FSDP left them out on purpose
        raise ValueError(
            f"{_WHERE}: this optimizer's parameters {unsharded[:5]} are the model's but not sharded by FSDP "
            f"(fully_shard's ignored_params): FSDP reduces no gradient of theirs and DistributedLion steps only "
            f"FSDP's parameters; let FSDP shard them, or leave them out of this optimizer"
        )
    strangers = sum(p not in managed for p in known)
    if strangers:
        raise ValueError(
            f"{_WHERE}: {strangers} of this optimizer's parameters are not parameters of the model it is attached to"
        )
    by_kind = {kind: _Mesh(kind[1], kind[0], tp_of_kind.get(kind, (None,))[0]) for kind in kinds}
    if len(kinds) > 1:
        # each mesh's ranks that hold parts of this rank's worker (with its tensor-parallel dim, if any)
        spans = {kind: _worker_ranks(tp_of_kind[kind][2] if kind in tp_of_kind else kind[1], kind[0] is not None)
                 for kind in kinds}
        mesh = _widest(by_kind, kinds, spans)
    else:
        mesh = next(iter(by_kind.values()))
    meshes = {p: by_kind[kind_of[p]] for p in managed}
    first = next(iter(managed))
    if cp is None:
        _check_no_context(mesh, next(fp for p, fp in managed.items() if meshes[p] is mesh))
    else:
        _context_parallel(opt, mesh, list(by_kind.values()), cp, [pg for _, pg in installs], first.device)
    split = next((m for m in by_kind.values() if m.tp is not None), mesh)  # (the one with a tensor-parallel dim)
    # the vote's groups must be lionbit's (a clear error otherwise); HSDP: the replicate group
    for each in by_kind.values():
        backend_for(each.vote_group, first.device, "attach (FSDP2)")
    if mesh.replicas is not None and opt.aggregation == "l1":
        raise NotImplementedError(
            f"{_WHERE}: argument 'aggregation'='l1' is not supported on HSDP (rank {dist.get_rank()}, mesh "
            f"{mesh.describe()}): its L1 scale is per tensor, and a rank holds only its shard of the node's; "
            f"use 'vote' or 'avg'"
        )
    if split.tp is not None and split.replicas is None and opt.aggregation == "l1":
        raise NotImplementedError(
            f"{_WHERE}: argument 'aggregation'='l1' is not supported with tensor parallelism (rank "
            f"{dist.get_rank()}, mesh {split.describe()}): its L1 scale is per tensor, and a rank holds only its "
            f"tensor-parallel part of the gradient; use 'vote' or 'avg'"
        )
    if mesh.replicas is not None and getattr(opt.voter, "hierarchy", "flat") != "flat":
        raise ValueError(
            f"{_WHERE}: argument 'hierarchy'={opt.voter.hierarchy!r} does not apply to HSDP (rank "
            f"{dist.get_rank()}, mesh {mesh.describe()}): the replicas already vote over the replicate group, one "
            f"rank a node; use hierarchy='flat'"
        )
    if split.tp is not None and split.replicas is None and getattr(opt.voter, "hierarchy", "flat") != "flat":
        raise ValueError(
            f"{_WHERE}: argument 'hierarchy'={opt.voter.hierarchy!r} is not supported with tensor parallelism "
            f"(rank {dist.get_rank()}, mesh {split.describe()}): the vote runs over the dp group of each "
            f"tensor-parallel rank; use hierarchy='flat'"
        )
    return managed, fqns, installs, mesh, meshes


def _check_no_context(mesh: "_Mesh", fp) -> None:
    """A clear error where a 1-D FSDP mesh has context-parallel ranks folded
    in that attach was not told of (each would vote as a worker with a part
    of a sequence): shard dims of a storage mesh, or a mesh flattened from
    one with a "cp" dim (lionbit.context_parallel.folded)."""
    if mesh.replicas is not None or mesh.shard_group is _ALONE:
        return  # HSDP: a node (cp ranks included) is one worker anyway
    dims = _folded_shard_dims(fp)
    cp = context_parallel.folded(mesh.device_mesh) if not dims else None
    if dims or cp is not None:
        what = (f"over the storage mesh dims {dims}" if dims else
                f"over a mesh flattened from one whose 'cp' dim's ranks {sorted(_ranks(cp))} are in it")
        raise ValueError(
            f"{_WHERE} on rank {dist.get_rank()}: FSDP shards {what}: context parallelism, whose ranks split a "
            f"sequence and are one Distributed Lion worker; tell attach which ranks they are: "
            f"opt.attach(model, context_parallel=mesh['cp'])"
        )


def _context_parallel(opt, mesh: "_Mesh", meshes: list, cp, pgs: list, device: torch.device) -> None:
    """attach's ``context_parallel`` on the model's mesh (the dp mesh of
    ``meshes``): on a 1-D mesh the cp ranks of a worker
    (lionbit.context_parallel), an experts' mesh beside it gathering their
    tokens (its ep group spanning them); under HSDP the node holds them
    already (a clear error unless the cp group is in it); a clear error for
    what is not supported with it."""
    where = f"{_WHERE} on rank {dist.get_rank()}"
    group = context_parallel.group_of(cp, where)
    experts = [m for m in meshes if m is not mesh]
    if mesh.replicas is None and group.size() > 1:
        for other in experts:
            if _ranks(group) & _ranks(other.shard_group) != {dist.get_rank()}:
                raise NotImplementedError(
                    f"{where}: argument 'context_parallel' (ranks {sorted(_ranks(group))}) beside experts whose "
                    f"FSDP group {sorted(_ranks(other.shard_group))} holds cp ranks of this rank's worker is not "
                    f"supported; the expert-parallel dim must span the cp ranks (torchtitan's, when ep >= cp x tp)"
                )
            other.cp_parts = group.size()
    if mesh.replicas is not None:
        if mesh.shard_group is _ALONE or not _ranks(group) <= _ranks(mesh.shard_group):
            raise ValueError(
                f"{where}: argument 'context_parallel' (ranks {sorted(_ranks(group))}) is not inside this rank's "
                f"node of the mesh {mesh.describe()}: under HSDP the cp ranks are part of FSDP's shard dim "
                f"(fully_shard over mesh['dp_replicate', 'fsdp'], fsdp = dp_shard x cp)"
            )
        return  # the node (its shard group, the cp ranks in it) is one worker already
    if group.size() == 1:
        return
    for pg in pgs:  # (checked again at each reduce-scatter: a factor set after attach)
        context_parallel.averages(torch_internals.fsdp2_divide_factor(pg), torch_internals.fsdp2_shards(pg), where)
    if opt.aggregation == "l1":
        raise NotImplementedError(
            f"{where}: argument 'aggregation'='l1' is not supported with context parallelism: its L1 scale is "
            f"per tensor, and each cp rank votes a part of the tensors; use 'vote' or 'avg'"
        )
    if getattr(opt.voter, "hierarchy", "flat") != "flat":
        raise ValueError(
            f"{where}: argument 'hierarchy'={opt.voter.hierarchy!r} is not supported with context parallelism "
            f"(the vote runs over the dp ranks of each cp index); use hierarchy='flat'"
        )
    mesh.split_context(context_parallel.ContextParallel(group, mesh.shard_group, where, device))


def _ranks(group) -> frozenset:
    return frozenset(dist.get_process_group_ranks(group))


def _worker_ranks(mesh, replicated: bool) -> frozenset:
    """The ranks of ``mesh`` that hold parts of this rank's worker: all of
    them; with a replicate dim (HSDP's, the first) those of this rank's
    replicate index."""
    ranks = mesh.mesh
    if replicated:
        ranks = ranks[mesh.get_coordinate()[0]]
    return frozenset(ranks.flatten().tolist())


def _widest(by_kind: dict, names: dict, spans: dict):
    """Parameters on more than one FSDP mesh (torchtitan's expert
    parallelism: the experts ``fully_shard``-ed over mesh["efsdp"] (its
    older dp_mod_ep) as DTensors split over mesh["ep"], the rest over the
    whole dp mesh, with or without tensor parallelism beside it; under HSDP
    over mesh["dp_replicate", "efsdp"] and mesh["dp_replicate", "dp_shard"]):
    the dp mesh (the one with the largest shard group, the first seen among
    equals), or a clear error. Each mesh with its tensor-parallel
    (expert-parallel) dim must span the same ranks as the dp mesh with its
    own (a node's under HSDP, with the same replicate group), the others
    with such a dim: a rank's votes over its meshes, then one round over
    each tensor- or expert-parallel group, reach every rank, so all of them
    step or skip together (torchtitan's sparse mesh: efsdp x ep = dp x tp,
    ep spanning the tensor-parallel ranks)."""
    widest = max(by_kind.values(), key=lambda m: m.shard_group.size())
    name_of = {id(m): names[kind] for kind, m in by_kind.items()}
    span = {id(m): spans[kind] for kind, m in by_kind.items()}
    alone = any(m.shard_group is _ALONE for m in by_kind.values())  # (FSDP2's replicate(): no shard group)
    everyone = set() if alone else span[id(widest)]
    for m in by_kind.values():
        if m is widest:
            continue
        fits = (not alone and m.tp is not None
                and (m.replicas is None) == (widest.replicas is None)
                and span[id(m)] == everyone
                and m.shard_group.size() * m.tp.size() == len(everyone)
                and (m.replicas is None or _ranks(m.replicas) == _ranks(widest.replicas)))
        if not fits:
            raise NotImplementedError(
                f"{_WHERE}: parameters '{name_of[id(widest)]}' and '{name_of[id(m)]}' are sharded over different "
                f"meshes ({widest.describe()} and {m.describe()}); one optimizer votes over one FSDP mesh, or, "
                f"with expert parallelism, over a dp mesh (1-D or HSDP, with or without tensor parallelism) and "
                f"meshes of the same ranks with the expert-parallel dim beside them (torchtitan's efsdp x ep)"
            )
    return widest


def _pieces(fsdp_params, n: int):
    """FSDP's layout of a unit on n ranks: per parameter (FSDPParam, offset
    in the chunk, rows per chunk, elements per row); and the chunk's size.
    FSDP cuts a parameter sharded Shard(0) into dim-0 row-blocks (dim 0
    padded to a multiple of n); one sharded Shard(k), k > 0, into its n
    blocks along dim k (evenly: FSDP requires it), each made contiguous and
    stacked on dim 0: then a chunk holds dim 0's rows whole, each row 1/n of
    its elements."""
    pieces, off = [], 0
    for fp in fsdp_params:
        size = torch_internals.fsdp2_orig_size(fp)
        row = 1
        for d in size[1:]:
            row *= d
        if torch_internals.fsdp2_shard_dim(fp):
            rows, row = size[0], row // n
        else:
            rows = -(-size[0] // n)  # dim 0 padded to a multiple of n
        pieces.append((fp, off, rows, row))
        off += rows * row
    return pieces, off


def _spans(fp, n: int, rows: int, row: int, r: int) -> list:
    """Where chunk r of FSDP's layout (:func:`_pieces`) finds the
    parameter's elements in its full flat tensor: (start, elements, at
    which element of the parameter's piece of the chunk), padding left out.
    Shard(0): one run of rows; Shard(k): a run per index of the dims before
    k (a 3-D expert tensor sharded on dim 1: one per expert)."""
    size = torch_internals.fsdp2_orig_size(fp)
    k = torch_internals.fsdp2_shard_dim(fp)
    if not k:
        return [(r * rows * row, max(0, min(rows, size[0] - r * rows)) * row, 0)]
    outer = 1
    for d in size[:k]:
        outer *= d
    block = rows * row // outer  # a chunk's elements of one index of the dims before k
    return [(o * block * n + r * block, block, o * block) for o in range(outer)]


def fsdp_capture(att, layout, inp, out, group, where) -> None:
    """The custom reduce-scatter's work in backward: each parameter's full
    local gradient out of FSDP's chunk layout (plus the local gradient that
    p.grad still held: DDP's accumulation), kept for the grad hook; zeros
    into FSDP's output. No collective."""
    fsdp_params, sizes = layout
    n = group.size()
    s = out.numel()
    pieces, total = _pieces(fsdp_params, n)
    if inp.numel() != n * s or total != s or [rows * n for _, _, rows, _ in pieces] != [z[0] for z in sizes]:
        raise RuntimeError(
            f"{where}: FSDP's layout ({inp.numel()} elements in, {s} out, padded sizes {[tuple(z) for z in sizes]}) "
            f"is not the one lionbit expects ({n} chunks of {total})"
        )
    gin = inp.view(n, s)
    for fp, off, rows, row in pieces:
        p = fp.sharded_param
        old = p.grad
        if isinstance(old, DTensor) and _is_local_grad(att, p, old):
            # This rank's local gradient from an earlier backward (no
            # zero_grad since): FSDP would add its sharded gradient into it.
            old = old.to_local()
            p.grad = None
        else:
            old = None
        dtype = getattr(fp, "sharded_grad_dtype", None) or p.dtype  # the dtype FSDP gives p.grad
        shape = torch_internals.fsdp2_orig_size(fp)
        full = torch.empty(shape, dtype=dtype, device=inp.device)
        flat = full.view(-1)
        for r in range(n):
            for start, count, at in _spans(fp, n, rows, row, r):
                if count:
                    flat[start : start + count].copy_(gin[r, off + at : off + at + count])
        if old is not None:
            full.add_(old.reshape(full.shape))
        att.captured[p] = full
        att.hook(p)  # (a parameter frozen at attach() and trained since)
    out.zero_()


def _replicated(t) -> bool:
    """Whether DTensor t is placed (Replicate(),), without comparing a Replicate
    to another placement type (3 us through pybind11, against 0.1 for an isinstance)."""
    placements = t.placements
    return len(placements) == 1 and isinstance(placements[0], Replicate)


def _is_local_grad(att, p, g) -> bool:
    """Whether DTensor g is placed as the grad hook places p's local
    gradient: Replicate() (and with tensor parallelism, as p over the
    tensor-parallel dim)."""
    placements = att.tp.get(p)
    return _replicated(g) if placements is None else tuple(g.placements) == placements


def _mesh_size(att, mesh) -> int:
    """mesh.size(), the attachment's own mesh's read once."""
    return att.mesh_size if mesh is att.mesh else mesh.size()


_sharded_param = attrgetter("sharded_param")


def _local_grads(att, ps: list) -> list:
    """:func:`_local_grad` of each parameter that requires a gradient, None for
    the others: on a 1-D mesh a gradient that is a DTensor placed
    Replicate() (or on a mesh of one rank) with the parameter's shape (what
    step() finds after every backward) is read without the general path's
    calls."""
    out = []
    fast = att.replicas is None
    alone = att.mesh_size == 1  # (FSDP on one rank places its gradients Shard(0))
    for p in ps:
        g = p.grad if p.requires_grad else None
        if g is None:
            out.append(None)
            continue
        if fast and type(g) is DTensor and ((alone and g.device_mesh is att.mesh) or _replicated(g)):
            local = torch_internals.dtensor_local(g)
            if local.shape == p.shape:
                out.append(local)
                continue
        out.append(_local_grad(att, p))  # every other case, and the errors
    return out


def _local_grad(att, p: torch.Tensor) -> Optional[torch.Tensor]:
    """p's local gradient as step() reads it: the local tensor of p.grad
    (None: no gradient)."""
    g = p.grad
    if g is None:
        return None
    if att.replicas is not None:  # HSDP: FSDP's own sharded gradient, the node's mean
        if isinstance(g, DTensor) and tuple(g.placements) == tuple(p.placements):
            local = g.to_local()
            if local.shape == p.to_local().shape:
                return local
    elif isinstance(g, DTensor) and (_is_local_grad(att, p, g) or _alone(att, p, g)):
        local = g.to_local()
        if tuple(local.shape) == tuple(torch_internals.fsdp2_orig_size(att.managed[p])):
            return local
    what = (
        f"a DTensor placed {tuple(g.placements)} with local shape {tuple(g.to_local().shape)}"
        if isinstance(g, DTensor) else f"a {type(g).__name__} of shape {tuple(g.shape)}"
    )
    if att.replicas is not None:
        raise RuntimeError(
            f"DistributedLion.step (FSDP2, HSDP) on rank {dist.get_rank()}: p.grad of '{att.fqns.get(p, '?')}' is "
            f"{what}; after backward it is this rank's shard of its node's mean gradient, a DTensor placed like the "
            f"parameter {tuple(p.placements)} with local shape {tuple(p.to_local().shape)}. Change it in place "
            f"(clipping, unscaling) or with DTensor ops, or set it to None, but do not replace it"
        )
    expected = (
        f"a DTensor of the parameter's shape {tuple(p.shape)} placed Replicate()" if p not in att.tp else
        f"a DTensor of the parameter's shape {tuple(p.shape)} placed {att.tp[p]}, its tensor-parallel part, of "
        f"local shape {tuple(torch_internals.fsdp2_orig_size(att.managed[p]))}"
    )
    raise RuntimeError(
        f"DistributedLion.step (FSDP2) on rank {dist.get_rank()}: p.grad of '{att.fqns.get(p, '?')}' is "
        f"{what}; after backward it is this rank's local gradient, {expected}. Change it in place (clipping, "
        f"unscaling) or with DTensor ops, or set it to None, but do not replace it by a sharded gradient"
    )


def _alone(att, p, g) -> bool:
    """Whether g is FSDP's own gradient of p on a mesh of one FSDP rank
    (which calls no reduce-scatter): placed as p, the whole local gradient."""
    if p not in att.tp:
        return _mesh_size(att, g.device_mesh) == 1
    return att.mesh_of[p].shards == 1 and tuple(g.placements) == tuple(p.placements)


def _unit_mesh(att, comm) -> "_Mesh":
    """The _Mesh of a unit's parameters (one per unit: FSDP shards a unit over one mesh)."""
    return att.mesh_of[comm.params[0].sharded_param] if comm.params else att.dp


class _UnitVote(NamedTuple):
    """One FSDP2 unit's part of a step's vote (:func:`_start_votes`)."""

    group: "dist.ProcessGroup"  # FSDP's shard group of the unit (its chunk layout's)
    device: torch.device
    chunk: int  # its chunk's elements in each shard (padding included)
    ps: list  # its sharded parameters that have a gradient
    pieces: list  # Voter.sharded_vote's pieces, laid out in the unit's own chunk
    entries: list  # (g, m, coefs, local shard, element of the chunk, elements) per parameter
    vote: "dist.ProcessGroup"  # its vote's group: FSDP's shard group; HSDP: the replicate group; cp: its dp ranks


def fsdp_vote(att, settle: bool = False):
    """Votes the step: per unit in the order of its
    reduce-scatter in backward, the directions of the parameters that have
    a gradient, packed in FSDP's chunk layout, and the collective of the
    mesh (:class:`_Mesh`): on a 1-D mesh the sign reduce-scatter of every
    chunk of the local gradients over the FSDP group; on HSDP the sign
    all-reduce of this rank's chunk over the replicate group. Either gives
    Delta of this rank's chunk. Consecutive units share one collective
    (their chunks end to end in each shard) up to step_vote.chunk_limit
    elements of planes. The step's plan (lionbit.fsdp_plan) starts them
    where it describes the step, else the general path (:func:`_start_votes`),
    which plans the next. On a 1-D mesh the momenta are updated here, once
    every rank has agreed to every call (their header rounds), while the
    shards still move; returns the function that applies Delta to the local
    shards (on HSDP, and with tensor parallelism, called once the ranks of
    a worker agreed: it updates the momenta first, while the bits still
    move, then waits for them; ``settle``: the bits are in before this
    returns). Raises step_vote.NonFinite (on every rank alike), changing
    nothing."""
    att.stepped = True
    defer = bool(att.agree)  # the worker's ranks agree after this returns
    started = att.plan.start(att)
    planned = started is not None
    agreed, works, update_momenta, apply_deltas = started if planned else _start_votes(att)
    # Every call is issued before any is waited for. On a 1-D mesh the
    # momenta (full-size: this rank's local gradients) are updated once every
    # rank has agreed to every call, while the shards still move. The ranks
    # of an HSDP node, or of a tensor-parallel group, agree once every call
    # of theirs is agreed to (node_agreed, after this returns), and no state
    # changes before that: the momenta then change while the bits still move.
    step_vote.wait_votes(agreed)  # raises NonFinite (nothing changed) as the votes would
    att.plan.replayed += planned
    if settle:
        step_vote.wait_votes(works)
    if not defer:
        update_momenta()
        step_vote.wait_votes(works)

    def apply() -> None:
        if defer:
            update_momenta()
            step_vote.wait_votes(works)
        apply_deltas()

    return apply


def _start_votes(att):
    """The general path of :func:`fsdp_vote`: reads every unit's parameters,
    starts the votes, and plans the next step where a plan can replay this
    one. Returns (agreements, works, the momentum update, the apply)."""
    opt = att.opt
    voter = opt.voter
    coefs_of = lion_math.coefs_by_param(opt.param_groups)
    hsdp = att.replicas is not None
    todo = []  # (gradient, momentum, coefs, local shard, Delta of the shard, its elements)
    fused_for = step_vote.fused_verdicts(opt)

    units: List[_UnitVote] = []
    for comm in att.order:
        # FSDP's chunk layout over the shard group, and the group of the vote
        # (FSDP calls no reduce-scatter over one rank: expert parallelism over the whole dp group)
        mesh = _unit_mesh(att, comm)
        group = comm.group if comm.group is not None and not hsdp else mesh.shard_group
        cp = mesh.cp
        # (a unit's parameters column by column: a step reads hundreds)
        gs = _local_grads(att, list(map(_sharded_param, comm.params)))
        params = [fp for fp, g in zip(comm.params, gs) if g is not None]
        if not params:
            continue
        grads = [g.reshape(-1) if g.is_contiguous() else g.contiguous().reshape(-1) for g in gs if g is not None]
        ps = list(map(_sharded_param, params))
        momenta = att.flat_momenta(ps)
        coefs = list(map(coefs_of.__getitem__, ps))
        shards = list(map(torch_internals.dtensor_local, ps))  # the local shards, written in place by apply()
        layout, s = comm.vote_layout(params, group, hsdp, None if cp is None else cp.chunks)
        device = ps[0].device  # every buffer of the vote lives on the parameters' device
        for p, local, (_, own, _) in zip(ps, shards, layout):
            if local.numel() != own:
                raise RuntimeError(
                    f"DistributedLion.step (FSDP2) on rank {dist.get_rank()}: parameter '{att.fqns.get(p, '?')}' has "
                    f"{local.numel()} local elements, FSDP's layout {own}"
                )
        votes = [(g, m, c, spans) for g, m, c, (_, _, spans) in zip(grads, momenta, coefs, layout)]
        unit = [(g, m, c, local, off, own)
                for g, m, c, local, (off, own, _) in zip(grads, momenta, coefs, shards, layout)]
        units.append(_UnitVote(group, device, s, ps, votes, unit, mesh.vote_group if hsdp or cp else group))

    # Consecutive units in one call, their chunks end to end in each shard.
    def planes_of(u):  # elements of planes a unit adds to its call
        return u.chunk * (1 if hsdp else u.vote.size())

    if att.multi:  # each group's units together (their order within a group kept: the same on every rank)
        first = {}
        for u in units:
            first.setdefault(id(u.vote), len(first))
        units.sort(key=lambda u: first[id(u.vote)])
    agreed, works, calls = [], [], []
    for run in runs(units, lambda u: (id(u.vote), u.device), planes_of, lambda u: step_vote.chunk_limit(u.device)):
        pieces, s, bases = end_to_end([(u.pieces, u.chunk) for u in run])
        group, device = run[0].vote, run[0].device
        where = "step (HSDP all-reduce over the replicate group)" if hsdp else "step (FSDP2 reduce-scatter)"
        # Delta as the vote's two planes (2 bits an element) where the apply can read them
        planes = voter.votes_into_planes(device, group)
        delta = voter.sharded_vote(pieces, s, group, device, where, fused_for, agreed, works, replicated=hsdp,
                                   into_planes=planes, nexts=opt.next_momenta)
        calls.append((run, bases, s, group, hsdp, where))
        delta_of = lion_math.delta_views(delta, planes)
        for u, base in zip(run, bases):
            todo += [(g, m, coefs, local, delta_of(base + off, own), own) for g, m, coefs, local, off, own in u.entries]
    att.plan.learn(att, units, calls, fused_for)

    def update_momenta() -> None:
        verdicts = fused_for.many([t[1] for t in todo], [t[0] for t in todo])
        step_vote.update_state([(g, m, c, f) for (g, m, c, *_), f in zip(todo, verdicts)], [], opt.next_momenta)

    def apply() -> None:
        applies = [(local, d, coefs) for _, _, coefs, local, d, own in todo if own]
        a_verdicts = fused_for.many([a[0] for a in applies], [a[1] for a in applies])
        step_vote.update_state([], [(x, d, c, f) for (x, d, c), f in zip(applies, a_verdicts)])

    return agreed, works, update_momenta, apply


def fsdp_step(att, grad_scaler=None) -> bool:
    """``step()`` under FSDP2: the vote of :func:`fsdp_vote` through
    step_vote.voted_step (GradScaler: unscaled first; a non-finite direction
    on any rank skips the step everywhere)."""
    for p in list(att.captured):  # a grad hook FSDP did not call
        att.grad_hook(p)
    vote = (lambda: _node_agreed_vote(att)) if att.agree else (lambda: fsdp_vote(att))  # HSDP, TP: agreed
    return step_vote.voted_step(att.opt, grad_scaler, vote)


def _node_agreed_vote(att):
    """HSDP and tensor parallelism: :func:`fsdp_vote`, then the ranks of each
    worker (an HSDP node, a tensor-parallel group) agree whether to step
    (lionbit.step_vote.node_agreed)."""
    device = next(iter(att.managed)).device
    hsdp = att.replicas is not None
    cp = att.dp.cp is not None
    what = "FSDP2" + (", HSDP" if hsdp else "") + (", expert parallel" if att.multi else
                                                   ", tensor parallel" if att.split else "") + (
        ", context parallel" if cp else "")
    peers = ("this node" if hsdp else "this expert-parallel group" if att.multi else
             "this worker's context- and tensor-parallel ranks" if cp and att.split else
             "this context-parallel group" if cp else "this tensor-parallel group")
    return step_vote.node_agreed(lambda settle: fsdp_vote(att, settle), att.agree, device, what, peers)
