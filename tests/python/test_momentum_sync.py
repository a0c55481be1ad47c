"""Momentum synchronization (``DistributedLion(momentum_sync=...)``, Lion
Cub's third lever) in the training loops users write, on real processes:
DDP at N = 2, 3 and 4, a plain module, FSDP2, FSDP1, ExponentialSync, a
GradScaler-skipped step, checkpoint resume, the stats counters, a world of
one, bad arguments.

The reference is computed on every rank from what a user can see, not from
lionbit's code: before each ``step()`` every rank's momentum and gradient are
all-gathered (float32, through a plain all_gather), every rank's Lion step
is recomputed from the paper's update rule and the float contract of
lionbit.lion_math, and on a synchronization step every rank's new momentum
becomes the float64 mean of the ranks' momenta each rounded to bfloat16,
rounded to bfloat16 (the transport's rounding, lionbit.momentum_sync), or
with ``momentum_sync_dtype=torch.float32`` the same in float32. After
``step()`` the parameters and this rank's momentum must equal it bitwise.
FSDP runs must equal DDP's (checked against the reference) bitwise.

The cases of one world size run in one launch (launching costs more than
the cases), each reported as its own pytest test.
"""

import hashlib
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_fsdp import LION, _loss, _net, _shard
from test_fsdp1 import _wrap

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

BF16 = torch.bfloat16


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


B1, B2 = LION["betas"]
CB1, COMB1, CB2, COMB2 = (_f32(v) for v in (B1, 1 - B1, B2, 1 - B2))


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _gather(t, group=None):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def _transport_mean(momenta, dtype, sync_dtype=BF16):
    """The synchronized momentum: the float64 mean of the ranks' momenta
    each rounded to ``sync_dtype``, rounded to ``sync_dtype``, stored as
    ``dtype``."""
    return torch.stack([m.to(sync_dtype).double() for m in momenta]).mean(0).to(sync_dtype).to(dtype)


class Reference:
    """One step of DistributedLion recomputed from every rank's momentum and
    gradient (gathered before step()): the parameters and every rank's
    momentum after it. Plain module and DDP (p.grad is the local gradient)."""

    def __init__(self, opt, params, sync_dtype=BF16):
        self.opt, self.params = opt, list(params)
        self.dtype, self.sync_dtype = opt.momentum_dtype, sync_dtype

    def momenta(self):
        return [self.opt.state[p]["exp_avg"] if "exp_avg" in self.opt.state[p] else torch.zeros_like(p)
                for p in self.params]

    def before_step(self, sync: bool):
        lr, wd = self.opt.param_groups[0]["lr"], self.opt.param_groups[0]["weight_decay"]
        ms = _gather(_flat(self.momenta()))
        gs = _gather(_flat([p.grad for p in self.params]))
        self.x = _flat(self.params)
        self.skipped = not all(torch.isfinite(g).all() for g in gs)
        if self.skipped:  # GradScaler skips the step on every rank: nothing changes
            self.want_x, self.want_m, self.synced = self.x, ms, False
            return
        signs = [torch.sign(torch.add(torch.mul(m, CB1), torch.mul(g, COMB1))) for m, g in zip(ms, gs)]
        delta = torch.sign(sum(signs))
        self.want_x = torch.sub(torch.mul(self.x, _f32(1 - lr * wd)), torch.mul(delta, _f32(lr)))
        new = [torch.add(torch.mul(m, CB2), torch.mul(g, COMB2)).to(self.dtype) for m, g in zip(ms, gs)]
        if sync:
            new = [_transport_mean(new, self.dtype, self.sync_dtype)] * len(new)
        else:
            assert len({_digest([m]) for m in new}) == len(new), "the ranks' momenta should differ between syncs"
        self.want_m = [m.float() for m in new]
        self.synced = sync

    def after_step(self, rank):
        assert torch.equal(_flat(self.params), self.want_x), "parameters differ from the reference"
        mine = _flat(self.momenta())
        assert torch.equal(mine, self.want_m[rank]), (
            f"momentum differs from the reference (synchronized: {self.synced}); "
            f"max |diff| {(mine - self.want_m[rank]).abs().max():.3e}"
        )
        same = len({_digest([m]) for m in _gather(mine)}) == 1
        assert same == self.synced or self.skipped, f"momenta equal across ranks: {same}, synchronized: {self.synced}"


def ddp_training(rank, n, momentum_sync, sync_steps, steps=6, momentum_dtype=None, overflow=None, piece=None,
                 stats=False, sync_dtype=BF16):
    """A DDP training loop with momentum_sync, every step checked against the
    Reference. ``sync_steps``: the (1-based) applied steps after which the
    momenta must be synchronized. ``overflow``: (step, rank) whose loss
    overflows under GradScaler. Returns the parameters and momenta of every
    step (for the FSDP comparisons)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    if piece is not None:
        lionbit.momentum_sync.PIECE_ELEMENTS = piece
    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    md = getattr(torch, momentum_dtype) if momentum_dtype else None
    opt = lionbit.DistributedLion(ddp.parameters(), momentum_sync=momentum_sync, momentum_dtype=md,
                                  momentum_sync_dtype=sync_dtype, **LION)
    opt.attach(ddp)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if overflow else None
    ref = Reference(opt, model.parameters(), sync_dtype)
    history = []
    if stats:
        lionbit.reset_stats()
    try:
        for it in range(steps):
            opt.zero_grad()
            loss = _loss(ddp, rank, it)
            if overflow and (it, rank) == overflow:
                loss = loss * 1e38
            if scaler:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # the reference reads the gradients the step will use
            else:
                loss.backward()
            ref.before_step(sync=opt.steps_taken + 1 in sync_steps)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            ref.after_step(rank)
            history.append(
                (
                    [p.detach().clone() for p in model.parameters()],
                    {name: opt.state[p]["exp_avg"].clone() for name, p in model.named_parameters()},
                )
            )
    finally:
        lionbit.momentum_sync.PIECE_ELEMENTS = 1 << 26
    return opt, history


# -- the cases ------------------------------------------------------------------------------------


def case_ddp_every_2_steps(rank, n):
    _, history = ddp_training(rank, n, 2, {2, 4, 6})
    assert len(history) == 6


def case_ddp_bfloat16_momentum(rank, n):
    ddp_training(rank, n, 2, {2, 4}, steps=5, momentum_dtype="bfloat16")


def case_ddp_float32_sync(rank, n):
    # float32 momenta averaged in float32: the reference rounds the float64
    # mean once, to float32 (a bfloat16 sync would differ in almost every element)
    ddp_training(rank, n, 2, {2, 4}, steps=5, sync_dtype=torch.float32, piece=300)


def case_ddp_float32_sync_bfloat16_momentum(rank, n):
    ddp_training(rank, n, 2, {2}, steps=3, momentum_dtype="bfloat16", sync_dtype=torch.float32)


def case_ddp_in_pieces(rank, n):
    # 691 momentum elements in pieces of 100: 7 pieces, each padded to a multiple of N
    ddp_training(rank, n, 3, {3, 6}, steps=6, piece=100)


def case_exponential_schedule(rank, n):
    import lionbit

    # first=2, factor=1.5: intervals 3, 4 (4.5), 6 (6.75): after steps 2, 5, 9, 15
    ddp_training(rank, n, lionbit.ExponentialSync(first=2, factor=1.5), {2, 5, 9}, steps=10)


def case_grad_scaler_skip_does_not_count(rank, n):
    # Loop iteration 1 overflows on rank 1: every rank skips it, so the
    # applied steps 2 and 4 (synchronized) are iterations 2 and 4.
    opt, _ = ddp_training(rank, n, 2, {2, 4}, steps=6, overflow=(1, 1))
    assert opt.steps_taken == 5, opt.steps_taken


def case_plain_module(rank, n):
    """No DDP: the optimizer votes at step(); the same reference."""
    import lionbit

    model = _net()
    opt = lionbit.DistributedLion(model.parameters(), momentum_sync=3, **LION)
    ref = Reference(opt, model.parameters())
    for step in range(7):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        ref.before_step(sync=step + 1 in (3, 6))
        opt.step()
        ref.after_step(rank)


def case_stats(rank, n, sync_dtype=BF16):
    import lionbit

    d = sum(p.numel() for p in _net().parameters())  # 691: padded to a multiple of N
    opt, _ = ddp_training(rank, n, 2, {2, 4}, steps=5, stats=True, sync_dtype=sync_dtype)
    st = lionbit.stats()
    size = 2 if sync_dtype == BF16 else 4
    sent = 2 * 2 * (n - 1) * -(-d // n) * size  # two syncs; all-to-all + all-gather, (N-1) chunks each
    want = {
        "momentum_sync_calls": 2,
        "momentum_sync_steps": 5,
        "momentum_sync_elements": 2 * d,
        "momentum_sync_bytes_sent": sent,
        "momentum_sync_bytes_received": sent,
    }
    assert {k: st[k] for k in want} == want, st
    assert st["momentum_sync_bytes_per_step"] == sent / 5
    assert sent / 2 <= 2 * (n - 1) / n * size * (d + n)  # a ring all-reduce of the buffer
    assert st["sign_allreduce_calls"] > 0 and st["bytes_sent"] > 0  # the sign path's own counters go on
    lionbit.reset_stats()
    st = lionbit.stats()
    assert all(st[k] == 0 for k in want) and st["momentum_sync_bytes_per_step"] == 0.0, st


def case_stats_float32(rank, n):
    case_stats(rank, n, torch.float32)


def case_world_of_one(rank, n):
    """An optimizer on a group of one rank: synchronizing is a no-op (no
    collective, nothing changes); counted on that group's backend only."""
    import lionbit

    singles = [dist.new_group([r], backend="lionbit") for r in range(n)]
    mine = singles[rank]
    lionbit.reset_stats()
    runs = []
    for sync in (None, 1):
        model = _net()
        opt = lionbit.DistributedLion(model.parameters(), momentum_sync=sync, group=mine, **LION)
        for step in range(3):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
        runs.append(_digest(list(model.parameters()) + [opt.state[p]["exp_avg"] for p in model.parameters()]))
    assert runs[0] == runs[1]
    st = lionbit.stats(mine)
    assert st["momentum_sync_steps"] == 3 and st["momentum_sync_calls"] == 0 and st["momentum_sync_bytes_sent"] == 0
    assert lionbit.stats()["momentum_sync_steps"] == 0  # the default group's backend saw none of it


def case_checkpoint_resume(rank, n, path):
    """Uninterrupted 8 steps against 4 steps, a per-rank checkpoint, a fresh
    model and optimizer (another seed) loading it, 4 more steps: bitwise the
    same, the synchronizations after the resume point included."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    def build(seed, sync):
        model = _net(seed)
        ddp = DDP(model)
        return model, ddp, lionbit.DistributedLion(ddp.parameters(), momentum_sync=sync, **LION).attach(ddp)

    def train(ddp, opt, its):
        for it in its:
            opt.zero_grad()
            _loss(ddp, rank, it).backward()
            opt.step()

    def state(model, opt):
        return _digest(list(model.parameters()) + [opt.state[p]["exp_avg"] for p in model.parameters()])

    def synchronized(opt):
        mine = _flat(opt.state[p]["exp_avg"] for p in opt.param_groups[0]["params"])
        return len({_digest([m]) for m in _gather(mine)}) == 1

    # syncs after steps 3, 6 (k=3) and 1, 3, 7 (exponential): on each side of the save
    schedules = (("k3", lambda: 3, 6), ("exp", lambda: lionbit.ExponentialSync(first=1, factor=2.0), 7))
    for name, make, last_sync in schedules:
        model, ddp, opt = build(0, make())
        train(ddp, opt, range(8))
        full = state(model, opt)
        model, ddp, opt = build(0, make())
        train(ddp, opt, range(4))
        where = os.path.join(path, f"{name}-rank{rank}.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, where)
        dist.barrier()
        model, ddp, opt = build(1, make())
        ckpt = torch.load(where)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        assert opt.steps_taken == 4 and not synchronized(opt)
        train(ddp, opt, range(4, last_sync))
        assert synchronized(opt), f"{name}: no synchronization after step {last_sync} of the resumed run"
        train(ddp, opt, range(last_sync, 8))
        assert opt.steps_taken == 8 and not synchronized(opt)
        assert state(model, opt) == full, f"{name}: the resumed run differs from the uninterrupted one"


def case_fsdp2(rank, n):
    """FSDP2 with momentum_sync=2: each rank's full-size momentum is
    synchronized; parameters and momenta equal DDP's (checked against the
    Reference) after every step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import lionbit

    _, history = ddp_training(rank, n, 2, {2, 4}, steps=5)
    model = _shard(_net())
    opt = lionbit.DistributedLion(model.parameters(), momentum_sync=2, **LION)
    opt.attach(model)
    # torch initializes a fresh optimizer's state with a step() of zero
    # gradients: not a step (no count, no sync)
    get_optimizer_state_dict(model, opt)
    assert opt.steps_taken == 0
    for it, (want_params, want_m) in enumerate(history):
        _loss(model, rank, it).backward()
        opt.step()
        opt.zero_grad()
        params = [p.full_tensor() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(params, want_params)), f"parameters differ at step {it + 1}"
        momenta = {name: opt.state[p]["exp_avg"] for name, p in model.named_parameters()}
        assert set(momenta) == set(want_m)
        for name, m in momenta.items():
            assert torch.equal(m, want_m[name]), f"momentum of {name} differs from DDP's at step {it + 1}"
        same = len({_digest([m]) for m in _gather(_flat(momenta.values()))}) == 1
        assert same == ((it + 1) % 2 == 0), (it, same)


def case_fsdp1(rank, n):
    """FSDP1 (FULL_SHARD and NO_SHARD) with momentum_sync=2: the flat
    momenta are synchronized; parameters and momenta equal DDP's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import lionbit

    _, history = ddp_training(rank, n, 2, {2, 4}, steps=4)
    for strategy, use_orig in (("FULL_SHARD", False), ("NO_SHARD", True)):
        model = _wrap(_net(), strategy, use_orig)
        opt = lionbit.DistributedLion(model.parameters(), momentum_sync=2, **LION)
        opt.attach(model)
        for it, (want_params, want_m) in enumerate(history):
            _loss(model, rank, it).backward()
            opt.step()
            opt.zero_grad()
            with FSDP.summon_full_params(model):
                params = [p.detach().clone() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(params, want_params)), (strategy, it)
            flats = opt.local_state_dict()["momentum"]
            seen = set()
            for unit in opt.attachment.units:
                for off, numel, _, fqn in unit.segments:
                    got = flats[unit.name][off : off + numel]
                    assert torch.equal(got, want_m[fqn].reshape(-1)), (strategy, it, fqn)
                    seen.add(fqn)
            assert seen == set(want_m), seen
            same = len({_digest([m]) for m in _gather(_flat(flats.values()))}) == 1
            assert same == ((it + 1) % 2 == 0), (strategy, it, same)


CASES = {
    2: ["ddp_every_2_steps", "plain_module", "grad_scaler_skip_does_not_count", "stats", "world_of_one",
        "checkpoint_resume", "ddp_float32_sync", "stats_float32"],
    3: ["ddp_every_2_steps", "ddp_bfloat16_momentum", "exponential_schedule", "fsdp2", "ddp_float32_sync",
        "ddp_float32_sync_bfloat16_momentum"],
    4: ["ddp_every_2_steps", "ddp_in_pieces", "stats", "fsdp1"],
}


def all_cases(rank, n, names, path):
    """Runs the cases in order (the same on every rank); returns
    {name: "ok" | failure text}."""
    torch.set_num_threads(1)
    out = {}
    for name in names:
        fn = globals()[f"case_{name}"]
        try:
            fn(rank, n, path) if name == "checkpoint_resume" else fn(rank, n)
            out[name] = "ok"
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"
        dist.barrier()
    return out


_results = {}


def _results_at(n):
    if n not in _results:
        with tempfile.TemporaryDirectory() as path:
            _results[n] = values(
                run_ranks("test_momentum_sync:all_cases", n, kwargs=dict(names=CASES[n], path=path), timeout=240)
            )
    return _results[n]


@pytest.mark.parametrize("n,name", [(n, name) for n, names in CASES.items() for name in names])
def test_case(n, name):
    for rank, res in enumerate(_results_at(n)):
        assert res.get(name) == "ok", f"rank {rank} of {n}: {res.get(name)}"


# -- in this process: no process group, bad arguments ---------------------------------------------


def test_without_a_process_group_sync_does_nothing():
    import lionbit

    assert not dist.is_initialized()
    out = []
    for sync in (None, 1, lionbit.ExponentialSync(1, 1.0)):
        model = _net()
        opt = lionbit.DistributedLion(model.parameters(), momentum_sync=sync, **LION)
        for step in range(3):
            opt.zero_grad()
            _loss(model, 0, step).backward()
            opt.step()
        assert opt.steps_taken == 3
        out.append(_digest(list(model.parameters()) + [opt.state[p]["exp_avg"] for p in model.parameters()]))
    assert len(set(out)) == 1


def test_exponential_schedule_steps():
    import lionbit

    def syncs(s, last):
        return [step for step in range(1, last + 1) if s(step)]

    assert syncs(lionbit.ExponentialSync(first=2, factor=1.5), 30) == [2, 5, 9, 15, 25]
    assert syncs(lionbit.ExponentialSync(first=1, factor=2.0), 40) == [1, 3, 7, 15, 31]
    assert syncs(lionbit.ExponentialSync(first=4, factor=1.0), 13) == [4, 8, 12]
    s = lionbit.ExponentialSync(first=3, factor=2.0)
    assert [s(t) for t in (9, 3, 21, 4, 9)] == [True, True, True, False, True]  # asked out of order
    assert "first=3" in repr(s)


@pytest.mark.parametrize(
    "what,kwargs,match",
    [
        ("DistributedLion", dict(momentum_sync=0), r"'momentum_sync' must be an int k >= 1, got 0"),
        ("DistributedLion", dict(momentum_sync=-3), r"'momentum_sync'.*got -3"),
        ("DistributedLion", dict(momentum_sync=True), r"'momentum_sync'.*got True"),
        ("DistributedLion", dict(momentum_sync=2.5), r"'momentum_sync'.*got float"),
        ("DistributedLion", dict(momentum_sync="4"), r"'momentum_sync'.*got str"),
        ("DistributedLion", dict(momentum_sync=2, momentum_sync_dtype=torch.float16),
         r"argument 'momentum_sync_dtype' must be torch.bfloat16 or torch.float32, got torch.float16"),
        ("ExponentialSync", dict(first=0), r"argument 'first' must be an int >= 1, got 0"),
        ("ExponentialSync", dict(first=2.0), r"argument 'first'.*got 2.0"),
        ("ExponentialSync", dict(factor=0.5), r"argument 'factor' must be a finite number >= 1, got 0.5"),
        ("ExponentialSync", dict(factor=float("inf")), r"argument 'factor'.*got inf"),
        ("ExponentialSync", dict(factor=float("nan")), r"argument 'factor'.*got nan"),
        ("ExponentialSync", dict(factor="2"), r"argument 'factor'.*got '2'"),
    ],
)
def test_bad_arguments(what, kwargs, match):
    import lionbit

    args = ([torch.zeros(2)],) if what == "DistributedLion" else ()
    with pytest.raises(ValueError, match=match):
        getattr(lionbit, what)(*args, **kwargs)
