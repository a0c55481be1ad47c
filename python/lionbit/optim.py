"""DistributedLion: Lion whose updates are voted across ranks with 1 bit each.

Per step on rank i (Distributed Lion, Liu et al. 2024; Lion Cub, Ishikawa et
al. 2024)::

    delta_i = sign(b1 * m_i + (1 - b1) * g_i)       # local direction, 1 bit
    m_i     = b2 * m_i + (1 - b2) * g_i             # momentum stays local
    Delta   = vote(delta_1 .. delta_N)  (or avg)    # lionbit's sign all-reduce
    x       = x * (1 - lr * wd) - lr * Delta        # same on every rank

No gradient is ever all-reduced. The arithmetic (float32, every operation
rounded on its own) is lionbit.lion_math's; how the directions travel is the
attachment's (lionbit.attachment: a plain module, lionbit.ddp, lionbit.fsdp,
lionbit.fsdp1) and the aggregation's (lionbit.voter).
"""

import warnings
from operator import attrgetter
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Joinable

from . import _C, ddp, join, kernel_choice, lion_math, momentum_sync as msync, next_momenta, step_vote, torch_internals
from ._backend import check_group
from .attachment import Attachment, fsdp_loaded, is_dtensor_type
from .hierarchy import optimizer_hierarchy
from .voter import Voter

# GradScaler passes itself to an optimizer whose step() takes grad_scaler= and
# warns that it will stop doing so; DistributedLion needs it (to make every
# rank's scaler back off alike), and the warning tells a user nothing to do.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _checked_arguments(lr, betas, weight_decay, aggregation, bits, tie_break, momentum_dtype, group) -> Optional[int]:
    """Checks the constructor's arguments; returns ``bits`` with its default."""
    check_group(group, "DistributedLion")
    def bad(name, want, got):
        raise ValueError(f"DistributedLion: argument '{name}' must be {want}, got {got}")

    if not lr >= 0.0:
        bad("lr", ">= 0", lr)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        bad("betas", "two values in [0, 1)", betas)
    if not weight_decay >= 0.0:
        bad("weight_decay", ">= 0", weight_decay)
    if aggregation not in ("vote", "avg", "l1"):
        bad("aggregation", "'vote', 'avg' or 'l1'", repr(aggregation))
    if bits is not None and aggregation != "l1":
        raise ValueError(f"DistributedLion: argument 'bits' applies to aggregation='l1' only (got bits={bits!r} "
                         f"with aggregation={aggregation!r})")
    if aggregation == "l1":
        bits = 4 if bits is None else bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            bad("bits", "an int from 2 to 8", repr(bits))
    if tie_break not in ("zero", "alternate", "random"):
        bad("tie_break", "'zero', 'alternate' or 'random'", repr(tie_break))
    if tie_break != "zero" and aggregation == "avg":
        raise ValueError(f"DistributedLion: argument 'tie_break'={tie_break!r} applies to aggregation 'vote' or "
                         f"'l1'; 'avg' has no ties")
    if momentum_dtype not in (None, torch.float32, torch.bfloat16):
        bad("momentum_dtype", "torch.float32 or torch.bfloat16", momentum_dtype)
    return bits


def _asked_by_grad_scaler(_opt) -> bool:
    """``_step_supports_amp_scaling``: True where torch's GradScaler asks, so
    that ``scaler.step(opt)`` hands step() the scaler (an inf/NaN on any rank
    then skips the step on every rank, each rank's gradients being its own);
    False to anyone else. Frameworks read the flag as "step() unscales by
    itself, so gradients cannot be clipped before it": Lightning then refuses
    gradient clipping, even in bf16 with no scaler. step() also takes
    gradients that ``scaler.unscale_(opt)`` unscaled first, as they do."""
    return torch_internals.torch_caller(("torch.amp", "torch.cuda.amp"), depth=1) is not None


_FUSED_DTYPES: Dict[tuple, bool] = {}  # (parameter, gradient, momentum) dtypes -> a fused kernel serves them


_grad, _sparse, _is_cuda, _is_cpu = (attrgetter(name) for name in ("grad", "is_sparse", "is_cuda", "is_cpu"))


def _check_params(params: Sequence[torch.Tensor], where: str) -> None:
    """DistributedLion.check_param of each of ``params`` (a step's hundreds: read in C, not one by one)."""
    if any(map(_sparse, [g for g in map(_grad, params) if g is not None])):
        raise RuntimeError(f"DistributedLion.{where}: sparse gradients are not supported")
    cuda = sum(map(_is_cuda, params))  # (is_cuda, is_cpu: .device is slow)
    if cuda and not _C.built_with_cuda:
        p = next(p for p in params if p.is_cuda)
        raise RuntimeError(
            f"DistributedLion.{where}: parameters on {p.device}, but this build of lionbit has no CUDA path "
            f"(rebuild it where nvcc and a CUDA build of torch are present)")
    if cuda + sum(map(_is_cpu, params)) != len(params):
        p = next(p for p in params if not (p.is_cpu or p.is_cuda))
        then = " (a model built on the meta device: attach after to_empty() and its initialisation)"
        then = then if p.is_meta else ""
        raise RuntimeError(
            f"DistributedLion.{where}: parameters on {p.device} are not supported (CPU and CUDA are){then}")
    if not lion_math.PLAIN.issuperset(map(type, params)):  # (a few types, whatever the tensors)
        _check_memory(params, where)
    if any(map(torch.is_complex, params)):  # (made complex after the constructor saw them)
        _refuse_complex(params, where)


def _without_complex(param_group: dict, index: int) -> dict:
    """``param_group``, checked by :func:`_refuse_complex` (its parameters
    listed where they came as an iterator, which the check would use up;
    torch's own checks see the rest as given)."""
    params = param_group["params"]
    if not isinstance(params, (torch.Tensor, set, dict)):
        params = param_group["params"] = list(params)
    _refuse_complex([params] if isinstance(params, torch.Tensor) else params, f"parameter group {index}")
    return param_group


_STEP_OPAQUE = []  # [True] once DistributedLion.step is wrapped by torch.compiler.disable


def _step_run_as_it_is_under_compile() -> None:
    """``torch.compile(opt.step)`` (torch's recipe for a faster optimizer
    step) runs DistributedLion's step as it is: its work is C++ kernels and
    collectives, and Dynamo tracing into it stops at the process group (an
    opaque object). Done at the first construction, not at import:
    torch.compiler imports Dynamo, with sympy, FSDP and DTensor, seconds
    that every ``import torch`` would pay (it imports lionbit); torch's
    Optimizer imports it anyway."""
    if not _STEP_OPAQUE:
        DistributedLion.step = torch.compiler.disable(DistributedLion.step)
        _STEP_OPAQUE.append(True)


def _refuse_complex(params: Sequence[torch.Tensor], where: str) -> None:
    """Raises naming the first complex parameter: Lion's direction is the
    sign of a real number, and torch's casts to a real dtype would drop the
    imaginary part without a word."""
    for i, p in enumerate(params):
        if isinstance(p, torch.Tensor) and p.is_complex():
            raise TypeError(
                f"DistributedLion ({where}) on rank {step_vote.rank_of()}: parameter {i} (shape {tuple(p.shape)}) has "
                f"dtype {p.dtype}; Lion's direction is the sign of a real number, so a complex parameter is not "
                f"supported (its imaginary part would be lost). Keep it as a real parameter of its real and "
                f"imaginary parts: nn.Parameter(torch.view_as_real(w)), and torch.view_as_complex(it) in forward"
            )


def _check_memory(params: Sequence[torch.Tensor], where: str) -> None:
    """Raises where a parameter (a DTensor's local tensor) is a tensor
    subclass whose values the kernels cannot update in place
    (lion_math.memory_of: no tensor of its shape and dtype holds them)."""
    for p in params:
        local = torch_internals.dtensor_local(p) if is_dtensor_type(type(p)) else p
        if lion_math.memory_of(local) is None:
            raise TypeError(
                f"DistributedLion.{where} on rank {step_vote.rank_of()}: a parameter of shape {tuple(p.shape)} is a "
                f"{type(local).__module__}.{type(local).__qualname__} (a tensor subclass) whose values are not in a "
                f"tensor of its shape and dtype ({p.dtype}), so DistributedLion cannot update it in place; "
                f"subclasses that keep their values in a tensor of their own (torchao's float8 training weights) "
                f"work. A quantized or packed weight is usually frozen: leave it out of the optimizer"
            )


def _fused_dtypes(pdt: torch.dtype, gdt: torch.dtype, mdt: torch.dtype) -> bool:
    """_C.lion_fused_supported, asked once a dtype triple (a step asks every parameter)."""
    key = (pdt, gdt, mdt)
    ok = _FUSED_DTYPES.get(key)
    if ok is None:
        ok = _FUSED_DTYPES[key] = bool(_C.lion_fused_supported(pdt, gdt, mdt))
    return ok


class DistributedLion(torch.optim.Optimizer, Joinable):
    """Lion with 1-bit majority-vote (or average) updates across ranks.

    Args:
        params: parameters or parameter groups (each may set ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate (Lion wants 3-10x smaller than AdamW).
        betas: (b1, b2): b1 mixes the gradient into the direction, b2 is the momentum's decay.
        weight_decay: decoupled weight decay (x *= 1 - lr * wd each step).
        aggregation: "vote" (sign of the sum of directions), "avg" (their mean) or "l1"
            (Lion Cub: each rank sends its pre-sign update quantized to ``bits`` bits with L1
            scaling per tensor; the update is the sign of their sum).
        bits: with "l1", bits per value, 2 to 8 (default 4): levels in [-(2^(bits-1) - 1), 2^(bits-1) - 1].
        tie_break: where the ranks' sum is 0: "zero" (default), "alternate" (+1 on even steps, -1
            on odd ones) or "random" (a pseudo-random sign per element, the same on every rank).
        momentum_sync: None (default), an int k (average the ranks' momenta after every k-th
            step; lionbit.momentum_sync) or a callable ``step -> bool``, e.g. lionbit.ExponentialSync.
        momentum_sync_dtype: what the momenta travel and are averaged as: torch.bfloat16 (default,
            4 (N-1)/N bytes per element and sync) or torch.float32 (8 (N-1)/N, the Lion Cub code's).
        group: the process group (a lionbit one); default: the default group, or the attached model's.
        momentum_dtype: torch.float32 (default) or torch.bfloat16.
        hierarchy: "flat", "node" (exact) or "node_vote", with ``topology``: see lionbit.hierarchy.
        fused: the fused C++ kernels: None (default) wherever the dtypes allow, True, or False
            (plain torch ops). All give bitwise the same result. ``LIONBIT_KERNELS=aten`` turns them
            off everywhere (lionbit.kernel_choice; ``lionbit.kernels(device)`` says which run).
        double_buffer: a second buffer for every momentum: two passes over memory fewer a step (7 -> 5
            a parameter) for one more momentum's memory, bitwise the same steps; plain modules, DDP and
            FSDP2 / HSDP, aggregation vote/avg/sum (lionbit.next_momenta).

    Without a process group it is single-process Lion; with a plain module ``step()`` votes.
    With DDP, FSDP2 or FSDP1 call ``attach(model)`` once. ``p.grad`` after backward is each rank's
    own gradient; ``step()`` votes the directions of the gradients as they stand (after clipping or
    unscaling). ``torch.amp.GradScaler`` is supported (DDP, FSDP2, plain): an inf/NaN on any rank skips
    the step on every rank. Uneven inputs: ``with Join([model, opt]):``, the model first (a rank out of
    data abstains).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 aggregation: str = "vote", group: Optional[dist.ProcessGroup] = None,
                 momentum_dtype: Optional[torch.dtype] = None, fused: Optional[bool] = None, *,
                 bits: Optional[int] = None, tie_break: str = "zero", momentum_sync=None,
                 momentum_sync_dtype: torch.dtype = torch.bfloat16, hierarchy: str = "flat", topology=None,
                 double_buffer: bool = False):
        _refuse_zero_redundancy()
        _step_run_as_it_is_under_compile()
        bits = _checked_arguments(lr, betas, weight_decay, aggregation, bits, tie_break, momentum_dtype, group)
        self.hierarchy = optimizer_hierarchy(hierarchy, aggregation, group, topology)
        self.momentum_sync, self._sync = momentum_sync, msync.schedule(momentum_sync, momentum_sync_dtype)
        # "step": the steps applied (skipped ones not counted), kept in every
        # parameter group so that it travels in every kind of checkpoint.
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, step=0))
        self.aggregation, self.bits, self.tie_break = aggregation, bits, tie_break
        self.group, self.fused = group, fused
        self.momentum_dtype = momentum_dtype or torch.float32
        self.next_momenta = next_momenta.for_optimizer(double_buffer, bits)  # (None unless double_buffer)
        self.voter = Voter(aggregation, bits, tie_break, self, hierarchy)
        self._attachment: Attachment = Attachment(self, group)
        Joinable.__init__(self)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, refusing complex parameters (each group, also those of the constructor)."""
        super().add_param_group(_without_complex(param_group, len(getattr(self, "param_groups", []))))

    @property
    def steps_taken(self) -> int:
        """Steps applied so far (a skipped step is not counted); the same on every rank."""
        return max((int(g.get("step", 0)) for g in self.param_groups), default=0)

    @property
    def attachment(self) -> Attachment:
        """What this optimizer is attached to (lionbit.attachment); read-only."""
        return self._attachment

    # -- the package's surface (lionbit.attachment) ------------------------------
    def momentum_of(self, p: torch.Tensor, shape=None) -> torch.Tensor:
        """p's momentum (zero at first), of p's shape or ``shape``, in momentum_dtype."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(p.shape if shape is None else shape, dtype=self.momentum_dtype,
                                           device=p.device)
        return state["exp_avg"]

    def param_group_of(self) -> Dict[torch.Tensor, dict]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def fused_for(self, p: torch.Tensor, g: torch.Tensor) -> bool:
        # (a step of many tensors asks once a kind of pair: step_vote.fused_verdicts)
        ok = lion_math.fusable_layout(p) and g.is_contiguous() and _fused_dtypes(p.dtype, g.dtype, self.momentum_dtype)
        if self.fused and not ok:
            raise _no_fused_kernel(p, g, self.momentum_dtype)
        if not (ok if self.fused is None else self.fused):
            return False
        return kernel_choice.fused_lion_allowed(p.device)

    def check_params(self, params: Sequence[torch.Tensor], where: str) -> None:
        _check_params(params, where)

    # -- step ---------------------------------------------------------------------
    #: torch.amp.GradScaler hands this optimizer the step (and itself); others are told False.
    _step_supports_amp_scaling = property(_asked_by_grad_scaler)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Lion step from the gradients as they stand now (after any clipping or unscaling).
        With ``torch.amp.GradScaler`` the gradients are unscaled first (unless ``unscale_`` did);
        an inf/NaN on any rank makes every rank skip the step and every rank's scaler back off.
        Without a scaler an inf/NaN gradient on any rank raises on every rank, before anything changed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _refuse_scale_attributes(self)
        if not self.state and torch_internals.initializing_optimizer_state():
            self._attachment.momenta()  # torch filling a fresh optimizer's state (zero grads, lr 0): not a step
            return loss
        join.notify(self)
        self._take_step(grad_scaler, abstain=False)
        return loss

    @torch.no_grad()  # also when a join hook runs it, outside step()
    def _take_step(self, grad_scaler, abstain: bool) -> None:
        try:
            applied = self._attachment.step(grad_scaler, abstain)
        finally:
            self.voter.new_step()
            if self.next_momenta is not None:
                self.next_momenta.clear()
        if applied:
            n = self.steps_taken + 1
            for g in self.param_groups:
                g["step"] = n
            msync.after_step(self._sync, n, self._attachment)

    # -- attaching -----------------------------------------------------------------
    def attach(self, model, overlap: bool = True, context_parallel=None):
        """Route this optimizer's updates through the model's communication: DDP (a comm hook; ``overlap=True``
        starts the vote during backward where that is exact, ``False`` votes at ``step()``), FSDP2 or FSDP1 (the
        1-bit reduce-scatter; ``context_parallel``: FSDP2's cp mesh or group). A re-wrapped model: moves, momentum
        kept; a model another DistributedLion serves: takes it over (detaching that one, as dropping it does)."""
        kind, model = _attachment_kind(self, model)  # (the model inside torch.compile's or a framework's wrapper)
        if self._attachment.is_attached_to(model):
            raise RuntimeError("DistributedLion.attach: this optimizer is already attached to this model")
        next_momenta.check_attachment(self.next_momenta, kind)
        extra = _context_for(kind, context_parallel)
        if kind is not None:
            attached = kind(self, model, bool(overlap), **extra)  # checks everything, then installs
            self._attachment.release()
            self._attachment = attached.detach_when_dropped()
        return self

    def detach(self):
        """Undo attach(): the model's communication is its own again (a DDP model keeps a hook that
        averages the gradients as DDP does) and step() votes every parameter itself. Returns self."""
        _not_a_wrapper(self, "detach")
        self._attachment.release()
        self._attachment = Attachment(self, self.group)
        return self

    # -- checkpoints (per rank: each rank's momentum is its own) -------------------------
    def state_dict(self):
        """torch's state dict plus ``"lionbit": {"rank", "world_size"}``; FSDP2: lionbit.fsdp's."""
        return self._attachment.state_dict()

    def load_state_dict(self, state_dict):
        self._attachment.load_state_dict(state_dict)

    def sharded_state_dict(self) -> dict:
        """FSDP2, for torch.distributed.checkpoint: each rank's momentum as an (N, *shape) DTensor."""
        return self._attachment.sharded_state_dict()

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        self._attachment.load_sharded_state_dict(state_dict)

    def local_state_dict(self) -> dict:
        """FSDP1, for a per-rank file: each FSDP instance's flat momentum and the hyperparameters."""
        return self._attachment.local_state_dict()

    def load_local_state_dict(self, state_dict: dict) -> None:
        self._attachment.load_local_state_dict(state_dict)

    # -- torch's Join (uneven inputs) ---------------------------------------------
    def join_hook(self, **kwargs):
        self._attachment.join_hook_made()
        return join.LionJoinHook(self, lambda: self._take_step(None, abstain=True))

    @property
    def _join_config(self):  # torch's Joinable field: a Join sets it on each of its joinables, in order
        return self._join_cfg

    @_join_config.setter
    def _join_config(self, config) -> None:
        self._attachment.join_configured(config)  # may refuse the Join's order: then stay out of it
        self._join_cfg = config

    @property
    def join_device(self) -> torch.device:
        return join.device_of(self)

    @property
    def join_process_group(self):
        return self._attachment.group


def _no_fused_kernel(p: torch.Tensor, g: torch.Tensor, momentum_dtype) -> ValueError:
    return ValueError(
        f"DistributedLion(fused=True): no fused kernel for parameter {p.dtype}, gradient {g.dtype}, "
        f"momentum {momentum_dtype} (float32/bfloat16/float16 parameters, contiguous or of another dense "
        f"layout such as channels_last, and gradients; float32/bfloat16 momentum)")


def _refuse_scale_attributes(opt) -> None:
    """Raises where a GradScaler set ``grad_scale`` / ``found_inf`` on the
    optimizer (a protocol of some torch versions) instead of passing itself."""
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        raise RuntimeError(
            "DistributedLion.step: this torch's GradScaler set optimizer.grad_scale / found_inf instead of "
            "passing grad_scaler=; lionbit does not support that protocol yet (the step would use scaled "
            "gradients)")


def _refuse_zero_redundancy() -> None:
    """Raises where torch's ZeroRedundancyOptimizer is constructing this
    optimizer (``optimizer_class=DistributedLion``): it builds one over each
    rank's partition of the parameters. Looks at the few frames above."""
    if torch_internals.torch_caller(("torch.distributed.optim.zero_redundancy_optimizer",), depth=7) is not None:
        raise TypeError(
            "DistributedLion: ZeroRedundancyOptimizer gives each rank a different part of the parameters, and "
            "Distributed Lion votes every parameter on every rank (each rank keeps its own momentum of all of "
            "them); pass the parameters to DistributedLion directly, or shard the optimizer state with FSDP2 or "
            "HSDP (docs/fsdp.md)"
        )


def _context_for(kind, context_parallel) -> dict:
    """attach's ``context_parallel`` as the keyword of the attachment that takes it (FSDP2's), or a clear error."""
    if context_parallel is None:
        return {}
    if getattr(kind, "kind", None) != "FSDP2":
        raise NotImplementedError(
            f"DistributedLion.attach: argument 'context_parallel' is supported for FSDP2 (fully_shard) models, "
            f"not for {'a plain module' if kind is None else kind.kind}; shard the model with fully_shard over "
            f"the dp and cp ranks together"
        )
    return {"context_parallel": context_parallel}


def _attachment_kind(opt, model):
    """(the attachment for ``model``: DDP's, FSDP2's or FSDP1's, or None for
    a plain module; the model it attaches to). That is the model inside
    torch.compile's wrapper, and inside a framework's (Lightning Fabric's
    ``_FabricModule``): a child that is a DDP or FSDP model of all the
    wrapper's parameters. A model that holds fully_shard-ed parts but is not
    one itself is refused."""
    _not_a_wrapper(opt, "attach")
    model = torch_internals.compiled_inner(model)
    kind = _kind_of(model)
    if kind is None:
        params = set(map(id, model.parameters()))
        for child in map(torch_internals.compiled_inner, model.children()):
            inner = _kind_of(child)
            if inner is not None and set(map(id, child.parameters())) == params:
                return inner, child
        if fsdp_loaded():
            from . import fsdp  # optional: torch's FSDP, imported only by a program that uses it

            fsdp.check_not_partly_sharded(model)
    return kind, model


def _kind_of(model):
    if ddp.DDPAttachment.accepts(model):
        return ddp.DDPAttachment
    if not fsdp_loaded():
        return None
    from . import fsdp, fsdp1  # optional: torch's FSDP, imported only by a program that uses it

    return next((kind for kind in (fsdp.FSDP2Attachment, fsdp1.FSDP1Attachment) if kind.accepts(model)), None)


def _not_a_wrapper(opt, method: str) -> None:
    """Refuses a framework's wrapper of the optimizer (Lightning Fabric's
    ``_FabricOptimizer``, which inherits ``attach`` and reads the rest from the
    optimizer it wraps: what attach() set would be the wrapper's alone)."""
    if "param_groups" not in vars(opt):
        raise TypeError(
            f"DistributedLion.{method}: called on {type(opt).__name__}, a framework's wrapper of the optimizer; "
            f"call it on the DistributedLion you created (the one handed to the framework)"
        )
