"""DistributedLion on ``DistributedDataParallel``: a comm hook that leaves
each rank's own gradient in ``p.grad`` (no gradient all-reduce at all) and,
where that is exact, starts the vote of the Lion directions during backward.

``p.grad`` after ``backward()`` is this rank's local gradient (DDP does not
divide by the world size when a comm hook is registered; nothing is
averaged). ``step()`` uses the gradients as they stand then:

- overlap (the default): the hook packs each bucket's directions from the
  local gradients and the momentum (read only) and starts their vote at
  once, overlapping the rest of backward. After DDP has written the
  gradients back, the version counter of every ``p.grad`` is recorded.
  ``step()`` checks them and the ranks agree (one round of flags on the
  group's standard path, beside the votes still moving): if no rank's
  gradients changed and no rank had a non-finite direction, the votes
  started in backward are the step's: every momentum is updated at once
  (one list call a dtype pair, not one a bucket), and each bucket's
  parameters as soon as its vote is in, while the last buckets' votes
  still move. If any rank's gradients changed (clipping, unscaling, any in-place
  edit), those votes are dropped, ``step()`` votes the directions of the
  changed gradients, logs once why, and votes at ``step()`` from then on.
- at step (``attach(model, overlap=False)``, or after a fallback): the hook
  returns the bucket untouched; ``step()`` votes chunk by chunk
  (lionbit.step_vote).

Either way the momentum and parameters change only once every rank knows
that no rank had a non-finite direction (with overlap, from the agreement;
at step(), from every vote's header round). A vote that fails after that
(a peer lost mid-step: the group is unusable from then on) leaves the
buckets before it stepped. A parameter with a
gradient that is in none of DDP's buckets (unfrozen after DDP wrapped the
model) is voted at ``step()`` in both modes, after the buckets' votes.

Uneven inputs, ``with Join([model, opt]):`` (torch.distributed.algorithms.join):
a rank that has run out of data runs DDP's join hook, which calls this comm
hook on zero buckets outside any backward pass. There the hook abstains: it
packs direction 0 and starts the same votes as its peers' hooks (with
overlap). The optimizer's join hook, which follows DDP's in the same round,
then runs the step its peers run, abstaining: it says "unchanged" in the
agreement round, keeps its momentum and applies the voted update to the
parameters it stepped last. Without the optimizer in the Join the hook
refuses at once: it takes part in its peers' calls of the step with a
rejected header and says so in their agreement round (they fail at once,
naming join) and raises, naming the fix.
"""

import logging
import weakref
from itertools import accumulate, repeat
from operator import attrgetter, is_, methodcaller
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import join, lion_math, step_vote, torch_internals
from ._backend import backend_for
from .attachment import ATTACHED_DDP_MODELS, Attachment, take_over
from .errors import PeerRejected

log = logging.getLogger("lionbit")

_WHERE = "DistributedLion (DDP comm hook)"

_contiguous, _numel, _grad = methodcaller("is_contiguous"), methodcaller("numel"), attrgetter("grad")

_JOIN_FIX = "`with Join([model, opt]):` (from torch.distributed.algorithms.join import Join; the DDP model first)"


class _BucketVote:
    __slots__ = ("params", "sizes", "planes", "out", "work", "bad", "tally", "copies", "versions")

    def __init__(self):
        self.params, self.sizes, self.planes, self.out, self.work = [], [], None, None, None
        self.copies = {}  # parameter -> the contiguous copy of its gradient the hook read (not contiguous ones)
        self.bad = 0  # this rank's non-finite directions in the bucket counted on the host
        self.tally = None  # and on a GPU the device tally of the rest (read at step(), not in the hook)
        self.versions = None  # each gradient's (id, version) after DDP wrote it back (_version_of)


def _nonfinite(votes) -> int:
    """This rank's non-finite directions in ``votes``: the host's counts and,
    on a GPU, the buckets' device tallies summed there and read in one round
    trip (one host sync a step, not one a bucket)."""
    tallies = [bv.tally.view(-1) for bv in votes if bv.tally is not None]
    device = int(torch.cat(tallies).sum()) if tallies else 0
    return sum(bv.bad for bv in votes) + device


class _HookSlot:
    """The state DDP hands lionbit's comm hook: the attachment it serves, or
    None once detached (DDP takes one comm hook per model, for good, so the
    hook stays, and without an attachment it averages the gradients over the
    model's group as DDP's own all-reduce does)."""

    def __init__(self, group):
        self.attachment: Optional["DDPAttachment"] = None
        self.group = group


_slots: "weakref.WeakKeyDictionary[DDP, _HookSlot]" = weakref.WeakKeyDictionary()


class DDPAttachment(Attachment):
    """The comm-hook state of one DDP model."""

    kind = "DDP"

    @staticmethod
    def accepts(model) -> bool:
        return isinstance(model, DDP) or torch_internals.is_replicated(model)

    def __init__(self, opt, model, overlap: bool):
        self.wrapper = model  # what the user attached: the DDP model, or a module given to replicate()
        model, names = _ddp_of(model)
        super().__init__(opt, opt.group if opt.group is not None else model.process_group)
        known = opt.param_group_of()
        missing = [names[p] for p in model.module.parameters() if p.requires_grad and p not in known]
        if missing:
            raise ValueError(
                f"DistributedLion.attach: the DDP model's parameters {missing[:5]} are not in this optimizer; "
                f"DDP would vote them with no momentum or hyperparameters. Freeze them (requires_grad_(False)) "
                f"before wrapping the model in DDP, or give them to this optimizer (to train them later: a "
                f"parameter group of their own with lr=0 until then)"
            )
        backend_for(self.group, next(model.parameters()).device, "attach")  # a lionbit group, or a clear error
        opt.check_params([p for p in model.module.parameters() if p.requires_grad], "attach (DDP)")
        slot = _slots.get(model)
        self.model = model
        self.overlap = overlap
        self.buckets: Dict[int, _BucketVote] = {}  # bucket index -> its vote, kept across steps
        self.coefs_index = lion_math.CoefsIndex()  # a bucket's hyperparameters, without hashing the model's
        self.started: List[_BucketVote] = []  # votes started in this backward
        self.versions: Optional[bool] = None  # True once each started bucket's grads' versions are recorded
        self.fallbacks = 0
        self.hooked = False  # whether the hook ran since the last step (else: is another DDP training?)
        self.join = join.ModelJoin(model)  # torch's Join: is the optimizer in the model's current one?
        self.join_due = False  # a joined rank shadowed a synchronized backward: its step is due
        if slot is None:
            other = torch_internals.ddp_comm_hook_name(model)
            if other is not None:
                raise RuntimeError(
                    f"DistributedLion.attach on rank {dist.get_rank()}: the DDP model already has a comm hook "
                    f"({other}), and DDP takes one; DistributedLion's own replaces DDP's all-reduce with the 1-bit "
                    f"vote, so build the DDP model without registering {other}"
                )
            slot = _slots[model] = _HookSlot(model.process_group)
            model.register_comm_hook(slot, _hook)
        else:
            take_over([slot.attachment])
        slot.attachment = self
        ATTACHED_DDP_MODELS.add(model)
        self.slot = slot

    def is_attached_to(self, model) -> bool:
        return model is self.model or model is self.wrapper

    def holds_local_gradients(self) -> bool:
        return self.hooked

    def detach(self) -> None:
        _drain(self.started)
        self.started = []
        self.slot.attachment = None
        ATTACHED_DDP_MODELS.discard(self.model)

    # -- backward -------------------------------------------------------------
    def start_bucket(self, bucket, abstain: bool = False) -> None:
        """Packs the bucket's directions (``abstain``: direction 0, a joined
        rank's) and starts their vote."""
        idx = bucket.index()
        bv = self.buckets.get(idx)
        if bv is not None and bv.work is not None:
            # A second synchronized backward before step(): the gradients
            # accumulate, and this bucket's new vote supersedes the old one.
            _drain([bv])
            self.started = [b for b in self.started if b is not bv]
        buffer = bucket.buffer()
        params = bucket.parameters()
        grads, copies = bucket_gradients(params, bucket.gradients())
        total = buffer.numel()
        bits = self.opt.voter.bits
        if (
            bv is None
            or bv.planes[0].numel() != lion_math.plane_bytes(total) * (bits or 1)
            or bv.planes[0].device != buffer.device
        ):
            # (DDP rebuilds its buckets after the first step: sizes change once.)
            bv = self.buckets[idx] = _BucketVote()
            bv.planes = self.opt.voter.planes(total, buffer.device)
            if self.opt.voter.votes_into_planes(buffer.device, self.group):
                bv.out = torch.empty(2 * lion_math.plane_bytes(total), dtype=torch.uint8, device=buffer.device)
            else:
                bv.out = torch.empty(total, dtype=self.opt.voter.delta_dtype, device=buffer.device)
        else:
            for plane in bv.planes:
                if plane is not None:
                    plane.zero_()
        sign, zero = bv.planes
        bv.params, bv.copies = list(params), copies
        bv.sizes = list(map(_numel, grads))
        offsets = list(accumulate(bv.sizes, initial=0))  # each gradient's first element; the last: the total
        self.opt.check_params(bv.params, "attach (DDP hook)")
        items = []
        if abstain:
            for n, off in zip(bv.sizes, offsets):
                lion_math.pack_abstain(n, sign, zero, off, bits)
        else:  # read in C, column by column (a bucket's tens of tensors, a step's hundreds)
            coefs = self.coefs_index.coefs(self.opt.param_groups, bv.params)
            fused = step_vote.fused_verdicts(self.opt).many(bv.params, grads)
            items = list(zip(grads, map(self.opt.momentum_of, bv.params), coefs, fused, offsets, repeat(0),
                             bv.sizes))
        bad, tally = step_vote.pack_directions(items, sign, zero, bits, self.opt.next_momenta)
        if offsets[-1] != total:
            raise RuntimeError(f"{_WHERE}: DDP bucket holds {total} elements, its gradients {offsets[-1]}")
        bv.bad, bv.tally, bv.versions = bad, tally, None
        bv.work = self.opt.voter.all_reduce(sign, zero, total, bad, bv.out, self.group, "attach (DDP hook)",
                                            out_planes=bv.out.dtype == torch.uint8, nans_tally=tally)
        self.started = [b for b in self.started if b is not bv] + [bv]
        if bucket.is_last() and not abstain:
            _after_ddp_finalize(self._record_versions)

    def shadow_bucket(self, bucket) -> None:
        """The hook as DDP's join hook runs it on a rank that has run out of
        data (zero gradients, outside any backward): abstain from the vote
        its peers' hooks start; the optimizer's join hook runs the step."""
        if not self.join.includes_optimizer():
            self.refuse_shadow(bucket)
        if self.overlap:
            self.start_bucket(bucket, abstain=True)
        if bucket.is_last():
            self.join_due = True

    def refuse_shadow(self, bucket) -> None:
        """The optimizer is not in the Join: this rank cannot take its peers'
        step. It takes part in each lionbit call of their step with a header
        the backend rejects (their calls fail at once, not at the group's
        timeout: one per bucket with overlap, and a refusal in their step()'s
        agreement round; else one per vote at step()) and raises at the
        last bucket."""
        calls = 1 if self.overlap else 0
        if bucket.is_last() and not self.overlap:
            params = self.layout if self.layout is not None else [p for p in self.model.parameters() if p.requires_grad]
            calls = len(step_vote.chunking([p.numel() for p in params],
                                           step_vote.chunk_limit(bucket.buffer().device)))
        for _ in range(calls):
            _reject_call(self.group, bucket.buffer().device)
        if bucket.is_last():
            if self.overlap:  # the peers' step() agrees with this rank first: it says it refused
                try:
                    _agree(self.group, changed=False, bad=0, refused=True)
                except RuntimeError:
                    pass
            raise RuntimeError(
                f"{_WHERE} on rank {dist.get_rank()}: this rank ran out of data and shadows its peers' "
                f"backward (DDP's model.join() or Join([model])), but the DistributedLion attached to the model is "
                f"not part of that Join, so this rank cannot take the steps its peers take (they would wait for it "
                f"until the group's timeout; their step() fails now instead). Use {_JOIN_FIX}"
            )

    def join_hook_made(self) -> None:
        self.join.hook_made()

    def join_configured(self, config) -> None:
        self.join.configured(config)

    def join_step_due(self) -> bool:
        due, self.join_due = self.join_due, False
        return due

    def _record_versions(self) -> None:
        for bv in self.started:
            bv.versions = list(map(_version_of, map(_grad, bv.params)))
        self.versions = True

    # -- step -----------------------------------------------------------------
    def step(self, grad_scaler=None, abstain: bool = False) -> bool:
        if not (abstain or self.hooked):  # (a framework wrapped the model again, say)
            self.check_ddp_once()
        self.hooked = False
        scaled = grad_scaler is not None
        try:
            return step_vote.voted_step(self.opt, grad_scaler, lambda: self.vote_step(scaled, abstain), abstain)
        except PeerRejected as err:
            # The user's error (a RuntimeError, as DDP's own join errors) names the fix.
            raise RuntimeError(
                f"{err}. If that rank ran out of data under DDP's model.join() or Join([model]) without the "
                f"optimizer (its own error says so): use {_JOIN_FIX}"
            ) from err

    def vote_step(self, scaled: bool, abstain: bool = False):
        """Votes the step and returns the function that applies it (votes at
        step() change the momenta once every rank agreed to them, as a plain
        module's: Attachment.vote_now); raises step_vote.NonFinite, changing
        nothing. ``scaled``: a GradScaler
        scaled the gradients the hooks saw (its unscaling does not bump
        version counters). ``abstain``: this rank has joined (Join): its
        votes are 0 and its gradients count as unchanged."""
        started, self.started = self.started, []
        versions, self.versions = self.versions, None
        if started:
            # Under a TorchDispatchMode (FlopCounterMode, ...) in-place ops do
            # not bump version counters: nothing can be told, so vote again.
            dispatch_mode = torch_internals.in_dispatch_mode()
            changed = not abstain and (
                scaled or dispatch_mode or versions is None or any(bv.work is None for bv in started) or any(
                    bv.versions != list(map(_version_of, map(_grad, bv.params))) for bv in started
                )
            )
            changed, bad_ranks, refused = _agree(self.group, changed, _nonfinite(started))
            if refused:
                # Their hooks' calls were rejected: the votes fail with the backend's error, naming them.
                err = _drain(started)
                raise err or PeerRejected(
                    f"{_WHERE} on rank {dist.get_rank()}: rank(s) {refused} rejected their input to this "
                    f"call",
                    refused,
                )
            if not changed:
                if bad_ranks:
                    _drain(started)
                    raise step_vote.NonFinite(bad_ranks)
                return self._overlapped(started, abstain)
            _drain(started)
            self.overlap = False
            self.fallbacks += 1
            log.warning(
                "lionbit: DistributedLion: the gradients changed between backward() and step() on at least one rank "
                "(gradient clipping, GradScaler unscaling or another in-place edit), so the votes started during "
                "backward were dropped and this step voted the changed gradients; from now on this model votes at "
                "step() (attach(model, overlap=False) says so from the start)"
            )
        return self.vote_now(abstain)  # as a plain module votes at step(): its plan replayed where it fits

    def _overlapped(self, started, abstain: bool):
        """The step of the votes started in backward. Every rank has said
        its directions are finite, so every momentum is updated at once,
        while the last buckets' bits may still move, and each bucket's
        parameters as soon as its vote is in."""
        coefs_of = None  # every parameter's, made for the first bucket read tensor by tensor
        # A joined rank steps the parameters it stepped last (its peers'
        # gradients decide theirs; with the same gradients present, the same).
        stepped = None if self.layout is None or not abstain else set(self.layout)
        plan = []
        fused_for = step_vote.fused_verdicts(self.opt)
        for bv in started:
            entries, deltas, off = [], [], 0
            delta_of = lion_math.delta_views(bv.out, bv.out.dtype == torch.uint8)
            copies, bv.copies = bv.copies, {}
            columns = None if abstain or copies else self._bucket_columns(bv, delta_of, fused_for)
            if columns is not None:
                plan.append((bv, *columns))
                continue
            coefs_of = coefs_of or lion_math.coefs_by_param(self.opt.param_groups)
            for p, n in zip(bv.params, bv.sizes):
                g = p.grad
                coefs = coefs_of[p]
                if abstain and (stepped is None or p in stepped):
                    entries.append(step_vote.abstaining(self.opt, p, coefs))
                elif not abstain and g is not None:
                    if not g.is_contiguous():  # channels_last: the copy the hook read (p.grad unchanged since)
                        g = copies[p] if p in copies else g.contiguous()
                    entries.append(step_vote.Entry(p, g, self.opt.momentum_of(p), coefs, fused_for(p, g)))
                else:
                    # Unused on every rank (find_unused_parameters): DDP left no
                    # gradient, and the parameter is not stepped, as at step().
                    off += n
                    continue
                deltas.append(delta_of(off, n))
                off += n
            plan.append((bv, step_vote.momentum_items(entries), step_vote.apply_items(entries, deltas)))
        # Parameters with a gradient in none of the buckets (unfrozen after
        # DDP wrapped the model): voted now, in the optimizer's order, as at
        # step() (entries(False) also records this step's layout; a joined
        # rank that never stepped knows of none). Their vote queues behind
        # the buckets' and can still find a non-finite direction: it is done
        # before anything changes.
        in_buckets = {p for bv in started for p in bv.params}
        rest = [] if abstain and self.layout is None else self.entries(abstain, in_buckets)
        apply_rest = self.vote([e for e in rest if e.param not in in_buckets])
        def apply():
            step_vote.update_state([m for _, momenta, _ in plan for m in momenta], [], self.opt.next_momenta)
            for i, (bv, _, applies) in enumerate(plan):
                try:
                    bv.work.wait()
                except (RuntimeError, ValueError):
                    # Not a non-finite direction (every rank said so): a lost
                    # peer. The buckets before this one are stepped.
                    _drain([b for b, _, _ in plan[i + 1 :]])
                    raise
                finally:
                    bv.work = None
                step_vote.update_state([], applies)
            apply_rest()

        return apply

    def _bucket_columns(self, bv, delta_of, fused_for):
        """A bucket's state change as step_vote.update_state's (momenta,
        applies), read column by column (no Python a tensor), where every one
        of its parameters has a contiguous gradient (most steps); else None."""
        gs = list(map(_grad, bv.params))
        if any(map(is_, gs, repeat(None))) or not all(map(_contiguous, gs)):
            return None
        coefs = self.coefs_index.coefs(self.opt.param_groups, bv.params)
        fused = fused_for.many(bv.params, gs)
        deltas = list(map(delta_of, accumulate(bv.sizes, initial=0), bv.sizes))
        return (list(zip(gs, map(self.opt.momentum_of, bv.params), coefs, fused)),
                list(zip(bv.params, deltas, coefs, fused)))


def _ddp_of(model) -> Tuple[DDP, Dict[torch.Tensor, str]]:
    """The DistributedDataParallel that reduces ``model``'s gradients, and its
    parameters' names as the user knows them: the model itself, or the DDP
    that composable replicate() builds over the module (torchtitan's DDP)."""
    if isinstance(model, DDP):
        return model, {p: n for n, p in model.module.named_parameters()}
    return torch_internals.replicate_ddp(model, "DistributedLion.attach"), {p: n for n, p in model.named_parameters()}


def _drain(votes) -> Optional[BaseException]:
    """Waits for ``votes`` and drops them; returns the first error one
    raised (every rank saw the same header; the vote is dropped)."""
    first = None
    for bv in votes:
        if bv.work is not None:
            try:
                bv.work.wait()
            except (RuntimeError, ValueError) as err:
                first = first or err
            bv.work = None
        bv.copies = {}
    return first


def _agree(group, changed: bool, bad: int, refused: bool = False) -> Tuple[bool, List[int], List[int]]:
    """The round by which every rank's step() agrees on the votes its hooks
    started: whether any rank's gradients changed since (then every rank
    drops them), which ranks had a non-finite direction (then no rank
    changes anything) and which ranks refused (a joined rank whose Join
    lacks the optimizer). One round of CPU flags on the group's standard
    path (step_vote.gather_flags), beside the sign path: it does not queue
    behind the votes still moving, so the step knows at once that it will be
    applied. Returns (changed, bad ranks, refused ranks)."""
    rank = dist.get_rank()
    flags = torch.tensor([int(changed), bad, int(refused)], dtype=torch.int64)
    try:
        rows = step_vote.gather_flags(flags, group).tolist()
    except RuntimeError as err:
        raise RuntimeError(
            f"lionbit {_WHERE} on rank {rank}: step()'s agreement round over the inner gloo communicator failed: {err}"
        ) from err
    bad_ranks = [r for r, row in enumerate(rows) if row[1] > 0]
    refused_ranks = [r for r, row in enumerate(rows) if row[2] > 0]
    if bad_ranks or refused_ranks:  # errors name global ranks, as the backend's do
        named = step_vote.global_ranks(group)
        bad_ranks, refused_ranks = [named[r] for r in bad_ranks], [named[r] for r in refused_ranks]
    return any(row[0] for row in rows), bad_ranks, refused_ranks


def _reject_call(group, device) -> None:
    """Takes part in the peers' next lionbit call with an argument the
    backend rejects: its header round tells them (their call fails at once,
    "rank(s) [r] rejected their input to this call")."""
    sign, zero = lion_math.planes(0, device)
    out = torch.empty(0, dtype=torch.bfloat16, device=device)
    try:
        backend_for(group, device, "step").all_reduce_sign_packed(sign, zero, -1, 0, out, "vote", "zero", -1)
    except (RuntimeError, ValueError):
        pass  # expected: the backend refused it (and told the peers)


def bucket_gradients(params, grads) -> Tuple[List[torch.Tensor], Dict[torch.Tensor, torch.Tensor]]:
    """Each parameter's local gradient in DDP's bucket, element for element,
    from ``GradBucket.parameters()`` and ``.gradients()``; and the copies
    made, by parameter. DDP copies a gradient into its bucket through a view
    with the strides its parameter had when DDP laid the bucket out (a
    channels_last convolution weight's own, where dense), but
    ``gradients()`` views every one C-contiguously: for such a weight its
    elements come out of order (a direction packed from it votes one
    element's sign for another's). For a parameter that is not contiguous,
    the gradient autograd left in ``p.grad`` holds the same values in a
    layout it states, whatever layout the bucket has: that is read, as a
    contiguous copy (the fused kernels' layout). Without one (unused on this
    rank under find_unused_parameters) the bucket holds zeros, in any order.
    Where every parameter is contiguous (most models) this is one check in C."""
    if all(map(_contiguous, params)):
        return grads, {}
    copies = {}
    for i, p in enumerate(params):
        own = p.grad
        if not p.is_contiguous() and own is not None and own.shape == grads[i].shape:
            grads[i] = copies[p] = own if own.is_contiguous() else own.contiguous()
    return grads, copies


def _version_of(g):
    """What tells whether p.grad changed: the tensor and its in-place version (None: no gradient)."""
    return None if g is None else (id(g), torch_internals.version(g))


def _after_ddp_finalize(fn) -> None:
    """Runs fn at the end of this backward, after DDP's own end-of-backward
    callback (which waits for the hooks' futures and writes the buckets back
    into p.grad). DDP queues that callback right after the last bucket's hook
    returns; a callback queued from within the hook runs before it, so ours
    queues a second one, which runs after it."""
    try:
        torch_internals.queue_after_backward(lambda: torch_internals.queue_after_backward(fn))
    except RuntimeError:  # not in a backward pass (the hook run by hand): nothing to wait for
        fn()


def _hook(slot: _HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's local gradients go back to p.grad as they
    are; with overlap, their directions' vote starts now. Detached (or its
    optimizer dropped): the mean over the group, as DDP's own all-reduce."""
    att = slot.attachment
    if att is None:
        grads = bucket.buffer().div_(slot.group.size())
        return dist.all_reduce(grads, group=slot.group, async_op=True).get_future().then(lambda f: f.value()[0])
    att.hooked = True
    if not torch_internals.in_backward():
        # Outside any backward pass: DDP's join hook shadowing the peers'
        # backward on a rank that has run out of data (torch's Join).
        with torch.no_grad():
            att.shadow_bucket(bucket)
    elif att.overlap:
        with torch.no_grad():
            att.start_bucket(bucket)
    fut = torch.futures.Future(devices=[bucket.buffer().device] if bucket.buffer().is_cuda else None)
    fut.set_result(bucket.buffer())
    return fut
