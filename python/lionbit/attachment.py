"""What DistributedLion asks of the model it is attached to.

The optimizer holds one attachment and never asks which kind it is: a plain
module (this file's :class:`Attachment`), DDP (lionbit.ddp), FSDP2
(lionbit.fsdp) or FSDP1 (lionbit.fsdp1). An attachment owns where the
step's directions come from and how they travel; it uses the optimizer only
through its package surface (``momentum_of``, ``fused_for``,
``check_param``, ``voter``, ``next_momenta``, ``param_groups``, ``state``)
and never through its private names.

A plain module's attachment votes at ``step()``: the directions of every
parameter with a gradient, chunk by chunk (lionbit.step_vote), replaying
the step's plan where the step is the one before it again
(lionbit.step_plan).
"""

import gc
import sys
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import (
    lion_math,
    momentum_mean,
    momentum_origin,
    other_optimizers,
    step_plan,
    step_vote,
    torch_internals,
    user_warning,
)

#: DDP models attached to a DistributedLion (lionbit.ddp): their comm hook
#: all-reduces no gradient (detached, it averages them as DDP does).
ATTACHED_DDP_MODELS: "weakref.WeakSet[DDP]" = weakref.WeakSet()


def fsdp_loaded() -> bool:
    """Whether torch's FSDP (FSDP1 and FSDP2) is imported: only then can a
    model hold FSDP modules. torch imports lionbit at its own import (the
    "torch.backends" entry point), and FSDP with DTensor under it would add
    0.8 s to every ``import torch``; lionbit's FSDP halves (lionbit.fsdp,
    lionbit.fsdp1) are imported at the first attach() that can need them."""
    return "torch.distributed.fsdp" in sys.modules


def is_dtensor_type(cls: type) -> bool:
    """issubclass(cls, DTensor), without importing DTensor (no DTensor exists
    before its module is imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and issubclass(cls, mod.DTensor)


def _registered(group) -> bool:
    """Whether ``group`` (None: the default group) can still be used: false
    after destroy_process_group()."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def asked_by_torch_state_dicts() -> Optional[str]:
    """The torch module whose code is asking for an optimizer's state dict:
    FSDP1's ``FSDP.optim_state_dict`` (torch.distributed.fsdp), and
    ``get_optimizer_state_dict`` or ``dcp.save`` of the optimizer
    (torch.distributed.checkpoint), whose formats hold one sharded or
    replicated value per parameter; None for any other caller (a user's
    ``torch.save(opt.state_dict())``). Looks at every frame above: between
    DCP and this call there may be a framework's checkpoint manager, an app
    state's helpers, decorators (with 12 frames, 7 nested calls in a
    ``Stateful``'s ``state_dict`` hid DCP, and each rank got a mix of the
    ranks' momenta back)."""
    frame = torch_internals.torch_caller(("torch.distributed.fsdp", "torch.distributed.checkpoint"))
    return None if frame is None else frame.f_globals["__name__"]


def take_over(others) -> None:
    """Detaches each distinct attachment of ``others`` (None: none): another
    DistributedLion's, serving the model an attach() is installing on (the
    newest attach() serves it; :meth:`Attachment.taken_over`)."""
    for other in {id(a): a for a in others if a is not None}.values():
        other.taken_over()


class Attachment:
    """The interface, and a plain module's (or no model's) attachment."""

    kind = "a plain module"
    #: Whether its steps use the optimizer's second momentum buffers (lionbit.next_momenta).
    serves_next_momenta = True
    #: The model whose communication it replaces (None: a plain module's, whose is its own).
    model = None

    def __init__(self, opt, group: Optional[dist.ProcessGroup] = None):
        # The optimizer holds its attachment, and the model's hooks hold the attachment: never the
        # optimizer, so that dropping it frees it (and its momenta) and detaches (detach_when_dropped).
        self._opt = weakref.ref(opt)
        self._dropped = None  # detach_when_dropped's finalizer
        self.group = group  # None: the default group at each call
        self.buffers = step_vote.VoteBuffers()
        self.plan = step_plan.StepPlan()  # a plain module's step, replayed (not DDP's or FSDP's)
        self.layout: Optional[list] = None  # the parameters of the last applied step (Join)
        self.checked_ddp = False
        self.meshes = {}  # device type -> a 1-D DeviceMesh of the group (DCP's state dicts: _rows)

    @property
    def opt(self):
        """The optimizer (None once it is dropped: only a detach runs then)."""
        return self._opt()

    def detach_when_dropped(self) -> "Attachment":
        """Arranges :meth:`detach` for when the optimizer is dropped (its last
        reference gone: a script that builds a new optimizer for the same
        model, a framework's tuner), so that its momenta are freed, the model's
        communication is torch's again and another optimizer may attach.
        Returns self. Until then other optimizers may not step the model's
        parameters where it left their gradients (lionbit.other_optimizers)."""
        self._dropped = weakref.finalize(self.opt, self._hand_back)
        self._dropped.atexit = False  # (at exit the groups may be gone: nothing to hand back)
        if self.model is not None:
            other_optimizers.watch(self, self.model.parameters())
        return self

    def _hand_back(self) -> None:
        other_optimizers.unwatch(self)
        self.detach()

    def release(self) -> None:
        """:meth:`detach` now, and not again when the optimizer is dropped:
        the optimizer's way to hand the model back."""
        if self._dropped is None:
            self._hand_back()
        else:
            self._dropped()  # (a finalizer runs its callback once)

    def holds_local_gradients(self) -> bool:
        """Whether the model's gradients of the last backward are this rank's
        own, left for the vote (no other optimizer may step them)."""
        return False

    def taken_over(self) -> None:
        """Another DistributedLion attached to this model (a script that
        builds a new optimizer for it while the old one is still referenced,
        by a variable or a scheduler): this one is detached, and steps as a
        plain module's optimizer from then on."""
        opt = self.opt
        if opt is not None:
            opt.detach()
        else:
            self.release()

    # -- the step ---------------------------------------------------------------
    def step(self, grad_scaler=None, abstain: bool = False) -> bool:
        """Votes and applies one step; returns whether it was applied (a
        GradScaler may skip it). ``abstain``: this rank has run out of data
        (torch's Join): it votes 0, keeps its momentum and applies the
        voted update like every rank."""
        if not abstain:
            self.check_ddp_once()
        return step_vote.voted_step(self.opt, grad_scaler, lambda: self.vote_now(abstain), abstain)

    def vote_now(self, abstain: bool):
        """Votes the step and returns the function that applies it: as planned
        (lionbit.step_plan) where the plan describes the step, else by the
        general path, which plans the next. The gradients are read here,
        after voted_step unscaled them: an entry may hold a contiguous copy of
        a gradient (channels_last), which must be of the unscaled one."""
        if not abstain:
            apply = self.plan.vote(self.opt, self.group, self.buffers)
            if apply is not None:
                self.layout = self.plan.params
                return apply
        entries = self.entries(abstain)
        apply = self.vote(entries)
        if not abstain:
            self.plan.learn(self.opt, entries, self.group)
        return apply

    def entries(self, abstain: bool, skip=frozenset()) -> List[step_vote.Entry]:
        """The step's entries (recording its layout: the parameters with a
        gradient); with ``skip``, only those of the others (voted already)."""
        if not abstain:
            if not skip:
                entries = step_vote.step_entries(self.opt, self.opt.param_groups)
                self.layout = [e.param for e in entries]
                return entries
            self.layout = [p for group in self.opt.param_groups for p in group["params"] if p.grad is not None]
            return step_vote.step_entries(self.opt, self.opt.param_groups, skip)
        # The parameters this rank stepped last (its peers' step has the same
        # layout while the gradients that exist stay the same; a mismatch is
        # a clear error of the vote's header round, never a hang).
        coefs_of = lion_math.coefs_by_param(self.opt.param_groups)
        params = self.layout if self.layout is not None else [p for p in coefs_of if p.requires_grad]
        return [step_vote.abstaining(self.opt, p, coefs_of[p]) for p in params]

    def vote(self, entries):
        """Votes ``entries`` at step(); returns the function that applies them."""
        if not entries:
            return lambda: None
        self.check_entries(entries)
        # The momenta change once every rank has agreed to the votes, while their bits still move.
        deltas = step_vote.vote_chunks(self.opt, entries, self.group, "step", self.buffers,
                                       on_agreed=lambda: step_vote.update_momenta(entries, self.opt.next_momenta))
        return lambda: step_vote.apply_deltas(entries, deltas)

    def start_vote(self, entries, agreed: list, works: list) -> list:
        """Starts the vote of ``entries``, which :meth:`check_entries`
        accepted, beside the step's other calls (step_vote.start_chunks:
        their agreements and futures appended to ``agreed`` and ``works``,
        for the caller to wait for); returns their Delta views. Changes no
        state."""
        if not entries:
            return []
        return step_vote.start_chunks(self.opt, entries, self.group, "step", self.buffers, agreed, works)

    def check_entries(self, entries) -> None:
        """Raises where ``entries`` cannot be voted together (before any call starts)."""
        params = [e.param for e in entries]
        if any(map(is_dtensor_type, set(map(type, params)))):  # (a few types, whatever the tensors)
            raise ValueError(
                f"DistributedLion.step on rank {dist.get_rank() if _registered(self.group) else 0}: "
                f"the parameters are DTensors (sharded by FSDP2's fully_shard) and this optimizer is not attached "
                f"to the model; call opt.attach(model) once after fully_shard (the vote then runs at FSDP's "
                f"reduce-scatter, lionbit.fsdp)"
            )
        if len(set(map(torch.Tensor.get_device, params))) > 1:  # (both CPU or CUDA: check_params)
            devices = sorted({str(p.device) for p in params})
            raise RuntimeError(
                f"DistributedLion.step: parameters on several devices ({', '.join(devices)}); one step votes "
                f"all of them together, so they must share a device (use one optimizer per device)"
            )

    def check_ddp_once(self) -> None:
        """:meth:`warn_if_ddp_unattached`, at the first step that asks."""
        if not self.checked_ddp:
            self.checked_ddp = True
            self.warn_if_ddp_unattached()

    def warn_if_ddp_unattached(self) -> None:
        """Once, at the first step: a DDP model holding these parameters but
        not attached all-reduces every gradient in fp32 before the vote."""
        if not _registered(self.group) or dist.get_world_size(self.group) == 1:
            return
        mine = {id(p) for g in self.opt.param_groups for p in g["params"]}
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads obj.__class__, which some of torch's
            # deprecated module proxies answer with a FutureWarning of their own.
            if issubclass(type(obj), DDP) and any(id(p) in mine for p in obj.parameters()):
                if obj in ATTACHED_DDP_MODELS:
                    continue  # attached to another DistributedLion: its vote, no all-reduce
                user_warning.warn(
                    f"DistributedLion.step on rank {dist.get_rank()}: these parameters belong to a "
                    f"DistributedDataParallel model that was not attached, so DDP all-reduces every gradient in "
                    f"fp32 and the 1-bit vote runs on top of it: all the cost, none of the saving. Call "
                    f"opt.attach(ddp_model) once after creating both (with replicate(): opt.attach(model))"
                )
                return

    # -- momentum synchronization -------------------------------------------------
    def momenta(self) -> List[torch.Tensor]:
        """Every momentum a synchronization averages, in the same order on
        every rank: every trainable parameter's, created (zero) where a
        parameter has had no step yet (the layout must not depend on which
        gradients a rank saw)."""
        return [self.opt.momentum_of(p) for g in self.opt.param_groups for p in g["params"] if p.requires_grad]

    def momentum_groups(self) -> list:
        """[(momenta, the group whose ranks average them)]: :meth:`momenta`
        over the attachment's group (FSDP2 with expert parallelism: per mesh)."""
        return [(self.momenta(), self.group)]

    # -- checkpoints -----------------------------------------------------------
    def marker(self) -> Optional[dict]:
        """Whose momentum a state dict holds: ``{"rank", "world_size"}``, or
        None without a (live) process group."""
        if not _registered(self.group):
            return None
        return {"rank": dist.get_rank(self.group), "world_size": dist.get_world_size(self.group)}

    def state_dict(self) -> dict:
        """torch's state dict plus ``"lionbit": {"rank", "world_size",
        "momenta"}`` (lionbit.momentum_origin's record), for a file a rank.
        Asked by torch.distributed.checkpoint (which keeps one value per
        entry, and a plain tensor for replicated: it writes one rank's) on
        several ranks, each momentum is presented as row r of an (N, *shape)
        DTensor over the group instead, row r being rank r's, so that every
        rank's is saved and comes back to it; on one (or without a process
        group) plain, as lionbit.elastic's planner knows them (no record:
        one worker's momenta are its own)."""
        marker = self.marker()
        asked = asked_by_torch_state_dicts() is not None
        if asked:  # every momentum, zero where none yet: dcp.load fills the entries of the state dict it is given
            self.momenta()
        sd = torch.optim.Optimizer.state_dict(self.opt)
        if asked:  # (no marker: DCP would keep one rank's; the rows say whose each momentum is)
            present = self._rows if marker is not None and marker["world_size"] > 1 else self._plain
            sd["state"] = {k: {n: present(v) if n == "exp_avg" else v for n, v in st.items()}
                           for k, st in sd["state"].items()}
        elif marker is not None:  # (and a record of the momenta: a dict DCP mixed says so when loaded)
            sd["lionbit"] = {**marker, "momenta": momentum_origin.record(marker["rank"], sd)}
        return sd

    @staticmethod
    def _plain(m: torch.Tensor) -> torch.Tensor:
        """The only worker's momentum m (a view of it), marked for
        lionbit.elastic's planner: a checkpoint of N workers loads into it
        as their mean."""
        from . import elastic  # optional: imports torch.distributed.checkpoint (which is asking)

        return elastic.presented(m.view(m.shape))

    def _rows(self, m: torch.Tensor):
        """m as this rank's row of an (N, *shape) DTensor, placed Shard(0)
        over a 1-D mesh of the group (sharing m's memory): the format of
        FSDP2's state dicts on a 1-D mesh (lionbit.fsdp_checkpoint._rows), whose mesh
        is the parameter's."""
        from torch.distributed.device_mesh import DeviceMesh  # optional: DTensor's cost only where DCP asks
        from torch.distributed.tensor import DTensor, Shard  # optional: as above

        from . import elastic  # optional: imports torch.distributed.checkpoint (which is asking)

        if m.device.type not in self.meshes:
            self.meshes[m.device.type] = DeviceMesh.from_group(self.group or dist.group.WORLD, m.device.type)
        return elastic.presented(
            DTensor.from_local(m.unsqueeze(0), self.meshes[m.device.type], [Shard(0)], run_check=False))

    def _own_rows(self, sd: dict) -> dict:
        """The state of a loaded state dict with each momentum given as
        every rank's, (N, *shape) (the DTensor of :meth:`_rows` that dcp.load
        wrote every rank's row into, or a consolidated file's rows, plain or
        as torch's set_optimizer_state_dict distributed them), replaced by
        this rank's row; the momenta of another number of ranks by their
        mean (lionbit.momentum_mean), with a warning. A plain momentum of
        its parameter's shape is taken as it is."""
        tensor = sys.modules.get("torch.distributed.tensor")  # (a torch.save file's load need not import it)
        DTensor = tensor.DTensor if tensor is not None else ()  # noqa: N806 - the class (none: nothing is one)
        params = {key: p for group, saved in zip(self.opt.param_groups, sd.get("param_groups", []))
                  for p, key in zip(group["params"], saved["params"])}
        averaged = None
        out = {}
        for key, st in sd.get("state", {}).items():
            m = st.get("exp_avg") if isinstance(st, dict) and key in params else None
            p = params.get(key)
            if isinstance(m, DTensor):
                st = {**st, "exp_avg": self._own_row(p, m)}
            elif isinstance(m, torch.Tensor) and m.shape == p.shape:  # (the only worker's: the planner's mean?)
                st = {**st, "exp_avg": self._mean_loaded(m, m)}
            elif isinstance(m, torch.Tensor):
                if not momentum_mean.are_rows(m, p):
                    raise ValueError(
                        f"DistributedLion.load_state_dict on rank {dist.get_rank()}: the momentum ('exp_avg') of "
                        f"parameter {key!r} has shape {tuple(m.shape)}, its parameter {tuple(p.shape)}; expected "
                        f"that shape, or every rank's momentum stacked, (ranks, *shape)"
                    )
                if m.shape[0] == self._workers():  # a consolidated file's rows: this rank's
                    st = {**st, "exp_avg": m[dist.get_rank(self.group) if dist.is_initialized() else 0]}
                else:
                    st = {**st, "exp_avg": momentum_mean.of_stacked(m, self.opt.momentum_dtype)}
            if averaged is None and momentum_mean.are_rows(m, p) and m.shape[0] != self._workers():
                averaged = (m.shape[0], key)
            out[key] = st
        if averaged is not None:
            momentum_mean.warn("DistributedLion.load_state_dict", averaged[0], self._workers(), averaged[1])
        return out

    def _workers(self) -> int:
        """The ranks whose momenta a state dict holds (1 without a process group)."""
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _own_row(self, p: torch.Tensor, m) -> torch.Tensor:
        """This rank's row of a rows DTensor over the group's ranks (or the
        mean of another number of ranks' rows, as torch distributed them)."""
        n, local = dist.get_world_size(self.group), m.to_local()
        if (m.shape[0] != n and momentum_mean.are_rows(m, p) and local.shape[1:] == p.shape
                and m.device_mesh.ndim == 1 and m.device_mesh.size() == n):
            return momentum_mean.of_distributed(m, 0, self.opt.momentum_dtype)  # (a 1-D mesh of the group)
        if tuple(m.shape) != (n, *p.shape) or tuple(local.shape) != (1, *p.shape):
            raise ValueError(
                f"DistributedLion.load_state_dict on rank {dist.get_rank()}: a momentum is a DTensor of shape "
                f"{tuple(m.shape)}; expected {(n, *p.shape)}, row r being rank r's "
                f"(as state_dict() gives it to torch.distributed.checkpoint), of which this rank holds its own; "
                f"a checkpoint of another number of ranks loads through dcp.load(..., "
                f"planner=lionbit.ElasticLoadPlanner()), every rank then starting from the mean of the saved momenta"
            )
        return self._mean_loaded(m, local)[0]

    @staticmethod
    def _mean_loaded(m: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The saved momenta's mean where lionbit.elastic's planner loaded
        m's entry from another number of workers (or another layout), else
        ``local`` (m's own tensor)."""
        elastic = sys.modules.get(__package__ + ".elastic")
        mean = elastic.mean_loaded(m) if elastic is not None else None
        return local if mean is None else mean

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self._warn_whose(state_dict.pop("lionbit", None), state_dict.get("state", {}))
        state_dict["state"] = self._own_rows(state_dict)  # (checked before anything is loaded)
        torch.optim.Optimizer.load_state_dict(self.opt, state_dict)
        # torch casts loaded state to each parameter's dtype: a float32
        # momentum of a bfloat16 parameter would come back rounded. Each
        # momentum is taken again from the dict (torch's order: the groups'
        # parameters, one by one), in the momentum's own dtype.
        saved = state_dict["state"]
        for group, saved_group in zip(self.opt.param_groups, state_dict["param_groups"]):
            for p, key in zip(group["params"], saved_group["params"]):
                m = saved.get(key, {}).get("exp_avg")
                if isinstance(m, torch.Tensor) and "exp_avg" in self.opt.state[p]:
                    self.opt.state[p]["exp_avg"] = m.to(device=p.device, dtype=self.opt.momentum_dtype, copy=True)

    def _warn_whose(self, saved, state: dict) -> None:
        """Warns where a state dict's momenta are not this rank's: another
        rank's file, or a mix of the ranks' (lionbit.momentum_origin). A
        state dict without momenta (saved before the first step, as
        Lightning's LR finder saves one) is no rank's: silent."""
        mine = self.marker()
        if not isinstance(saved, dict) or mine is None:
            return
        # (a dict without the record, an older lionbit's: its marker's word alone)
        found = momentum_origin.foreign(saved.get("momenta"), state) or momentum_origin.Origin(
            saved.get("rank"), others=[], compared=0, missing=[], recorded=0)
        if not (momentum_origin.holds_momenta(state) or found.missing):
            return
        if found.recorded and not (found.compared or found.missing):
            return  # (loaded into momenta of another dtype, as DCP casts them: whose cannot be told)
        whose = found.rank
        where = f"DistributedLion.load_state_dict on rank {mine['rank']}"
        if found.missing:
            user_warning.warn(
                f"{where}: this state dict lacks {len(found.missing)} of the momenta its record lists: a dict "
                f"made by the script from an optimizer with no momenta yet (a fresh one) and filled by "
                f"torch.distributed.checkpoint gets none back (dcp.load fills only the entries it is given; and of "
                f"a dict made by the script dcp.save keeps one rank's copy of each momentum). Those parameters "
                f"start from zero momentum: training goes on, but not as without the restart. Hand DCP the "
                f"optimizer itself (dcp.save({{'optim': opt}}), dcp.load({{'optim': opt}})) or use "
                f"get_state_dict(model, opt) and set_state_dict: every momentum is made first, and every rank's saved"
            )
        elif found.others:
            user_warning.warn(
                f"{where}: {len(found.others)} of the {found.compared} momenta in this state dict are not rank "
                f"{whose}'s, "
                f"whose record of them it holds: it mixes the ranks' momenta, as a dict made by the script and "
                f"handed to torch.distributed.checkpoint does (dcp.save({{'optim': opt.state_dict()}}): DCP keeps "
                f"one rank's copy of each entry, choosing the rank entry by entry). This rank continues from the "
                f"mix: training goes on, but not bitwise as without the restart. For an exact resume hand DCP the "
                f"optimizer itself (dcp.save({{'optim': opt}}) and dcp.load({{'optim': opt}})) or "
                f"get_state_dict(model, opt), which ask for every rank's momentum, or save a file a rank"
            )
        elif whose == mine["rank"] and saved.get("world_size") != mine["world_size"]:
            user_warning.warn(
                f"{where}: this state dict holds this rank's own momentum, saved by a run of "
                f"{saved.get('world_size')} ranks, and this run has {mine['world_size']}: this rank continues from "
                f"it (training goes on, but not bitwise as without the restart). To start every rank from the mean "
                f"of all the saved momenta instead, save through torch.distributed.checkpoint and load with "
                f"dcp.load(..., planner=lionbit.ElasticLoadPlanner()) (docs/checkpoints.md)"
            )
        elif (whose, saved.get("world_size")) != (mine["rank"], mine["world_size"]):
            user_warning.warn(
                f"{where}: this state dict holds the momentum of rank {whose} of {saved.get('world_size')}, so "
                f"this rank continues from that rank's momentum, not its own (when every rank loads rank 0's file, "
                f"every rank starts with the same momentum: a momentum synchronization; training goes on, but not "
                f"bitwise as without the restart). For an exact resume save each rank's own: "
                f"torch.save(opt.state_dict(), f'opt.rank{{dist.get_rank()}}.pt') on every rank, and load each "
                f"rank's file"
            )

    def sharded_state_dict(self) -> dict:
        raise RuntimeError("DistributedLion.sharded_state_dict: attach(model) to an FSDP2 model first")

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("DistributedLion.load_sharded_state_dict: attach(model) to an FSDP2 model first")

    def local_state_dict(self) -> dict:
        raise RuntimeError("DistributedLion.local_state_dict: attach(model) to an FSDP1 model first")

    def load_local_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("DistributedLion.load_local_state_dict: attach(model) to an FSDP1 model first")

    # -- lifetime ----------------------------------------------------------------
    def is_attached_to(self, model) -> bool:
        return False

    def detach(self) -> None:
        """Hands the model back: its communication is torch's again (a DDP
        model keeps lionbit's hook, which then averages as DDP does)."""

    # -- torch's Join (lionbit.join) ---------------------------------------------
    def join_hook_made(self) -> None:
        """A Join holding the optimizer is being made (its hooks first, then
        each joinable's config, in the Join's order)."""

    def join_configured(self, config) -> None:
        """That Join set the optimizer's config (torch's _JoinConfig)."""

    def join_step_due(self) -> bool:
        """On a rank that has joined, at each of the Join's rounds: whether
        its peers take a step in this round (a plain module: the optimizer
        is the Join's first joinable, so every round is one step())."""
        return True
