"""DistributedLion on FSDP1 (``FullyShardedDataParallel``) models.

``opt.attach(model)`` on an FSDP1 root registers a communication hook
(``register_comm_hook``) on every FSDP instance of the model, each with its
own state object (a :class:`_Unit`) that knows the instance's
``FlatParameter``:

- sharded strategies (``FULL_SHARD``, ``SHARD_GRAD_OP``): FSDP calls
  ``hook(unit, padded_unsharded_grad, sharded_output)``. The padded gradient
  is this rank's local gradient of the flat parameter, padded at the end to
  N * S elements, chunk r (S elements) being rank r's shard. The hook keeps a
  copy of it, unpadded (the unit's *kept gradient*, this rank's full local
  gradient: DDP's ``p.grad``), and writes chunk r of it into FSDP's output,
  so the sharded ``p.grad`` after backward is this rank's shard of its own
  local gradient. Nothing is communicated in backward.
- ``NO_SHARD``: FSDP calls ``hook(unit, grad)`` with the whole local
  gradient, which stays in ``p.grad`` as under DDP.

``step()`` votes: for each sharded unit with a kept gradient (in the order
their hooks first ran, the same on every rank) it packs the Lion direction
of chunk r at bit r * 64 * ceil(S / 64) (padding skipped: no momentum, no
vote that counts) and runs lionbit's sign reduce-scatter (phase 1 of the
sign all-reduce only: (N - 1)/N * N*S/8 bytes per rank), which gives this
rank's shard of Delta; the NO_SHARD units are voted like DDP's parameters
(lionbit.step_vote). Only once every collective has succeeded (a
non-finite direction on any rank raises on every rank before anything
changed, lionbit.step_vote.NonFinite) is each unit's momentum updated from
its kept gradient and ``x = x * (1 - lr * wd) - lr * Delta`` applied to its
local flat-parameter shard, parameter by parameter (each original parameter's
hyperparameters come from its optimizer group as the groups stand; with
``use_orig_params=False`` the groups hold the FlatParameters). A parameter
that does not require a gradient at that step, or is in no group, is
skipped like padding and keeps its momentum (DDP's step for a parameter
without a gradient); one frozen at ``attach()`` trains once it requires a
gradient and is in a group. FSDP's next all-gather spreads the update. A
step that is the step before again replays its plan (lionbit.fsdp1_plan).

The kept gradient follows DDP's ``p.grad``: it accumulates over synchronized
backwards until the gradients are zeroed (``zero_grad()`` to None or to
zeros, seen through the sharded ``p.grad`` and its version counter), and
``model.clip_grad_norm_(max_norm, norm_type)`` (replaced on the root at
attach, restored at detach) clips the kept gradients of this rank by this
rank's own norm, computed as ``torch.nn.utils.clip_grad_norm_`` computes it on
DDP's per-parameter gradients. Any other edit of the sharded gradients
(``torch.nn.utils.clip_grad_norm_(model.parameters())``, which only sees
shards, an unscale, ...) cannot reach the kept gradient: ``step()`` raises.
Memory: the kept gradient is full-size, like the momentum (4 bytes per
parameter per rank in float32); after ``zero_grad()`` to None it is freed at
the next forward (a forward pre-hook on the root), before the activations.

Hybrid sharding (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``; FSDP2's HSDP
semantics, lionbit.fsdp's ``_Mesh``): each node (the L ranks of FSDP's
intra-node group) is one Distributed Lion worker. torch's register_comm_hook
refuses hybrid strategies, so attach sets the hook itself
(torch_internals.fsdp1_set_comm_hook); with it FSDP1 runs no all-reduce over
its inter-node group. The hook reduce-scatters over the node with FSDP1's
divide rule for L ranks, so the sharded gradient FSDP keeps and exposes is
this rank's shard of its node's mean (FSDP1's own clip_grad_norm_, unscaling
and accumulation act on it per node; lionbit replaces nothing). Each rank
keeps the momentum of its own shard (S elements); at ``step()`` each unit
with a gradient packs its shard's directions (the same pieces, every span at
shard 0) and the replicas (the inter-node group) vote with the sign
all-reduce; the node's ranks then agree to step or skip
(step_vote.node_agreed) and every replica applies the same update to its
shard.

Momentum: one flat full-size tensor per FSDP instance, in FlatParameter
order (alignment padding included, never touched), kept on the optimizer
(``opt.attachment.units``); ``opt.state[p]["exp_avg"]`` is a view of p's part
of it (:meth:`FSDP1Attachment.show_momenta`). Checkpoints: a file a rank
(lionbit.fsdp1_checkpoint).
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from . import fsdp1_checkpoint, fsdp1_plan, lion_math, step_vote, torch_internals
from ._backend import backend_for
from .attachment import Attachment, take_over
from .voter import end_to_end, runs

try:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
except ImportError:  # pragma: no cover - optional: a torch without FSDP1
    FSDP = ShardingStrategy = None

_WHERE = "DistributedLion.attach (FSDP1)"
_FSDP_PREFIX = "_fsdp_wrapped_module"


def is_fsdp1(model) -> bool:
    return FSDP is not None and isinstance(model, FSDP)


def _clean(name: str) -> str:
    """A module or parameter name without FSDP's wrapper prefixes ("b", not "_fsdp_wrapped_module.b")."""
    return name.replace(_FSDP_PREFIX + ".", "").replace(_FSDP_PREFIX, "")


class _Unit:
    """The comm-hook state of one FSDP instance: its FlatParameter's layout,
    hyperparameter groups per original parameter, local momentum and (sharded
    strategies) this rank's kept local gradient."""

    def __init__(self, att, module, layout, name: str, segments, numel: int, sharded: bool, group, replicas=None):
        self.att = att
        self.module = module
        self.name = name
        self.flat_param = fp = layout.flat_param
        # (offset in the unpadded flat param, numel, its parameter, fqn) per original parameter; the
        # parameter (use_orig_params=False: the FlatParameter) says at each step whether the segment trains
        self.segments = segments
        self.numel = numel  # unpadded flat numel (alignment padding included)
        self.sharded = sharded
        self.group = group  # FSDP's process group (hybrid: the node's L ranks)
        # Hybrid sharding: the inter-node group (this shard's replicas, one
        # rank a node), over which they vote; None otherwise.
        self.replicas = replicas
        self.momentum: Optional[torch.Tensor] = None
        self.device = fp.device  # where every buffer of the unit lives (its momentum, planes, Delta)
        self.shard_numel = fp.numel()  # S: FSDP shards at construction (padding included)
        # the momentum: full-size (unpadded, this rank's own); hybrid: this rank's shard of its node's
        self.momentum_numel = self.shard_numel if replicas is not None else numel
        self.divide = _divide_factors(group.size())  # hybrid: FSDP's pre/post factors for a node mean
        # use_orig_params=True: the original parameters, whose .grad (views of
        # the sharded flat gradient) are what the user sets to None
        self.orig = layout.params
        # Sharded strategies: this rank's full local flat gradient (unpadded),
        # kept from backward for step() and clipping; and the sharded gradient
        # tensor FSDP holds, with its version, as lionbit last saw it.
        self.kept: Optional[torch.Tensor] = None
        self.shown: Optional[torch.Tensor] = None
        self.shown_version = -1
        self.cuts = _cuts(self)  # the step's layout of its segments (sharded and hybrid units; fixed)

    @property
    def opt(self):
        return self.att.opt

    def momentum_tensor(self) -> torch.Tensor:
        if self.momentum is None:
            self.momentum = torch.zeros(self.momentum_numel, dtype=self.opt.momentum_dtype, device=self.device)
        return self.momentum

    @property
    def hybrid(self) -> bool:
        return self.replicas is not None

    @property
    def base(self) -> int:
        """The flat index of this rank's shard's first element."""
        return self.group.rank() * self.shard_numel

    def where(self) -> str:
        return f"DistributedLion (FSDP1 instance '{self.name or '<root>'}') on rank {dist.get_rank()}"

    def see(self, g: Optional[torch.Tensor]) -> None:
        """Records the sharded gradient as it stands now: lionbit's own state."""
        self.shown, self.shown_version = g, (-1 if g is None else torch_internals.version(g))


def _fsdp1_hook(unit: _Unit, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    with torch.no_grad():
        if output is None:
            _reduce_no_shard(unit, grad)
        elif unit.hybrid:
            _reduce_in_node(unit, grad, output)
        else:
            _keep_sharded(unit, grad, output)


def _divide_factors(n: int):
    """How FSDP1 averages over n ranks: divide by ``pre`` before the sum and
    by ``post`` after it (pre * post = n; pre the power of two at which
    doubling would pass sqrt(n) or stop dividing n), keeping the sum away
    from overflow and underflow alike."""
    pre = 1
    while n % pre == 0 and n > pre * pre:
        pre *= 2
    return float(pre), n / pre


def _reduce_in_node(unit: _Unit, grad: torch.Tensor, output: torch.Tensor) -> None:
    """The hybrid comm hook: FSDP1's own reduce-scatter over the node's L
    ranks, averaged over the node (FSDP1 would average over the world and
    all-reduce over the nodes next; the replicas vote at step() instead), so
    the sharded gradient FSDP keeps is this rank's shard of its node's mean
    gradient. FSDP accumulates it across backwards as it does its own."""
    n, s = unit.group.size(), output.numel()
    _check_grad(unit, grad, n * s)
    if s != unit.shard_numel:
        raise RuntimeError(f"{unit.where()}: FSDP's sharded gradient has {s} elements, expected {unit.shard_numel}")
    pre, post = unit.divide
    if pre > 1:
        grad.div_(pre)
    dist.reduce_scatter_tensor(output, grad, group=unit.group)
    if post > 1:
        output.div_(post)


def _check_grad(unit: _Unit, grad: torch.Tensor, expect: int) -> None:
    if grad.numel() != expect or grad.dim() != 1:
        raise RuntimeError(
            f"{unit.where()}: FSDP passed a gradient of shape {tuple(grad.shape)}, expected {expect} elements for "
            f"this unit's FlatParameter ({unit.numel} unpadded): an unsupported FSDP code "
            f"path or torch version (lionbit is tested with torch 2.15)"
        )


# -- the kept gradient follows the user's sharded gradient -----------------------


def _edited(unit: _Unit, when: str) -> RuntimeError:
    if when in ("step", "clip"):
        return RuntimeError(
            f"{unit.where()}: the sharded gradients (p.grad) were changed between backward() and "
            f"{'step()' if when == 'step' else 'model.clip_grad_norm_()'} by something other than "
            f"model.clip_grad_norm_: torch.nn.utils.clip_grad_norm_(model.parameters(), ...), GradScaler.unscale_ "
            f"or another in-place edit. Under sharded FSDP1 p.grad is only this rank's shard of its local "
            f"gradient; the Lion update uses this rank's full local gradient, which lionbit keeps until step(), so "
            f"an edit of the shard cannot reach it (and torch.nn.utils.clip_grad_norm_ would clip by the norm of "
            f"the shards). To clip, call model.clip_grad_norm_(max_norm) on the root FSDP module: attach() "
            f"replaced it with a per-rank clip of the full local gradients (DDP's semantics)"
        )
    return RuntimeError(
        f"{unit.where()}: the sharded gradient (p.grad) was changed after step() and before the next "
        f"{'forward' if when == 'forward' else 'backward'} other than by zeroing it: lionbit keeps this rank's "
        f"full local gradient (it accumulates until the gradients are zeroed, as under DDP) and cannot follow "
        f"an edit of the shard. Zero the gradients (opt.zero_grad() or model.zero_grad(), to None or to zeros) "
        f"or leave them alone"
    )


def _orig_grads_dropped(unit: _Unit) -> bool:
    """use_orig_params=True: whether every trainable original parameter with
    elements in this rank's shard has .grad None (FSDP then drops the flat
    gradient at the next forward)."""
    held = [p for p in unit.orig if p.requires_grad and p.numel() > 0]
    return bool(held) and all(p.grad is None for p in held)


def _reconcile(unit: _Unit, when: str) -> None:
    """Brings the unit's kept gradient in line with what the user did to the
    sharded gradient since lionbit last saw it, DDP's ``p.grad`` semantics:
    left alone, it stays (and accumulates); set to None, it is dropped; zeroed
    in place, it is zeroed. Any other edit raises. ``when``: "forward" (the
    root's forward pre-hook), "backward" (the unit's comm hook), "clip" or
    "step"."""
    if unit.kept is None:
        return
    fp = unit.flat_param
    # FSDP moves the sharded gradient there before a backward; it stays there
    # during no_sync() accumulation.
    g = torch_internals.fsdp1_saved_grad_shard(fp)
    if g is None and when != "backward":  # (in the hook, FSDP has cleared .grad)
        g = fp.grad
        if g is not None and g.numel() != unit.shard_numel:  # only the unsharded gradient of no_sync()
            g = None
        elif g is not None and unit.orig is not None and _orig_grads_dropped(unit):
            g = None
    if g is None:  # set to None: gone, as DDP's p.grad
        unit.kept = None
        unit.see(None)
        unit.att.order.remove(unit)
        return
    if (unit.shown is not None and g.data_ptr() == unit.shown.data_ptr()
            and torch_internals.version(unit.shown) == unit.shown_version):
        return  # untouched
    if g.numel() != unit.shard_numel or bool(g.any()):
        raise _edited(unit, when)
    unit.kept.zero_()  # zeroed in place
    unit.see(g)


def _check_synchronized(units, what: str) -> None:
    """step() and clipping need the gradients of a synchronized backward: not
    an unsharded no_sync() gradient (the kept gradient has not got it yet)."""
    for unit in units:
        g = unit.flat_param.grad
        if unit.sharded and g is not None and g.numel() != unit.shard_numel:
            raise RuntimeError(
                f"{unit.where()}: {what} during no_sync() gradient accumulation (the last backward ran under "
                f"model.no_sync()); run the last micro-batch's backward outside no_sync() first"
            )


def _fold_no_sync(unit: _Unit) -> None:
    """Before the next forward: a kept gradient (the user did not zero it)
    and a no_sync() backward's unsharded gradient g beside it, as FSDP holds
    them. DDP's p.grad adds micro-batch by micro-batch ((kept + g0) + g1 ...),
    FSDP would add their sum (kept + (g0 + g1 ...)) at the synchronized
    backward: so g goes into the kept gradient now (and its shard into FSDP's
    sharded gradient), and FSDP's unsharded one starts again from zeros."""
    fp = unit.flat_param
    saved = torch_internals.fsdp1_saved_grad_shard(fp)
    g = fp.grad
    if saved is None or g is None or g.numel() == unit.shard_numel:
        return
    s, rank = unit.shard_numel, unit.group.rank()
    flat = g.view(-1)
    unit.kept.add_(flat[: unit.numel])
    mine = flat[rank * s : (rank + 1) * s]
    saved[: mine.numel()].add_(mine)
    g.zero_()


def _keep_sharded(unit: _Unit, grad: torch.Tensor, output: torch.Tensor) -> None:
    """The sharded comm hook: keeps this rank's local gradient (accumulating
    onto a kept one the user did not zero) and writes its shard into FSDP's
    output, which FSDP adds to the sharded gradient it kept likewise."""
    att = unit.att
    n, rank = unit.group.size(), unit.group.rank()
    s = output.numel()
    _check_grad(unit, grad, n * s)
    if unit.numel > n * s or s != unit.shard_numel:
        raise RuntimeError(
            f"{unit.where()}: {unit.numel} flat elements in {n} shards of {s} (expected {unit.shard_numel})"
        )
    _reconcile(unit, "backward")
    local = grad[: unit.numel]
    if unit.kept is None:
        unit.kept = local.clone()  # (a copy: FSDP's buffer is its own)
        att.order.append(unit)
    else:
        unit.kept.add_(local)
    output.copy_(grad[rank * s : (rank + 1) * s])
    att.hooked.append(unit)
    # FSDP's end-of-backward callback (queued by the root's pre-backward hook,
    # so it runs before ours) moves the sharded gradient into .grad; ours
    # records that tensor and its version (one per hook: the first records
    # them all, the others find nothing left).
    torch_internals.queue_after_backward(att.record_grads)


def _reduce_no_shard(unit: _Unit, grad: torch.Tensor) -> None:
    """NO_SHARD is DDP's case: the gradient stays this rank's own (p.grad
    after backward is the local gradient, clipping and logging see it), and
    step() votes the directions of the gradients as they stand then."""
    _check_grad(unit, grad, unit.numel)


# -- step ----------------------------------------------------------------------


def _segments(unit: _Unit):
    """(segment, start, end) per original parameter with elements in what
    this rank's gradient and momentum cover: the whole flat parameter, or
    (hybrid) this rank's shard alone; [start, end) is the segment's part of
    it, as flat indices (of the whole flat parameter)."""
    lo, hi = (unit.base, unit.base + unit.shard_numel) if unit.hybrid else (0, unit.numel)
    for seg in unit.segments:
        off, numel = seg[0], seg[1]
        start, end = max(off, lo), min(off + numel, hi)
        if start < end:
            yield seg, start, end


def _cuts(unit: _Unit) -> list:
    """A sharded unit's step layout, one entry per segment with elements in
    what this rank's gradient and momentum cover (:func:`_segments`): (its
    index in ``unit.segments``, its first element and elements in the gradient
    and the momentum (hybrid: in this rank's shard), its spans for
    Voter.sharded_vote, its first element and elements in the local shard
    (0: none there)). Spans (r, start, length, at): elements [start, start +
    length) of the segment's part go to shard r at element ``at``, split at
    the shards' boundaries (element i of the flat parameter: shard i // S);
    hybrid: r = 0, the shard alone (Voter's replicated layout). Fixed for
    the unit's life: the layout, the rank and S are."""
    s, base = unit.shard_numel, unit.base
    origin = base if unit.hybrid else 0
    cuts = []
    index = {id(seg): i for i, seg in enumerate(unit.segments)}
    for seg, start, end in _segments(unit):
        off, numel = seg[0], seg[1]
        spans, lo = [], start
        while lo < end:
            r = lo // s
            hi = min(end, (r + 1) * s)
            spans.append((0 if unit.hybrid else r, lo - start, hi - lo, lo - r * s))
            lo = hi
        x_lo, x_hi = max(off, base), min(off + numel, base + s)
        cuts.append((index[id(seg)], start - origin, end - start, spans, x_lo - base, max(0, x_hi - x_lo)))
    return cuts


def _pieces(unit: _Unit, grad: torch.Tensor, groups: tuple):
    """The unit's training original parameters as pieces of
    Voter.sharded_vote (its :func:`_cuts`): each such segment's part of the
    gradient and the momentum (hybrid: this rank's shard of them) with its
    hyperparameters (``groups``: :func:`_step_groups`' of the unit) and spans."""
    m = unit.momentum_tensor()
    coefs = _coefs(unit.opt)
    return [(grad[a : a + n], m[a : a + n], coefs[groups[i]], spans) for i, a, n, spans, _, _ in unit.cuts
            if groups[i] is not None]


def _coefs(opt) -> list:
    """Each parameter group's hyperparameters as they stand now (a segment's
    group index picks one): one Coefs a group, not one a segment."""
    return [lion_math.Coefs(g) for g in opt.param_groups]


def _step_groups(att) -> dict:
    """Per unit, each segment's parameter group at this step, by index into
    ``opt.param_groups`` as they stand (torch's load_state_dict replaces the
    group dicts, add_param_group adds one), or None where its parameter does
    not train now (``requires_grad`` False, or in no group): DDP's step,
    where a frozen parameter has no gradient and keeps its momentum."""
    index = {id(p): gi for gi, g in enumerate(att.opt.param_groups) for p in g["params"]}
    return {unit: tuple(index.get(id(owner)) if owner.requires_grad else None for _, _, owner, _ in unit.segments)
            for unit in att.units}


def _local_shard(unit: _Unit) -> torch.Tensor:
    local = unit.flat_param.data
    if local.numel() != unit.shard_numel or not local.is_contiguous():
        raise RuntimeError(
            f"{unit.where()}: step() found the local FlatParameter with {local.numel()} elements, its shard has "
            f"{unit.shard_numel} (is the model still unsharded, e.g. inside summon_full_params?)"
        )
    return local


def _shard_grad(unit: _Unit) -> Optional[torch.Tensor]:
    """Hybrid: this rank's shard of its node's mean gradient, FSDP's sharded
    gradient as the user left it (clipped, unscaled); None: no gradient."""
    g = unit.flat_param.grad
    if g is None or (unit.orig is not None and _orig_grads_dropped(unit)):
        return None
    if g.numel() != unit.shard_numel:
        raise RuntimeError(
            f"{unit.where()}: step() found a sharded gradient of {g.numel()} elements, this rank's shard has "
            f"{unit.shard_numel}; change p.grad in place (clipping, unscaling) or set it to None, but do not "
            f"replace it"
        )
    return g.view(-1) if g.is_contiguous() else g.contiguous().view(-1)


def _vote_units(units, grads, groups: dict, agreed: list, works: list, calls: list) -> list:
    """The vote of the directions of each unit's gradient in ``grads`` (the
    kept gradient; hybrid: its shard of the node's mean): this rank's shard
    of Delta per unit, as (element, count) -> Delta of those elements of the
    shard (a view of its call's values, or lion_math.VotedPlanes where the
    vote returns planes; padding is never read), by the sign reduce-scatter
    over the units' group (hybrid: the sign all-reduce of the shards over
    their replicas). Consecutive units of one group and device share one
    call, their shards end to end in each of its shards, while its planes
    stay within step_vote.chunk_limit (a larger unit is a call of its own).
    Changes no state. Every call is left in flight, its agreement and
    future appended to ``agreed`` and ``works`` (Voter.sharded_vote), and
    Delta is read once the caller has waited for them. Each call is
    described in ``calls`` (its units, their first elements in a shard,
    elements in a shard, group, replicated, where) for the step's plan."""
    deltas = []

    def group_of(unit):
        return unit.replicas if unit.hybrid else unit.group

    def planes_of(item):  # elements of planes a unit adds to its call
        unit = item[0]
        return unit.shard_numel * (1 if unit.hybrid else unit.group.size())

    for run in runs(list(zip(units, grads)), lambda item: (id(group_of(item[0])), item[0].hybrid, item[0].device),
                    planes_of, lambda item: step_vote.chunk_limit(item[0].device)):
        pieces, s, bases = end_to_end([(_pieces(unit, grad, groups[unit]), unit.shard_numel) for unit, grad in run])
        first, opt = run[0][0], run[0][0].opt
        group = group_of(first)
        planes = opt.voter.votes_into_planes(first.device, group)
        where = "step (FSDP1 hybrid: the replicas' all-reduce)" if first.hybrid else "step (FSDP1)"
        delta = opt.voter.sharded_vote(pieces, s, group, first.device, where, step_vote.fused_verdicts(opt), agreed,
                                       works, replicated=first.hybrid, into_planes=planes)
        calls.append(([unit for unit, _ in run], bases, s, group, first.hybrid, where))
        delta_of = lion_math.delta_views(delta, planes)
        for _, base in zip(run, bases):
            deltas.append(lambda at, n, base=base, delta_of=delta_of: delta_of(base + at, n))
    return deltas


def _state_changes(unit: _Unit, grad: torch.Tensor, delta, groups: tuple):
    """A unit's state change as step_vote.update_state's items, original
    parameter by original parameter (its :func:`_cuts`, those that train:
    ``groups``, :func:`_step_groups`' of the unit): the momenta from
    ``grad`` (full-size; hybrid: this rank's shard), and the local shard of
    the parameters by ``delta`` (:func:`_vote_units`' accessor of the unit's
    shard)."""
    m, x = unit.momentum_tensor(), _local_shard(unit)
    momenta, applies = [], []
    fused_for = step_vote.fused_verdicts(unit.opt)
    coefs_of = _coefs(unit.opt)
    m_fused = x_fused = None  # (the same for every segment: slices of the same flat tensors and Delta)
    for i, a, n, _, x_at, x_n in unit.cuts:
        if groups[i] is None:
            continue
        coefs = coefs_of[groups[i]]
        gs, ms = grad[a : a + n], m[a : a + n]
        if m_fused is None:
            m_fused = fused_for(ms, gs)
        momenta.append((gs, ms, coefs, m_fused))
        if x_n:
            xs, ds = x[x_at : x_at + x_n], delta(x_at, x_n)
            if x_fused is None:
                x_fused = fused_for(xs, ds)
            applies.append((xs, ds, coefs, x_fused))
    return momenta, applies


def _all_state_changes(units, grads, deltas, groups: dict):
    """:func:`_state_changes` of every unit, as two lists (momenta, applies)."""
    momenta, applies = [], []
    for unit, grad, delta in zip(units, grads, deltas):
        unit_momenta, unit_applies = _state_changes(unit, grad, delta, groups[unit])
        momenta += unit_momenta
        applies += unit_applies
    return momenta, applies


def no_shard_entries(att, groups: dict) -> list:
    """The step_vote entries of every NO_SHARD unit with a gradient: one per
    segment of the flat parameter whose parameter trains now (``groups``:
    :func:`_step_groups`)."""
    opt = att.opt
    entries = []
    fused_for = step_vote.fused_verdicts(opt)
    coefs = _coefs(opt)
    for unit in att.units:
        fp = unit.flat_param
        if unit.sharded or fp.grad is None:
            continue
        g, x, m = fp.grad.view(-1), fp.data.view(-1), unit.momentum_tensor()
        if g.numel() < unit.numel or x.numel() < unit.numel:
            raise RuntimeError(
                f"{unit.where()}: step() found a flat gradient of {g.numel()} elements, expected {unit.numel}"
            )
        fused = fused_for(x, g)  # (every segment a slice of these flat tensors: the same verdict)
        entries += [step_vote.Entry(x[off : off + numel], g[off : off + numel], m[off : off + numel], coefs[group],
                                    fused) for (off, numel, _, _), group in zip(unit.segments, groups[unit])
                    if group is not None]
    return entries


class FSDP1Attachment(Attachment):
    """An FSDP1 model's attachment: a comm hook with one :class:`_Unit` per
    FSDP instance, the sharded units' kept gradients and the root's
    ``clip_grad_norm_``."""

    kind = "FSDP1"
    serves_next_momenta = False  # (each unit's momenta are views of one flat buffer: one buffer)

    @staticmethod
    def accepts(model) -> bool:
        return is_fsdp1(model)

    def __init__(self, opt, model, overlap: bool = True):
        super().__init__(opt, None)
        self.model = model
        self.order: List[_Unit] = []  # sharded units with a kept gradient, in the order their hooks first ran
        self.hooked: List[_Unit] = []  # sharded units whose hook ran in the current backward
        self.units, self.states, group, self.replicas = _units(self, opt, model)
        self.hybrid = self.replicas is not None
        self.plan = fsdp1_plan.FSDP1Plan()  # the step, replayed where it is the step before again
        # the vote's group (momentum sync, checkpoints' marker); hybrid: the replicas (the inter-node group)
        self.group = self.replicas if self.hybrid else (opt.group if opt.group is not None else group)
        self.norm_order = _norm_order(model, self.units)
        hooked = [torch_internals.fsdp1_hook_state(st) for st in self.states if torch_internals.fsdp1_comm_hook(st)]
        take_over(unit.att for unit in hooked if unit is not None)  # (lionbit's hooks: another optimizer's)
        self.show_momenta()
        by_module = {u.module: u for u in self.units}
        self.forward_hook = None
        if self.hybrid:
            # register_comm_hook refuses hybrid strategies: set what it would
            # set (torch's other checks, root and one hook, ran in _units).
            for state in self.states:
                torch_internals.fsdp1_set_comm_hook(state, _fsdp1_hook, by_module.get(state))
            # FSDP1's own model.clip_grad_norm_ stays: it clips the node's mean
            # gradient (its shards, over the node's group) by the node's norm.
            return
        # torch's own checks (root, hybrid, one hook), then one state object per instance.
        model.register_comm_hook(self.units[0], _fsdp1_hook)
        for state in self.states:
            if torch_internals.fsdp1_comm_hook(state) is not _fsdp1_hook:
                raise RuntimeError(f"{_WHERE}: register_comm_hook did not reach every FSDP instance")
            torch_internals.fsdp1_set_hook_state(state, by_module.get(state))
        # FSDP1's clipping API, on this model only (an instance attribute: not
        # in its state_dict; detach() restores FSDP's method).
        self.users_clip = vars(model).get("clip_grad_norm_")
        model.clip_grad_norm_ = self.clip_grad_norm_
        self.forward_hook = model.register_forward_pre_hook(self._before_forward)

    def is_attached_to(self, model) -> bool:
        return model is self.model

    def detach(self) -> None:
        for state in self.states:
            torch_internals.fsdp1_clear_comm_hook(state)  # FSDP's own reduce-scatter again
        if self.forward_hook is not None:
            self.forward_hook.remove()
        if vars(self.model).get("clip_grad_norm_") == self.clip_grad_norm_:
            if self.users_clip is None:
                del self.model.clip_grad_norm_
            else:
                self.model.clip_grad_norm_ = self.users_clip
        for unit in self.units:
            unit.kept = None
            unit.see(None)
        self.order, self.hooked = [], []
        opt = self.opt  # (None where the optimizer was dropped: its state went with it)
        for p in self.shown if opt is not None else ():
            opt.state.pop(p, None)

    def show_momenta(self) -> None:
        """Every parameter's momentum in ``opt.state[p]["exp_avg"]``: a view of
        its unit's flat momentum (the whole of it for a FlatParameter; the
        segment, hybrid: its part in this rank's shard, for an original
        parameter), so that what reads an optimizer's state sees it, and torch's
        ``_init_optim_state`` (which steps an optimizer with an empty state on
        zero gradients) leaves this one alone. The units' tensors stay the
        momentum; a loaded state dict is copied into them, and this is run
        again after torch replaced ``opt.state``."""
        known = self.opt.param_group_of()
        self.shown = []
        for unit in self.units:
            m = unit.momentum_tensor()
            if unit.flat_param in known:  # use_orig_params=False: the optimizer holds the FlatParameter
                self.opt.state[unit.flat_param]["exp_avg"] = m
                self.shown.append(unit.flat_param)
                continue
            origin = unit.base if unit.hybrid else 0
            for seg, start, end in _segments(unit):
                owner = seg[2]
                if owner in known:
                    self.opt.state[owner]["exp_avg"] = m[start - origin : end - origin]
                    self.shown.append(owner)

    # -- backward ---------------------------------------------------------------
    def record_grads(self) -> None:
        """At the end of a backward: the sharded gradients FSDP set, as lionbit's state."""
        hooked, self.hooked = self.hooked, []
        for unit in hooked:
            unit.see(unit.flat_param.grad)

    def _before_forward(self, module, args) -> None:
        """Frees the kept gradients the user dropped (zero_grad(set_to_none=True))
        before the forward, whose activations need the memory, and adds the
        gradient of a no_sync() backward to a kept one."""
        for unit in list(self.order):
            _reconcile(unit, "forward")
            if unit.kept is not None:
                _fold_no_sync(unit)

    # -- clipping -----------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """FSDP1's ``model.clip_grad_norm_``, per rank as under DDP: clips this
        rank's local gradients (the kept full gradients of the sharded
        instances, the gradients of NO_SHARD ones) by this rank's own norm, as
        ``torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm,
        norm_type)`` does with DistributedLion: the norms per original
        parameter in the unwrapped module's parameter order, their norm,
        coefficient min(max_norm / (total + 1e-6), 1). Runs no collective.
        Returns this rank's total norm (0 without gradients)."""
        _check_synchronized(self.units, "model.clip_grad_norm_()")
        for unit in list(self.order):
            _reconcile(unit, "clip")
        grads, whole = [], []
        for unit, index, param in self.norm_order:
            if unit is None:
                g = param.grad
            else:
                off, numel, owner, _ = unit.segments[index]
                flat = unit.kept if unit.sharded else unit.flat_param.grad
                # (a frozen parameter has no gradient, as under DDP)
                g = None if flat is None or not owner.requires_grad else flat.view(-1)[off : off + numel]
            if g is not None:
                grads.append(g)
        for unit in self.units:
            fp = unit.flat_param
            if unit.sharded and unit.kept is not None:
                whole += [unit.kept] + ([fp.grad] if fp.grad is not None else [])
            elif not unit.sharded and fp.grad is not None:
                whole.append(fp.grad)
        whole += [param.grad for unit, _, param in self.norm_order if unit is None and param.grad is not None]
        # torch's own computation of the total norm (per-tensor norms, then their norm)
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if grads:
            coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
            for g in whole:  # elementwise: the same products as per parameter
                g.mul_(coef.to(g.device))
            for unit in self.order:
                unit.see(unit.flat_param.grad)
        return total

    # -- step -----------------------------------------------------------------------
    def step(self, grad_scaler=None, abstain: bool = False) -> bool:
        if self.hybrid:
            return self.hybrid_step(grad_scaler, abstain)
        if grad_scaler is not None:
            raise RuntimeError(
                "DistributedLion.step (FSDP1): GradScaler is not supported with FSDP: its unscale_ and inf checks "
                "see the sharded p.grad, not the full local gradients lionbit votes from. Use bfloat16 mixed "
                "precision instead (torch.autocast with dtype=torch.bfloat16), which needs no loss scaling"
            )
        return step_vote.voted_step(self.opt, None, lambda: self.vote_step(abstain), abstain)

    def vote_step(self, abstain: bool):
        """Votes every sharded unit with a kept gradient (in self.order, the
        same on every rank) and the NO_SHARD units, every call started
        before any is waited for: as planned (lionbit.fsdp1_plan) where the
        plan describes the step, else by the general path, which plans the
        next. Updates the momenta (full-size: this rank's local gradients)
        once every rank has agreed to every call, while the bits still move;
        returns the function that applies Delta to the local shards. A rank
        that abstains (Join) has no sharded vote to give. Raises
        step_vote.NonFinite (on every rank alike), changing nothing."""
        units = []
        _check_synchronized(self.units, "step()")
        if not abstain:
            for unit in list(self.order):
                _reconcile(unit, "step")
            units = list(self.order)
        shards = [_local_shard(unit) for unit in units]  # before any collective
        groups = _step_groups(self)
        sources = [(unit, unit.kept, x, groups[unit]) for unit, x in zip(units, shards)] + [
            (unit, unit.flat_param.grad, unit.flat_param.data, groups[unit]) for unit in self.units
            if not unit.sharded and unit.flat_param.grad is not None]
        started = None if abstain else self.plan.start(self, sources)
        if started is not None:
            agreed, works, momenta, apply = started
            step_vote.wait_votes(agreed)  # raises NonFinite (nothing changed) as the votes would
            self.plan.replayed += 1
            momenta()
            step_vote.wait_votes(works)
            return apply
        entries = no_shard_entries(self, groups)
        if entries:
            self.check_entries(entries)  # before any collective
        grads = [unit.kept for unit in units]
        agreed, works, calls = [], [], []
        deltas = _vote_units(units, grads, groups, agreed, works, calls)
        if entries and units and self.group is not units[0].group:
            # The optimizer's own group: another communicator, whose calls
            # start once the units' bits are in (no two communicators' NCCL
            # kernels in flight at once, in different orders on different ranks).
            step_vote.wait_votes(works)
        no_shard = self.start_vote(entries, agreed, works)
        if not abstain:
            self.plan.learn(self, sources, calls, step_vote.fused_verdicts(self.opt))
        momenta, applies = _all_state_changes(units, grads, deltas, groups)
        applies += step_vote.apply_items(entries, no_shard)
        step_vote.wait_votes(agreed)  # raises NonFinite (nothing changed) as the votes would
        step_vote.update_state(momenta + step_vote.momentum_items(entries), [])
        step_vote.wait_votes(works)
        return lambda: step_vote.update_state([], applies)

    @staticmethod
    def _applier(units, grads, deltas, works, groups: dict):
        """Hybrid: the function that applies voted deltas once the node's
        ranks agreed: the units' momenta from their gradients, while the
        votes' bits (``works``) still move, then their local shards, in a few
        list calls (step_vote.update_state: on a GPU a launch per dtype
        pair)."""

        def apply():
            momenta, applies = _all_state_changes(units, grads, deltas, groups)
            step_vote.update_state(momenta, [])
            step_vote.wait_votes(works)
            step_vote.update_state([], applies)

        return apply

    def hybrid_step(self, grad_scaler, abstain: bool) -> bool:
        """HYBRID_SHARD / _HYBRID_SHARD_ZERO2: each node one worker. Every
        unit with a gradient (in the units' order, the same on every rank)
        votes its shard of the node's mean gradient over its replicas; the
        node's ranks then agree to step or not (step_vote.node_agreed). Under
        a GradScaler the sharded gradients are unscaled first, as FSDP1's
        own optimizers see them."""
        if abstain:
            raise NotImplementedError(
                f"DistributedLion.step (FSDP1 hybrid) on rank {dist.get_rank()}: torch's Join (uneven inputs) is "
                f"not supported with hybrid sharding"
            )
        device = self.units[0].device
        return step_vote.voted_step(self.opt, grad_scaler, lambda: step_vote.node_agreed(
            self.vote_hybrid, (self.units[0].group,), device, "FSDP1 hybrid"))

    def vote_hybrid(self, settle: bool = False):
        """Starts the vote of every hybrid unit with a gradient (as planned
        where the plan describes the step, lionbit.fsdp1_plan) and waits
        until every call is agreed to (``settle``: until its bits are in),
        changing nothing; returns the function that applies the step once
        the node's ranks agreed (the momenta while the bits still move, then
        the shards)."""
        _check_synchronized(self.units, "step()")
        units, grads = [], []
        for unit in self.units:
            g = _shard_grad(unit)
            if g is not None:
                _local_shard(unit)  # before any collective
                units.append(unit)
                grads.append(g)
        groups = _step_groups(self)
        sources = [(unit, g, unit.flat_param.data, groups[unit]) for unit, g in zip(units, grads)]
        started = self.plan.start(self, sources)
        if started is not None:
            agreed, works, momenta, apply = started
            step_vote.wait_votes(agreed)  # raises NonFinite (nothing changed) as the votes would
            self.plan.replayed += 1
            if settle:
                step_vote.wait_votes(works)

            def planned() -> None:
                momenta()
                step_vote.wait_votes(works)
                apply()

            return planned
        agreed, works, calls = [], [], []
        deltas = _vote_units(units, grads, groups, agreed, works, calls)
        self.plan.learn(self, sources, calls, step_vote.fused_verdicts(self.opt))
        step_vote.wait_votes(agreed)  # raises NonFinite (nothing changed) as the votes would
        if settle:
            step_vote.wait_votes(works)
        return self._applier(units, grads, deltas, works, groups)

    def momenta(self):
        out = []
        for unit in self.units:
            m = unit.momentum_tensor()
            origin = unit.base if unit.hybrid else 0
            out += [m[start - origin : end - origin] for _, start, end in _segments(unit)]
        return out

    def state_dict(self) -> dict:
        return fsdp1_checkpoint.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        fsdp1_checkpoint.load_state_dict(self, sd)

    def local_state_dict(self) -> dict:
        return fsdp1_checkpoint.local_state_dict(self)

    def load_local_state_dict(self, state_dict: dict) -> None:
        fsdp1_checkpoint.load_local_state_dict(self, state_dict)


def _norm_order(model, units) -> list:
    """(unit, segment index, None) per original parameter of the units and
    (None, None, parameter) per trainable parameter FSDP does not manage, in
    the order of the unwrapped module's named_parameters(): the order in
    which DDP's clip_grad_norm_(model.parameters()) stacks the norms (their
    norm's rounding depends on it). A module's parameters lie in one unit, in
    their order; modules are ordered as in the module tree."""
    position = {}
    for name, _ in model.named_modules():
        position.setdefault(_clean(name), len(position))
    managed = set()
    keyed = []
    for u, unit in enumerate(units):
        fp = unit.flat_param
        managed.add(fp)
        managed.update(unit.orig or [])
        for i, (_, _, _, fqn) in enumerate(unit.segments):
            module = fqn.rpartition(".")[0]
            keyed.append(((position.get(module, len(position)), u, i), (unit, i, None)))
    for name, p in model.named_parameters():
        if p.requires_grad and p not in managed:
            module = _clean(name).rpartition(".")[0]
            keyed.append(((position.get(module, len(position)), len(units), len(keyed)), (None, None, p)))
    keyed.sort(key=lambda kv: kv[0])
    return [v for _, v in keyed]


_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _units(att, opt, model):
    """Checks an FSDP1 model; returns (its units, its FSDP states, its
    process group, the inter-node group of hybrid sharding or None)."""
    try:
        states = torch_internals.fsdp1_states(model)
    except AttributeError as err:
        raise torch_internals.unsupported(_WHERE, str(err)) from None
    if not model.check_is_root():
        raise ValueError(f"{_WHERE}: attach the root FullyShardedDataParallel instance, not a nested one")
    # module names without FSDP's wrapper prefixes ("b", not "_fsdp_wrapped_module.b")
    names = {m: _clean(n) for n, m in model.named_modules()}
    known = opt.param_group_of()
    units: List[_Unit] = []
    covered = set()
    group0 = replicas0 = hybrid0 = None
    for state in states:
        if not isinstance(state, FSDP):
            raise NotImplementedError(
                f"{_WHERE}: composable FSDP1 states are not supported, only FullyShardedDataParallel modules"
            )
        name = names.get(state, "?")
        label = f"FSDP instance '{name or '<root>'}'"
        strategy = state.sharding_strategy
        # Hybrid: the instance has an inter-node group. (With one rank a node
        # FSDP runs a hybrid instance as NO_SHARD, whose reduction covers the
        # node alone: the whole gradient is the node's, and the replicas vote.)
        replicas = torch_internals.fsdp1_inter_node_group(state)
        hybrid = strategy.name in _HYBRID or replicas is not None
        if hybrid0 is None:
            hybrid0 = hybrid
        elif hybrid != hybrid0:
            raise NotImplementedError(
                f"{_WHERE} on rank {dist.get_rank()}: {label} uses sharding_strategy={strategy.name} and the root "
                f"{'does not' if hybrid else 'does'} shard hybrid; one model either shards hybrid (HYBRID_SHARD, "
                f"_HYBRID_SHARD_ZERO2: each node one Distributed Lion worker) in every FSDP instance or in none"
            )
        if hybrid:
            if replicas is None:
                raise torch_internals.unsupported(_WHERE, f"{label} shards hybrid but has no _inter_node_pg")
            if replicas0 is None:
                replicas0 = replicas
            elif replicas is not replicas0:
                raise NotImplementedError(
                    f"{_WHERE} on rank {dist.get_rank()}: {label} has another inter-node process group than the "
                    f"root; pass the same process_group=(intra_node, inter_node) (or device_mesh) to every instance"
                )
        hook = torch_internals.fsdp1_comm_hook(state)
        if hook is not None and hook is not _fsdp1_hook:  # (lionbit's: another DistributedLion's, taken over)
            raise RuntimeError(f"{_WHERE}: {label} already has a communication hook")
        if state.cpu_offload is not None and state.cpu_offload.offload_params:
            raise NotImplementedError(f"{_WHERE}: {label}: CPUOffload(offload_params=True) is not supported")
        if torch_internals.fsdp1_on_a_sliced_mesh(state):
            raise NotImplementedError(
                f"{_WHERE} on rank {dist.get_rank()}: {label} shards over a device mesh sliced out of a larger one "
                f"(tensor parallelism beside FSDP1), which is not supported: the ranks that hold parts of one "
                f"worker's gradient would not agree whether to step; FSDP2 (fully_shard over mesh['dp']) supports "
                f"tensor parallelism"
            )
        _check_mixed_precision(state.mixed_precision, label)
        if group0 is None:
            group0 = state.process_group
        elif state.process_group is not group0:
            raise NotImplementedError(f"{_WHERE}: {label} uses another process group than the root")
        layout = torch_internals.fsdp1_layout(state)
        if layout is None:
            continue
        fp = layout.flat_param
        opt.check_params([fp], "attach (FSDP1)")  # CPU, or CUDA where this build has the CUDA path
        if layout.use_orig_params and layout.params is None:
            raise RuntimeError(
                f"{_WHERE}: {label}: use_orig_params=True but the FlatParameter keeps no original parameters"
            )
        prefix = f"{name}." if name else ""
        segments = []
        off, i = 0, 0
        for numel, padding, fqn in layout.spans:
            if not padding:
                # Every original parameter is a segment, frozen or not: one frozen now may train later
                # (requires_grad_(True), in the optimizer from the start or by add_param_group).
                owner = layout.params[i] if layout.use_orig_params else fp
                if owner.requires_grad and owner not in known:
                    raise ValueError(
                        f"{_WHERE}: the FSDP model's parameter '{prefix + fqn}' "
                        + ("" if layout.use_orig_params else f"(in the FlatParameter of {label}) ")
                        + "is not in this optimizer; it would be voted with no momentum or hyperparameters"
                    )
                covered.add(owner)
                segments.append((off, numel, owner, prefix + fqn))
                i += 1
            off += numel
        if off != layout.unpadded_numel:
            raise RuntimeError(
                f"{_WHERE}: {label}: FlatParameter layout covers {off} elements, "
                f"its size is {layout.unpadded_numel}"
            )
        sharded = strategy != ShardingStrategy.NO_SHARD
        units.append(_Unit(att, state, layout, name, segments, off, sharded, state.process_group,
                           replicas0 if hybrid else None))
    if not units:
        raise ValueError(f"{_WHERE}: the model has no parameters managed by FSDP")
    stray = [p for p in known if p not in covered]
    fqns = {p: _clean(n) for n, p in model.named_parameters()} if stray else {}
    unsharded = [fqns[p] for p in stray if p in fqns]
    if unsharded:  # the model's own, which FSDP left unflattened: its ignored states
        raise ValueError(
            f"{_WHERE}: this optimizer's parameters {unsharded[:5]} are the model's but not managed by FSDP "
            f"(FSDP's ignored_states or ignored_modules): FSDP reduces no gradient of theirs and DistributedLion "
            f"steps only FSDP's parameters; let FSDP manage them, or leave them out of this optimizer"
        )
    if stray:
        raise ValueError(
            f"{_WHERE}: {len(stray)} of this optimizer's parameters are not managed by the FSDP model "
            f"(with use_orig_params=False pass model.parameters(), the FlatParameters)"
        )
    if replicas0 is not None:
        _check_hybrid(opt, group0, replicas0, units[0].device)
        return units, states, group0, replicas0
    backend_for(group0, units[0].device, "attach (FSDP1)")  # a lionbit group, or a clear error
    return units, states, group0, None


def _check_mixed_precision(mp, label: str) -> None:
    """FSDP1 ``MixedPrecision``: bfloat16 (or float32) compute and reduce
    dtypes work. FSDP casts the gradient to ``reduce_dtype`` before the comm
    hook: a sharded instance keeps it in that dtype; a NO_SHARD one votes
    ``p.grad``, which FSDP casts back to the parameters' dtype after the hook
    (unless ``keep_low_precision_grads``). Float16 is refused: it needs a loss
    scale, and GradScaler is refused under FSDP1 (its checks see the shards)."""
    if mp is None:
        return
    for k in ("param_dtype", "reduce_dtype"):
        if getattr(mp, k, None) == torch.float16:
            raise NotImplementedError(
                f"{_WHERE}: {label}: MixedPrecision({k}=torch.float16) is not supported: float16 gradients need "
                f"a loss scale, and GradScaler does not work with lionbit's FSDP1 path (its checks see the shards, "
                f"not the local gradients lionbit votes from); use torch.bfloat16, which needs none"
            )


def _check_hybrid(opt, nodes_group, replicas, device) -> None:
    """What hybrid sharding cannot do: refused at attach, naming the argument."""
    layout = f"{replicas.size()} nodes x {nodes_group.size()} ranks"
    if opt.aggregation == "l1":
        raise NotImplementedError(
            f"{_WHERE}: argument 'aggregation'='l1' is not supported with hybrid sharding (rank {dist.get_rank()}, "
            f"{layout}): its L1 scale is per tensor, and a rank holds only its shard of the node's; use 'vote' or "
            f"'avg'"
        )
    if getattr(opt.voter, "hierarchy", "flat") != "flat":
        raise ValueError(
            f"{_WHERE}: argument 'hierarchy'={opt.voter.hierarchy!r} does not apply to hybrid sharding (rank "
            f"{dist.get_rank()}, {layout}): the replicas already vote over the inter-node group, one rank a node; "
            f"use hierarchy='flat'"
        )
    # the vote's group must be lionbit's (a clear error otherwise)
    backend_for(replicas, device, "attach (FSDP1 hybrid: the inter-node group)")
