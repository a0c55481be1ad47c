"""Voting at ``step()``: the Lion directions of the gradients as they stand
when ``step()`` runs, voted chunk by chunk (each chunk's collective in
flight while the next chunk's directions are packed), then the momentum and
the parameters updated. Nothing changes on any rank until every chunk's
vote is done: a non-finite direction on any rank (reported to every rank by
the vote's header round, before any data moves) leaves every rank's state
as it was. Used by a plain module (the steps its plan does not replay,
lionbit.step_plan), by DDP (when the votes did not start in backward) and
by FSDP1 ``NO_SHARD``; :func:`voted_step` and
:func:`node_agreed` by every integration.
"""

import logging
from itertools import accumulate, repeat
from operator import attrgetter, itemgetter, methodcaller
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from . import kernel_choice, lion_math, torch_internals
from .errors import NonFiniteInput

log = logging.getLogger("lionbit")

# Elements per vote: big enough that a vote's fixed costs (a 72-byte header
# round, the all-to-all's set-up) are small against its bytes, small enough
# that a model has several chunks to pipeline.
CHUNK_ELEMENTS = 1 << 22
# On a GPU a vote's fixed costs are its kernel launches and host round trips
# (about 130 launches a call on an H200, docs/cuda.md), and the backend's
# own chunk on a GPU is as large (bits::default_chunk_elems): a call is one
# chunk, and a GPT-2-medium-shaped model's 355M parameters in 292 tensors
# are 2 calls, not 123.
CHUNK_ELEMENTS_GPU = 1 << 28


def chunk_limit(device) -> int:
    """Elements per vote on `device`."""
    return CHUNK_ELEMENTS_GPU if torch.device(device).type == "cuda" else CHUNK_ELEMENTS


class NonFinite(Exception):
    """A direction was NaN or infinite on the given ranks; no state changed."""

    def __init__(self, ranks: Sequence[int]):
        super().__init__(f"non-finite gradient on rank(s) {list(ranks)}")
        self.ranks = sorted(set(ranks))


def nonfinite_ranks(err: BaseException) -> Optional[List[int]]:
    """The ranks a vote's header round named as holding NaN/Inf input
    (:class:`lionbit.NonFiniteInput`), or None if ``err`` is another error."""
    return list(err.ranks) if isinstance(err, NonFiniteInput) else None


class Entry:
    """One tensor of a step: its parameter (to update), gradient, momentum,
    hyperparameters and whether the fused kernels serve it. A step reads
    its entries column by column (``_column``, ``_columns``): map() over
    hundreds of entries runs in C, no Python code a tensor."""

    __slots__ = ("param", "grad", "momentum", "coefs", "fused", "abstain", "numel")

    def __init__(self, param, grad, momentum, coefs, fused, abstain=False):
        self.param, self.grad, self.momentum, self.coefs, self.fused = param, grad, momentum, coefs, fused
        self.numel = grad.numel()
        # A rank that ran out of data (Join) votes 0 and keeps its momentum.
        self.abstain = abstain


#: Entry's fields as getters, read in C by map(): one column of a step's entries.
_column = {name: attrgetter(name) for name in Entry.__slots__}


def _columns(entries, *names):
    """Those fields of every entry, each as an iterator (zip them into items)."""
    return [map(_column[name], entries) for name in names]


def _offsets(entries) -> List[int]:
    """Each entry's first element in a vote of them all, end to end."""
    return list(accumulate(map(_column["numel"], entries), initial=0))[:-1]


class VoteBuffers:
    """Bit-planes and result buffers of one layout (the chunking of a list of
    tensor sizes), kept across steps: a step of a model whose gradients did
    not change shape allocates nothing."""

    def __init__(self):
        self.key = None
        self.chunks: List[Tuple[int, int, int]] = []  # (first entry, end entry, elements)
        self.planes = []
        self.outs = []

    def prepare(self, sizes: Sequence[int], device, delta_dtype, bits=None, into_planes: bool = False):
        """``into_planes``: each chunk's Delta as a vote's result planes (uint8:
        the sign plane, then the zero plane), not values of ``delta_dtype``."""
        key = (tuple(sizes), str(device), delta_dtype, bits, into_planes)
        if key == self.key:
            for sign, zero in self.planes:
                sign.zero_()
                if zero is not None:
                    zero.zero_()
            return
        chunks = chunking(sizes, chunk_limit(device))
        self.key, self.chunks = key, chunks
        self.planes = [lion_math.planes(t, device, bits) for _, _, t in chunks]
        if into_planes:
            self.outs = [torch.empty(2 * lion_math.plane_bytes(t), dtype=torch.uint8, device=device)
                         for _, _, t in chunks]
        else:
            self.outs = [torch.empty(t, dtype=delta_dtype, device=device) for _, _, t in chunks]


def chunking(sizes: Sequence[int], limit: int = CHUNK_ELEMENTS) -> List[Tuple[int, int, int]]:
    """How a step of tensors of ``sizes`` elements is split into votes of at
    most ``limit`` elements (a larger tensor is a vote of its own):
    (first entry, end entry, elements) per vote."""
    chunks, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if total and total + n > limit:
            chunks.append((start, i, total))
            start, total = i, 0
        total += n
    if start < len(sizes):
        chunks.append((start, len(sizes), total))
    return chunks


def _by_coefs(items):
    """The fused ones of ``items`` ((a, b, coefs, fused, *rest)) grouped by
    hyperparameter values (a launch of the GPU's list kernels each), as
    (coefs, [(a, b, *rest)]), and the others as they are. Where every item
    is fused with one parameter group's coefs (most models) it is read in C,
    not item by item."""
    if not items:
        return [], []
    cols = list(zip(*items))
    coefs = cols[2]
    if all(cols[3]) and coefs.count(coefs[0]) == len(coefs):  # (Coefs compare by identity)
        return [(coefs[0], list(zip(cols[0], cols[1], *cols[4:])))], []
    groups, rest = {}, []
    for item in items:
        if item[3]:
            groups.setdefault(item[2].values, (item[2], []))[1].append(item[:2] + item[4:])
        else:
            rest.append(item)
    return groups.values(), rest


def pack_directions(items, sign, zero, bits=None, nexts=None):
    """Packs the Lion directions of ``items`` ((g, m, coefs, fused,
    bit_offset, start, length): elements [start, start + length) of g and m,
    on one device; m only read) into the planes; returns
    (non-finite directions counted, tally): on a GPU the fused kernels add
    theirs to ``tally``, a one-element int64 tensor on the device that the
    vote reads when it runs (its ``nans_tally``: reading it here would wait
    for the kernels, inside backward for DDP's hook); on the CPU None. The
    fused tensors of the same hyperparameters go in one call (the list
    kernels: on a GPU a launch per dtype pair, where their first-use check
    passed; not with ``bits``). ``nexts`` (lionbit.next_momenta, the
    optimizer's with double_buffer=True): the fused kernels also write each
    momentum's next value into its second buffer."""
    if not items:
        return 0, None
    device = items[0][0].device
    counts = torch.zeros(2, dtype=torch.int64, device=device) if items[0][0].is_cuda else None
    groups, rest = ((), items)
    if not bits and kernel_choice.list_kernels_allowed(device):
        groups, rest = _by_coefs(items)
    if bits:
        nexts = None  # (the level packing reads m only; the momentum is updated after the agreement)
    bad = 0
    for g, m, coefs, fused, off, a, k in rest:
        out = None
        if nexts is not None and fused:  # the second buffer's span, as m's (None: m updated after the agreement)
            out = nexts.out(m, a, k)
            if out is not None:
                out = lion_math.span(out, a, k)
        elif nexts is not None:
            nexts.forget(m)
        bad += lion_math.pack_direction(lion_math.span(g, a, k), lion_math.span(m, a, k), coefs, sign, zero, off,
                                        fused, bits, counts=counts, m_out=out)
    for coefs, group_items in groups:
        if nexts is not None:
            group_items = [(*item, nexts.out(item[1], item[3], item[4])) for item in group_items]
        bad += lion_math.pack_directions_list(group_items, coefs, sign, zero, counts)
    return bad, (counts[1:] if counts is not None else None)


def vote_chunks(opt, entries: Sequence[Entry], group, where: str, buffers: VoteBuffers,
                on_agreed: Optional[Callable[[], None]] = None):
    """Packs and votes ``entries`` chunk by chunk. Returns the list of Delta
    views (one per entry); raises :class:`NonFinite` (on every rank alike)
    if any rank had a non-finite direction, changing no state. ``on_agreed``:
    called once every rank has agreed to every vote (their header rounds:
    no direction non-finite anywhere), while the votes' bits still move
    (the momentum update, which does not read Delta); a vote that fails
    after that is a fault (a lost peer, a timeout), raised here."""
    agreed, works = ([] if on_agreed is not None else None), []
    deltas = start_chunks(opt, entries, group, where, buffers, agreed, works)
    if on_agreed is not None:
        wait_votes(agreed)
        on_agreed()
    wait_votes(works)
    return deltas


def start_chunks(opt, entries: Sequence[Entry], group, where: str, buffers: VoteBuffers,
                 agreed: Optional[list], works: list) -> list:
    """Packs ``entries`` chunk by chunk and starts their votes, each call's
    future appended to ``works`` and (where given) its agreement to
    ``agreed`` (Voter.all_reduce's); returns the Delta views (one per
    entry), which hold Delta once :func:`wait_votes` of ``works`` returns.
    Changes no state: :func:`vote_chunks` waits, or a caller with other
    calls of the same step waits for all of them together."""
    device = entries[0].param.device
    voter = opt.voter
    into_planes = voter.votes_into_planes(device, group)
    buffers.prepare([e.numel for e in entries], device, voter.delta_dtype, voter.bits, into_planes)
    offsets = []
    for (first, end, total), (sign, zero), out in zip(buffers.chunks, buffers.planes, buffers.outs):
        chunk = entries[first:end]
        offs = _offsets(chunk)
        offsets.append(offs)
        items = list(zip(*_columns(chunk, "grad", "momentum", "coefs", "fused"), offs, repeat(0),
                         map(_column["numel"], chunk)))
        if any(map(_column["abstain"], chunk)):  # a rank that has run out of data (Join) votes direction 0
            for e, off in zip(chunk, offs):
                if e.abstain:
                    lion_math.pack_abstain(e.numel, sign, zero, off, voter.bits)
            items = [item for item, e in zip(items, chunk) if not e.abstain]
        bad, tally = pack_directions(items, sign, zero, voter.bits, opt.next_momenta)
        works.append(voter.all_reduce(sign, zero, total, bad, out, group, where, out_planes=into_planes,
                                      nans_tally=tally, agreed=agreed))
    deltas = []
    for (first, end, _), out, offs in zip(buffers.chunks, buffers.outs, offsets):
        deltas += map(lion_math.delta_views(out, into_planes), offs, map(_column["numel"], entries[first:end]))
    return deltas


def wait_votes(works) -> None:
    """Waits for every vote of a step; raises the first error that is not a
    non-finite direction, else :class:`NonFinite` naming every rank that had
    one (the same on every rank)."""
    bad_ranks: List[int] = []
    first_error = None
    for fut in works:
        try:
            fut.wait()
        except (RuntimeError, ValueError) as err:
            ranks = nonfinite_ranks(err)
            if ranks is None:
                first_error = first_error or err
            else:
                bad_ranks += ranks
    if first_error is not None:
        raise first_error
    if bad_ranks:
        raise NonFinite(bad_ranks)


def momentum_items(entries: Sequence[Entry]) -> list:
    """update_state's momentum items of a voted step (not an abstaining rank's: Join)."""
    voters = [e for e in entries if not e.abstain] if any(map(_column["abstain"], entries)) else entries
    return list(zip(*_columns(voters, "grad", "momentum", "coefs", "fused")))


def apply_items(entries: Sequence[Entry], deltas) -> list:
    """update_state's parameter items of a voted step."""
    return list(zip(map(_column["param"], entries), deltas, *_columns(entries, "coefs", "fused")))


def update(entries: Sequence[Entry], deltas, nexts=None) -> None:
    """The state change of a voted step: momentum, then parameters."""
    update_state(momentum_items(entries), apply_items(entries, deltas), nexts)


def update_momenta(entries: Sequence[Entry], nexts=None) -> None:
    """A voted step's momentum updates, alone (vote_chunks' ``on_agreed``)."""
    update_state(momentum_items(entries), [], nexts)


def apply_deltas(entries: Sequence[Entry], deltas) -> None:
    """A voted step's parameter updates (after :func:`update_momenta`)."""
    update_state([], apply_items(entries, deltas))


def update_state(momenta, applies, nexts=None) -> None:
    """The momentum updates ``momenta`` ((g, m, coefs, fused)), then the
    parameter updates ``applies`` ((x, delta, coefs, fused)), on one device
    (a parameter's update never reads another's momentum). With ``nexts``
    (lionbit.next_momenta) a momentum whose next value the step's direction
    pass wrote into its second buffer becomes that buffer (a swap); the
    others are updated from g. The fused tensors of the same hyperparameters
    go in one call each (the list kernels: on a GPU a launch per dtype pair,
    where their first-use check passed); where
    the list kernels do not run, the per-tensor fused kernel writes its
    direction bits (not needed) to planes made here for the largest g. A
    fused parameter in another dense layout (channels_last) is updated in a
    contiguous copy, copied back: the kernels read memory in order."""
    if nexts is not None and momenta:
        momenta = nexts.take(momenta)
    copies = []
    if applies and not all(map(_contiguous, map(itemgetter(0), applies))):
        copies = [(x, x.contiguous()) for x, _, _, fused in applies if fused and not x.is_contiguous()]
        swap = {id(x): c for x, c in copies}
        applies = [(swap.get(id(x), x), *rest) for x, *rest in applies]
    _update_state(momenta, applies)
    for x, c in copies:
        x.copy_(c)


def _update_state(momenta, applies) -> None:
    tensors = momenta or applies
    cuda = bool(tensors) and tensors[0][0].is_cuda
    if tensors and kernel_choice.list_kernels_allowed(tensors[0][0].device):
        m_groups, momenta = _by_coefs(momenta)
        a_groups, applies = _by_coefs(applies)
        for coefs, pairs in m_groups:
            lion_math.update_momenta(pairs, coefs)
        for coefs, pairs in a_groups:
            lion_math.apply_updates(pairs, coefs)
    # The per-tensor GPU kernels' tallies, never read: one buffer for every tensor.
    counts = torch.zeros(2, dtype=torch.int64, device=momenta[0][0].device) if cuda and momenta else None
    fused = [g.numel() for g, _, _, f in momenta if f]
    scratch = lion_math.planes(max(fused), momenta[0][0].device) if fused else None
    for g, m, coefs, f in momenta:
        nb = lion_math.plane_bytes(g.numel())
        sc = None if scratch is None else (scratch[0][:nb], scratch[1][:nb])
        lion_math.update_momentum(g, m, coefs, f, sc, counts)
    for x, d, coefs, fused in applies:
        lion_math.apply_update(x, d, coefs, fused)


_dtype, _contiguous, _get_device = attrgetter("dtype"), methodcaller("is_contiguous"), methodcaller("get_device")
_numel = methodcaller("numel")


class FusedVerdicts:
    """``opt.fused_for`` for a step's many pairs: each kind of pair (the two
    dtypes, their contiguity, the first tensor's device) asked once. Call it
    with one pair, or :meth:`many` with a step's lists."""

    def __init__(self, opt):
        self.opt = opt
        self.memo = {}

    def __call__(self, p, g) -> bool:
        key = (p.dtype, g.dtype, lion_math.fusable_layout(p), g.is_contiguous(), p.get_device())
        ok = self.memo.get(key)
        if ok is None:
            ok = self.memo[key] = self.opt.fused_for(p, g)
        return ok

    def many(self, ps: Sequence, gs: Sequence) -> List[bool]:
        """The verdict of each pair (ps[i], gs[i]): its kind read in C, each new kind asked."""
        layouts = list(map(_contiguous, ps))
        if not all(layouts):  # (channels_last parameters: dense, as a contiguous one for the kernels)
            layouts = list(map(lion_math.fusable_layout, ps))
        keys = list(zip(map(_dtype, ps), map(_dtype, gs), layouts, map(_contiguous, gs), map(_get_device, ps)))
        for key in set(keys).difference(self.memo):
            i = keys.index(key)
            self.memo[key] = self.opt.fused_for(ps[i], gs[i])
        return list(map(self.memo.__getitem__, keys))


def fused_verdicts(opt) -> FusedVerdicts:
    """The verdicts of one step (see :class:`FusedVerdicts`)."""
    return FusedVerdicts(opt)


def abstaining(opt, p, coefs) -> Entry:
    """The entry of a parameter on a rank that has run out of data (torch's
    Join): it votes direction 0, keeps its momentum and applies the voted
    update like every rank."""
    zero = torch.zeros(1, device=p.device).expand(p.numel())
    return Entry(p, zero, None, coefs, opt.fused_for(p, p), True)


def step_entries(opt, params_groups, skip=frozenset()) -> List[Entry]:
    """The entries of a step: every parameter with a gradient, in the
    optimizer's order, but those in ``skip``. Read group by group: the checks
    and verdicts of a step's hundreds of tensors are a few calls, not a few
    a tensor."""
    entries = []
    verdicts = fused_verdicts(opt)  # LIONBIT_KERNELS and the first-use checks, once a kind of pair
    for index, group in enumerate(params_groups):
        params = [p for p in group["params"] if p.grad is not None and not (skip and p in skip)]
        if not params:
            continue
        opt.check_params(params, "step")
        grads = [g if g.is_contiguous() else g.contiguous() for g in map(_column["grad"], params)]
        momenta = list(map(opt.momentum_of, params))
        if list(map(_numel, momenta)) != list(map(_numel, params)):
            _refuse_stale_momentum(group, index, params, momenta)
        entries += map(Entry, params, grads, momenta, repeat(lion_math.Coefs(group)), verdicts.many(params, grads))
    return entries


def _refuse_stale_momentum(group: dict, index: int, params, momenta) -> None:
    """A momentum of another size than its parameter's: a clear error before anything changed."""
    p, m = next((p, m) for p, m in zip(params, momenta) if p.numel() != m.numel())
    at = next(i for i, q in enumerate(group["params"]) if q is p)
    raise ValueError(
        f"DistributedLion.step on rank {rank_of()}: parameter {at} of parameter group {index} (shape "
        f"{tuple(p.shape)}) has {p.numel()} elements, its momentum ('exp_avg') {m.numel()}: the parameter was "
        f"replaced by one of another size after its momentum was made (p.data = ..., a resized embedding), or "
        f"another model's state dict was loaded. Start its momentum again (opt.state[p] = {{}}) on every rank; "
        f"nothing was changed"
    )


def rank_of() -> int:
    """This rank as errors name it: its global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def global_ranks(group) -> List[int]:
    """The global rank of each rank of ``group`` (None: the default group),
    by which lionbit's errors name ranks, as the backend's do."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def unscale(opt, scaler) -> dict:
    """Unscales the gradients in place (as GradScaler.unscale_ does) unless
    the user already did; returns the scaler's per-device found_inf
    tensors, which its update() reads."""
    if torch_internals.scaler_stage(scaler, opt) is OptState.READY:
        scaler.unscale_(opt)
    return torch_internals.scaler_found_inf(scaler, opt)


def gather_flags(flags: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``flags`` (a few numbers, 1-D) as a (world size, len)
    tensor, row r rank r's: the rounds by which the ranks of a step agree.
    On the CPU it is one all-to-all of N copies, so each rank's flags reach
    every peer at once, in one round trip; Gloo's all-reduce goes round a
    ring twice (2 (N - 1) round trips in a row), and a round trip is all that
    a few bytes cost. Elsewhere (NCCL) an all-gather."""
    n = dist.get_world_size(group)
    out = torch.empty(n * flags.numel(), dtype=flags.dtype, device=flags.device)
    if flags.device.type == "cpu":
        dist.all_to_all_single(out, flags.repeat(n), group=group)
    else:
        dist.all_gather_into_tensor(out, flags, group=group)
    return out.view(n, -1)


_CPU = torch.device("cpu")


def flags_on_cpu(group) -> bool:
    """Whether a round of flags over ``group`` can run on the CPU (the
    group has a CPU backend: a lionbit group, or "cpu:gloo,cuda:..."): no
    device sync, and on a GPU nothing in the device's streams, so it can run
    while the votes' bits move on other communicators (NCCL does not promise
    progress to collectives of two communicators whose kernels overlap in a
    different order on different ranks)."""
    try:
        torch_internals.backend_object(group, _CPU)
    except RuntimeError:
        return False
    return True


def node_agreed(vote: Callable[[bool], Callable[[], None]], groups: tuple, device, what: str,
                peers: str = "this node"):
    """Hybrid sharding (FSDP2 HSDP, FSDP1 HYBRID_SHARD): ``vote(settle)``
    (the replicas' votes of this rank's shards, returning once every rank
    agreed to them: their header rounds; with ``settle``, once their bits
    are in too), then the ranks of each node agree whether to step, while
    the votes' bits still move (``peers``: the ranks of ``groups`` as errors
    name them). ``groups`` are the groups whose ranks hold parts of one
    worker, one round of flags over each in turn: the node's shard group
    (FSDP1 hybrid, HSDP), FSDP2's tensor-parallel group, or both (HSDP with
    tensor parallelism: the second round covers every rank of the node).
    A vote's header round
    tells only the replicas of one shard that a direction was non-finite;
    the ranks of a node hold different shards of one worker, which must step
    or skip together (a GradScaler skip, or the error, on every rank). One
    round of world-size flags over each group (inside the node,
    gather_flags) carries the non-finite ranks (global numbers) and any
    other failure of a rank's vote up to its agreement; on the CPU (where
    :func:`flags_on_cpu`), else on ``device``, after the bits are in (the
    vote settles). Returns what ``vote()`` returned (which waits for the
    bits); raises :class:`NonFinite` on every rank alike."""
    world = dist.get_world_size()
    on_cpu = all(map(flags_on_cpu, groups))
    flags = torch.zeros(world + 1, dtype=torch.int32, device=_CPU if on_cpu else device)
    apply, failure = None, None
    try:
        apply = vote(not on_cpu)
    except NonFinite as bad:
        flags[bad.ranks] = 1  # (global ranks, as the backend names every rank)
    except Exception as err:  # re-raised below, after the node heard of it (no peer waits forever)
        failure = err
        flags[world] = 1
    for group in groups:  # any rank's flag, per entry (after the second round: any rank of the node's)
        flags = gather_flags(flags, group).amax(0)
    agreed = flags.tolist()
    if failure is not None:
        raise failure
    if agreed[world]:
        raise RuntimeError(
            f"DistributedLion.step ({what}) on rank {dist.get_rank()}: another rank of {peers} failed its "
            f"vote (its own error says why); no parameter or momentum changed on this rank"
        )
    ranks = [r for r in range(world) if agreed[r]]
    if ranks:
        raise NonFinite(ranks)
    return apply


def voted_step(opt, grad_scaler, vote: Callable[[], Callable[[], None]], abstain: bool = False) -> bool:
    """One step of an integration: ``vote()`` votes the step's directions
    and returns the function that applies them (a vote may update the
    momenta once every rank has agreed to it, while its bits still move:
    vote_chunks). With a GradScaler the gradients are unscaled first. A
    non-finite direction on any rank (:class:`NonFinite`) changes nothing
    anywhere: with a scaler every rank skips the step and its scaler backs
    off; without one every rank raises. Returns whether the step was
    applied."""
    found = unscale(opt, grad_scaler) if grad_scaler is not None else None
    try:
        apply = vote()
    except NonFinite as bad:
        if found is None and not abstain:
            raise RuntimeError(
                f"DistributedLion.step on rank {rank_of()}: non-finite gradient (inf or NaN) on rank(s) "
                f"{bad.ranks}; no parameter or momentum changed on any rank. With float16 autocast use "
                f"torch.amp.GradScaler, which skips such steps"
            ) from None
        for t in (found or {}).values():
            t.fill_(1.0)  # every rank's scaler backs off alike
        log.info("lionbit: DistributedLion skipped a step: inf/NaN gradient on rank(s) %s", bad.ranks)
        return False
    apply()
    return True
