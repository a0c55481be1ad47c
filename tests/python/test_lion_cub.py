"""Lion Cub's levers (Ishikawa et al. 2024) as lionbit options, each checked
against a reference written here in numpy from the definitions:

- tie rules: ``all_reduce_sign`` / ``reduce_scatter_sign`` with
  ``tie_break="alternate"`` / ``"random"`` give sign(sum) where the sum is
  not 0, 0 where every rank sent 0, and the rule's sign at the other ties,
  bitwise the same on every rank, at 1 bit a element in phase 2 (bytes <=
  1.01x the 1-bit figure);
- an embedding whose rows no rank uses stays still (only weight decay moves
  it) under every tie rule, with the vote and with l1;
- ``DistributedLion(aggregation="l1", bits=p)``: a training loop under DDP
  whose parameters follow, bit for bit, a numpy simulation of every rank's
  Lion step with L1-quantized levels summed across ranks;
- checkpoints: a run resumed from each rank's state dict continues bitwise.
"""

import numpy as np
import pytest
import torch

from harness import run_ranks, values

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

# ---------------------------------------------------------------- reference


def _mix64(z):
    z = z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def tie_signs(rule, seed, positions):
    """+1 / -1 the tie rule gives the elements at ``positions`` (element
    indices in the call's tensor), from the definition in signbits/ties.h."""
    positions = np.asarray(positions, dtype=np.uint64)
    if rule == "alternate":
        return np.full(len(positions), 1 if seed % 2 == 0 else -1, dtype=np.int64)
    words = positions // np.uint64(64)
    base = _mix64(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        word = _mix64(base + np.uint64(0x9E3779B97F4A7C15) * (words + np.uint64(1)))
    bit = (word >> (positions % np.uint64(64))) & np.uint64(1)
    return np.where(bit == 1, 1, -1).astype(np.int64)


def ref_vote(xs, rule, seed):
    s = np.sum([np.sign(x) for x in xs], axis=0).astype(np.int64)
    out = np.sign(s)
    if rule != "zero":
        still = np.all([x == 0 for x in xs], axis=0)  # every rank sent 0: stays 0
        ties = np.nonzero((s == 0) & ~still)[0]
        out[ties] = tie_signs(rule, seed, ties)
    return out


def _inputs(rank, n, numel, seed=0):
    """Rank r's input: mostly +-1 (even splits at even N), some zeros, and
    every 97th element 0 on every rank (a row no rank used)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randint(0, 2, (numel,), generator=g).float() * 2 - 1
    x[torch.rand(numel, generator=g) < 0.05] = 0.0
    x[::97] = 0.0
    return x


# ---------------------------------------------------------------- tie rules


def tie_rule_calls(rank, n, numel, rule):
    import torch.distributed as dist

    import lionbit

    # A lionbit group of the case's own: a call's default seed is its number
    # on the group, and the warm ranks' default group has made calls before.
    group = dist.new_group(backend="lionbit")
    out = []
    for call, seed in enumerate([4, 7, None]):
        x = _inputs(rank, n, numel, call)
        lionbit.all_reduce_sign(x, "vote", group=group, tie_break=rule, tie_seed=seed)
        out.append(x.to(torch.int8).tolist())
    # The reduce-scatter: rank r's shard of the same rule over N * S elements.
    s = numel // n
    y = _inputs(rank, n, n * s, 9)
    o = torch.empty(s)
    lionbit.reduce_scatter_sign(o, y, "vote", group=group, tie_break=rule, tie_seed=11)
    out.append(o.to(torch.int8).tolist())
    dist.barrier()  # no rank closes the group's connections while a peer still reads from them
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("n,rule,chunk", [(4, "alternate", None), (2, "random", None), (4, "random", 1 << 12)])
def test_tie_rules_are_exact_and_identical_on_every_rank(n, rule, chunk):
    numel = 10_000
    case_env = {"LIONBIT_CHUNK_ELEMS": str(chunk)} if chunk else None
    res = values(run_ranks("test_lion_cub:tie_rule_calls", n, kwargs={"numel": numel, "rule": rule},
                           case_env=case_env))
    assert all(r[:3] == res[0][:3] for r in res), "ranks disagree"
    # Call numbers: every sign call on the group counts; the default seed of
    # the third call is its number, 2.
    for call, seed in enumerate([4, 7, 2]):
        xs = [_inputs(r, n, numel, call).numpy() for r in range(n)]
        want = ref_vote(xs, rule, seed)
        assert np.array_equal(np.array(res[0][call]), want), f"call {call}"
        still = np.all([x == 0 for x in xs], axis=0)
        assert np.array_equal(want == 0, still) and still.sum() >= numel // 97
    s = numel // n
    ys = [_inputs(r, n, n * s, 9).numpy() for r in range(n)]
    plain = ref_vote(ys, "zero", 0)
    still = np.all([y == 0 for y in ys], axis=0)
    words = (s + 63) // 64
    for r in range(n):
        want = plain[r * s : (r + 1) * s].copy()
        ties = np.nonzero((want == 0) & ~still[r * s : (r + 1) * s])[0]
        # Positions in the reduce-scatter's layout: shard r starts at word r * ceil(S / 64).
        want[ties] = tie_signs(rule, 11, r * words * 64 + ties)
        assert np.array_equal(np.array(res[r][3]), want), f"shard {r}"


def tie_bytes(rank, n, numel, rule):
    import lionbit

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 2, (numel,), generator=g).float() * 2 - 1  # a Lion direction: no zeros
    lionbit.reset_stats()
    lionbit.all_reduce_sign(x, "vote", tie_break=rule, tie_seed=3)
    return lionbit.stats()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_alternate_keeps_the_vote_at_one_bit(n):
    d = 1 << 20
    one_bit = 2 * (n - 1) / n * d / 8
    for s in values(run_ranks("test_lion_cub:tie_bytes", n, kwargs={"numel": d, "rule": "alternate"})):
        assert s["bytes_sent"] <= 1.01 * one_bit, (s["bytes_sent"], one_bit)
        assert s["bytes_received"] <= 1.01 * one_bit
        assert s["bytes_sent"] >= one_bit
        assert s["tie_rounds"] == 0 and s["inline_tie_chunks"] == 0


def bad_tie_calls(rank, n):
    import lionbit

    errors = []
    for kwargs in (
        dict(op="vote", tie_break="sideways"),
        dict(op="avg", tie_break="alternate"),
        dict(op="vote", tie_break="random", tie_seed=rank),  # seeds differ across ranks
    ):
        try:
            lionbit.all_reduce_sign(torch.ones(100), **kwargs)
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    x = torch.ones(10)
    lionbit.all_reduce_sign(x, "vote", tie_break="alternate")  # the group still works
    errors.append(x.tolist())
    return errors


def test_bad_tie_arguments_raise_on_every_rank():
    res = values(run_ranks("test_lion_cub:bad_tie_calls", 2))
    for rank, (a, b, c, ok) in enumerate(res):
        assert f"on rank {rank}" in a and "argument 'tie_break' is 'sideways'" in a, a
        assert "all_reduce_sign(op=avg)" in b and "'avg' has no ties" in b, b
        assert "the tie rule's seed differs across ranks" in c, c
        assert ok == [1.0] * 10


# ---------------------------------------------------------------- l1 training


LION = dict(lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)


class _TinyLM(torch.nn.Module):
    """A vocabulary of 64 tokens, of which the data uses only the first 40:
    rows 40..63 of the embedding get a zero gradient on every rank, every
    step (a large vocabulary's rare tokens, padding)."""

    VOCAB, USED = 64, 40

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(self.VOCAB, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def _net(kind="mlp"):
    torch.manual_seed(0)
    if kind == "lm":
        return _TinyLM()
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def _batch(rank, step, kind="mlp"):
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "lm":
        return torch.randint(0, _TinyLM.USED, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def ddp_levers(rank, n, steps, kwargs, overlap=True, resume_at=None, ckpt=None, net="mlp"):
    """A user's loop: DDP + DistributedLion(**kwargs).attach; per step every
    rank's local gradients (p.grad after backward) and the parameters after
    step(). With resume_at: save each rank's state dict there, rebuild the
    optimizer and load it, go on."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = DDP(_net(net))
    opt = lionbit.DistributedLion(model.parameters(), **LION, **kwargs).attach(model, overlap=overlap)
    log = {"x0": [p.detach().reshape(-1).tolist() for p in model.parameters()], "grads": [], "params": []}
    for step in range(steps):
        if step == resume_at:  # what a restarted script does: a new model and optimizer, then load
            path = f"{ckpt}/rank{dist.get_rank()}.pt"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, path)
            saved = torch.load(path)
            model = DDP(_net(net))
            model.module.load_state_dict(saved["model"])
            opt = lionbit.DistributedLion(model.parameters(), **LION, **kwargs).attach(model, overlap=overlap)
            opt.load_state_dict(saved["opt"])
        x, y = _batch(rank, step, net)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        log["grads"].append([p.grad.reshape(-1).tolist() for p in model.parameters()])
        # Where DDP put each parameter in its bucket (the random tie rule's
        # positions): this model fits one bucket, whose order DDP rebuilds
        # after the first step.
        index = {id(p): i for i, p in enumerate(model.parameters())}
        buckets = list(opt.attachment.buckets.values())
        log.setdefault("order", []).append([index[id(p)] for p in buckets[0].params] if overlap else None)
        opt.step()
        opt.zero_grad()
        log["params"].append([p.detach().reshape(-1).tolist() for p in model.parameters()])
    log["steps_taken"] = opt.steps_taken
    return log


def _f32(v):
    return np.float32(v)


def simulate(logs, kwargs, steps):
    """Every rank's Lion step in numpy (float32, every operation rounded on
    its own), the update the sum of the ranks' L1 levels (or their signs)."""
    n = len(logs)
    b1, b2 = LION["betas"]
    cb1, comb1, cb2, comb2 = _f32(b1), _f32(1 - b1), _f32(b2), _f32(1 - b2)
    clr, decay = _f32(LION["lr"]), _f32(1 - LION["lr"] * LION["weight_decay"])
    agg, bits, rule = kwargs.get("aggregation", "vote"), kwargs.get("bits", 4), kwargs.get("tie_break", "zero")
    xs = [np.array(x, dtype=np.float32) for x in logs[0]["x0"]]
    ms = [[np.zeros_like(x) for x in xs] for _ in range(n)]
    out = []
    applied = 0  # the optimizer's step counter: skipped steps do not count
    for step in range(steps):
        if any(not np.isfinite(np.concatenate(logs[r]["grads"][step])).all() for r in range(n)):
            out.append([x.copy() for x in xs])  # an inf/NaN on any rank: every rank skips
            continue
        call = 0  # one collective per DDP bucket; this model fits one bucket
        flat_sum, flat_still = [], []
        for i in range(len(xs)):
            contrib = []
            for r in range(n):
                g = np.array(logs[r]["grads"][step][i], dtype=np.float32)
                c = (cb1 * ms[r][i]) + (comb1 * g)  # float32, each op rounded
                if agg == "l1":
                    s = (1 << (bits - 1)) - 1
                    mean = np.abs(c.astype(np.float64)).sum() / c.size
                    factor = s / (2.0 * mean) if mean > 0 else 0.0
                    q = np.clip(np.rint(c.astype(np.float64) * factor), -s, s).astype(np.int64)
                else:
                    q = np.sign(c).astype(np.int64)
                contrib.append(q)
                ms[r][i] = (cb2 * ms[r][i]) + (comb2 * g)
            flat_sum.append(np.sum(contrib, axis=0))
            flat_still.append(np.all([q == 0 for q in contrib], axis=0))
        total = np.concatenate(flat_sum)
        delta = np.sign(total)
        if rule != "zero":
            seed = applied if rule == "alternate" else (applied << 20) + call
            # A tie among non-zero votes takes the rule's sign; an element
            # every rank voted 0 for (level 0 with l1) stays 0.
            ties = np.nonzero((total == 0) & ~np.concatenate(flat_still))[0]
            # ("alternate" is the same sign everywhere: positions matter to "random" only)
            where = _bucket_positions(xs, ties, logs[0]["order"][step]) if rule == "random" else ties
            delta[ties] = tie_signs(rule, seed, where)
        off = 0
        for i, x in enumerate(xs):
            d = delta[off : off + x.size].astype(np.float32)
            xs[i] = (x * decay) - (clr * d)
            off += x.size
        out.append([x.copy() for x in xs])
        applied += 1
    return out


def _assert_follows_simulation(logs, kwargs, steps):
    """Every rank's parameters equal rank 0's and, step by step, bitwise the
    numpy simulation's."""
    for r in range(1, len(logs)):
        assert logs[r]["params"] == logs[0]["params"], "replicas differ"
    want = simulate(logs, kwargs, steps)
    for step in range(steps):
        for i, x in enumerate(want[step]):
            got = np.array(logs[0]["params"][step][i], dtype=np.float32)
            assert np.array_equal(got, x), f"step {step} param {i}: {np.abs(got - x).max()}"


def _bucket_positions(xs, flat_positions, order):
    """Positions in DDP's bucket, which holds the parameters in ``order``."""
    sizes = [x.size for x in xs]
    starts_param = np.cumsum([0] + sizes[:-1])
    starts_bucket = {}
    off = 0
    for i in order:
        starts_bucket[i] = off
        off += sizes[i]
    out = []
    for p in flat_positions:
        i = int(np.searchsorted(starts_param, p, side="right") - 1)
        out.append(starts_bucket[i] + (p - starts_param[i]))
    return np.array(out, dtype=np.uint64)


CASES = [
    (4, dict(aggregation="l1", bits=4)),
    (3, dict(aggregation="l1", bits=8, tie_break="alternate")),
    (2, dict(aggregation="l1", bits=2, tie_break="random")),
    (4, dict(aggregation="vote", tie_break="alternate")),
    (4, dict(aggregation="vote", tie_break="random")),
]


@pytest.mark.parametrize("n,kwargs", CASES)
def test_ddp_training_follows_the_numpy_reference(n, kwargs):
    steps = 5
    logs = values(run_ranks("test_lion_cub:ddp_levers", n, kwargs={"steps": steps, "kwargs": kwargs}))
    _assert_follows_simulation(logs, kwargs, steps)
    assert logs[0]["steps_taken"] == steps


@pytest.mark.parametrize(
    "n,kwargs",
    [
        (2, dict(tie_break="zero")),
        (2, dict(tie_break="alternate")),
        (3, dict(tie_break="random")),
        (2, dict(aggregation="l1", bits=4, tie_break="alternate")),
        (3, dict(aggregation="l1", bits=2, tie_break="random")),
    ],
)
def test_unused_embedding_rows_stay_still_under_every_tie_rule(n, kwargs):
    """A token no rank sees has a zero gradient and momentum on every rank:
    its row moves by weight decay only, never by +-lr, whatever the tie
    rule, and the run follows the numpy reference."""
    steps = 6
    logs = values(run_ranks("test_lion_cub:ddp_levers", n, kwargs={"steps": steps, "kwargs": kwargs, "net": "lm"}))
    _assert_follows_simulation(logs, kwargs, steps)
    dim = 8
    x0 = np.array(logs[0]["x0"][0], dtype=np.float32).reshape(_TinyLM.VOCAB, dim)
    decay = _f32(1 - LION["lr"] * LION["weight_decay"])
    unused = x0[_TinyLM.USED :]
    for step in range(steps):
        unused = unused * decay
        got = np.array(logs[0]["params"][step][0], dtype=np.float32).reshape(_TinyLM.VOCAB, dim)
        assert np.array_equal(got[_TinyLM.USED :], unused), f"step {step}: an unused row moved"
        used = got[: _TinyLM.USED] - x0[: _TinyLM.USED] * decay ** (step + 1)
        assert np.abs(used).max() > LION["lr"] / 2  # the used rows train


# "random" draws its signs from positions in the collective's tensor: with
# overlap, DDP's bucket layout, which a restarted DDP model builds afresh for
# its first step (docs/lion-cub.md); voting at step() packs in the
# optimizer's order, which a restart keeps.
@pytest.mark.parametrize(
    "kwargs,overlap",
    [
        (dict(aggregation="l1", bits=4, tie_break="random"), False),
        (dict(aggregation="l1", bits=8, tie_break="alternate"), True),
        (dict(tie_break="alternate"), True),
    ],
)
def test_resume_from_each_ranks_state_dict_is_bitwise(kwargs, overlap, tmp_path):
    n, steps = 3, 6
    run = {"steps": steps, "kwargs": kwargs, "overlap": overlap}
    straight = values(run_ranks("test_lion_cub:ddp_levers", n, kwargs=run))
    resumed = values(
        run_ranks("test_lion_cub:ddp_levers", n, kwargs=dict(run, resume_at=3, ckpt=str(tmp_path)))
    )
    assert resumed[0]["params"] == straight[0]["params"]
    assert resumed[0]["steps_taken"] == steps


def ddp_habits(rank, n, steps, kwargs):
    """The habits of real scripts with the levers on: gradient accumulation
    under no_sync, a float loss scaled by GradScaler with an overflow on
    rank 1 at step 2, unscale_ then clip_grad_norm_ before step. Logs the
    gradients step() acts on (after unscaling and clipping)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = DDP(_net())
    opt = lionbit.DistributedLion(model.parameters(), **LION, **kwargs).attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log = {"x0": [p.detach().reshape(-1).tolist() for p in model.parameters()], "grads": [], "params": []}
    for step in range(steps):
        for micro in range(2):
            x, y = _batch(rank, 10 * step + micro)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if step == 2 and rank == 1:
                loss = loss * float("inf")
            if micro == 0:
                with model.no_sync():
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        log["grads"].append([p.grad.reshape(-1).tolist() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        log["params"].append([p.detach().reshape(-1).tolist() for p in model.parameters()])
    log["steps_taken"] = opt.steps_taken
    return log


@pytest.mark.parametrize(
    "n,kwargs", [(4, dict(tie_break="alternate")), (3, dict(aggregation="l1", bits=4, tie_break="alternate"))]
)
def test_levers_inside_a_loop_with_accumulation_scaler_and_clipping(n, kwargs):
    steps = 5
    logs = values(run_ranks("test_lion_cub:ddp_habits", n, kwargs={"steps": steps, "kwargs": kwargs}))
    assert logs[0]["steps_taken"] == steps - 1  # the overflow step was skipped and not counted
    assert logs[0]["params"][2] == logs[0]["params"][1]  # ... and changed nothing
    _assert_follows_simulation(logs, kwargs, steps)


def l1_bytes(rank, n, bits):
    import lionbit

    d = 1 << 16
    model = torch.nn.Linear(d, 1, bias=False)
    opt = lionbit.DistributedLion(model.parameters(), lr=0.01, aggregation="l1", bits=bits, tie_break="alternate")
    g = torch.Generator().manual_seed(rank)
    model.weight.grad = torch.randn(1, d, generator=g)
    lionbit.reset_stats()
    opt.step()
    return lionbit.stats()


@pytest.mark.parametrize("n,bits", [(4, 4), (3, 8)])
def test_l1_bytes_are_p_plus_one_bits_per_element(n, bits):
    d = 1 << 16
    want = (n - 1) / n * d * (bits + 1) / 8
    fixed = (n - 1) * (72 + 16)  # a call's header round and its phase-2 messages' heads
    for s in values(run_ranks("test_lion_cub:l1_bytes", n, kwargs={"bits": bits})):
        assert want <= s["bytes_sent"] <= 1.01 * want + fixed, (s["bytes_sent"], want)


def test_bad_optimizer_arguments():
    import lionbit

    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, words in (
        (dict(aggregation="l1", bits=9), "argument 'bits' must be an int from 2 to 8"),
        (dict(bits=4), "argument 'bits' applies to aggregation='l1' only"),
        (dict(tie_break="coin"), "argument 'tie_break' must be 'zero', 'alternate' or 'random'"),
        (dict(aggregation="avg", tie_break="random"), "'avg' has no ties"),
        (dict(aggregation="sum"), "argument 'aggregation' must be 'vote', 'avg' or 'l1'"),
    ):
        with pytest.raises(ValueError, match=words):
            lionbit.DistributedLion(p, **kwargs)


def test_single_process_l1_is_the_sign_of_its_own_level():
    import lionbit

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = lionbit.DistributedLion([p], lr=0.1, aggregation="l1", bits=2, tie_break="alternate")
    g = torch.randn(1000)
    p.grad = g.clone()
    x0 = p.detach().clone()
    opt.step()
    c = (torch.tensor(0.1, dtype=torch.float32) * g).numpy()  # b1 m + (1 - b1) g with m = 0
    q = np.clip(np.rint(c.astype(np.float64) * (1 / (2 * np.abs(c.astype(np.float64)).mean()))), -1, 1)
    # One rank: a level 0 is every rank's level 0, so it stays still under
    # "alternate" too (which would answer +1 at step 0).
    delta = np.sign(q)
    want = (x0.numpy() * np.float32(1.0)) - np.float32(0.1) * delta.astype(np.float32)
    assert np.array_equal(p.detach().numpy(), want)
    assert (q == 0).mean() > 0.3  # bits=2: small |c| quantize to 0
