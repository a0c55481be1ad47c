"""More of a training script's habits around DistributedLion under DDP, each
as the user's script on N = 2 and 3 real processes:

- uneven inputs under torch's Join: ``with Join([model, opt]):`` trains to
  the end (bare, clipping, accumulation, votes at ``step()``), and
  ``model.join()`` / ``Join([model])`` without the optimizer fails at once on
  every rank, naming the fix (never waits for the group's timeout);
- a parameter unfrozen after DDP wrapped the model is trained, alike with
  and without overlap;
- re-wrapping: ``opt.detach()`` then ``opt.attach(new_ddp)``, or a direct
  ``opt.attach(new_ddp)``, keeps the momentum; a new process group after
  ``destroy_process_group()``;
- a new optimizer for the same model halfway (DDP, FSDP2, FSDP1): a new
  DistributedLion takes the model over, the old one is freed, and torch's
  AdamW after it trains on the gradients DDP / FSDP average;
- ``DDP(gradient_as_bucket_view=True)``: ``p.grad`` a view of DDP's bucket,
  bare and with clipping;
- a convolutional model in ``channels_last`` (timm's ``--channels-last``,
  torchvision's reference scripts), under DDP, FSDP1 and as a plain module;
- two DDP models, each with its own DistributedLion (a GAN's loop: the
  generator's backward runs through the discriminator, whose hooks vote
  gradients its optimizer never steps on);
- a mixture of experts whose ranks route to different experts
  (``DDP(find_unused_parameters=True)``): an expert a rank did not use has
  gradient 0 there (its direction follows that rank's momentum), an expert
  no rank used is not stepped;
- hyperparameters that change: parameter groups with their own lr, beta2
  and weight decay, OneCycleLR cycling beta1 (``cycle_momentum``) and the lr
  of every group each step, the lr a tensor (as torch's optimizers allow),
  as a plain module, under DDP (both modes), FSDP2 and FSDP1.

Where they train, every rank compares its parameters bitwise with
``simulate``: Distributed Lion on N simulated ranks in one process, written
from the paper's rule and the float contract of lionbit.lion_math (plain torch
ops), in which a rank that has run out of data abstains: its direction
counts as 0 in the vote, its momentum stays as it is, and it applies the
voted update like every rank.
"""

import copy
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_training_loops import LION, _digest, _loss, _net

# Batches per rank: the 8 and 13, and a third rank that runs out first.
BATCHES = {2: [8, 13], 3: [8, 13, 5]}
STEPS = 6
UNFREEZE_STEP = 2  # the unfrozen-parameter case: "head" trains from this step on
HEAD = ("head.weight", "head.bias")


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def simulate(batches, loop="bare", frozen=(), unfreeze_at=0, fresh_momentum_at=None):
    """Distributed Lion on len(batches) simulated ranks; rank r has
    batches[r] batches and abstains after them. ``loop``: "bare", "clip"
    (each rank clips its own gradients to norm 1) or "accumulate" (two
    micro-batches summed). Parameters named in ``frozen`` have no gradient
    (and are not stepped) before step ``unfreeze_at``. Every momentum is
    zero again at step ``fresh_momentum_at`` (a new optimizer). Returns the
    parameters after max(batches) steps."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    cb1, comb1, cb2, comb2, clr, cdecay = (_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd))
    model = _net()
    names = [name for name, _ in model.named_parameters()]
    replicas = [copy.deepcopy(model) for _ in batches]
    momenta = [{name: torch.zeros_like(p) for name, p in model.named_parameters()} for _ in batches]
    for step in range(max(batches)):
        if step == fresh_momentum_at:
            momenta = [{name: torch.zeros_like(p) for name, p in model.named_parameters()} for _ in batches]
        trained = [name for name in names if name not in frozen or step >= unfreeze_at]
        directions = []  # per rank: {name: sign(c)}, or None when it has run out of data
        for r, rep in enumerate(replicas):
            if step >= batches[r]:
                directions.append(None)  # abstains; its momentum stays
                continue
            for (name, p), q in zip(rep.named_parameters(), model.parameters()):
                p.data.copy_(q.data)
                p.grad = None
                p.requires_grad_(name in trained)
            for micro in range(2 if loop == "accumulate" else 1):
                _loss(rep, r, step, micro, "bare").backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_([p for p in rep.parameters() if p.grad is not None], 1.0)
            dirs = {}
            for name, p in rep.named_parameters():
                if p.grad is None:
                    continue
                g, m = p.grad, momenta[r][name]
                dirs[name] = torch.sign(torch.add(torch.mul(m, cb1), torch.mul(g, comb1)))
                momenta[r][name] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
            directions.append(dirs)
        for name, p in model.named_parameters():
            if name not in trained:
                continue  # no gradient anywhere: not stepped (no decay either)
            total = sum((d[name] for d in directions if d is not None), torch.zeros_like(p))
            p.data.copy_(torch.sub(torch.mul(p.data, cdecay), torch.mul(torch.sign(total), clr)))
    return [p.detach().clone() for p in model.parameters()]


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, bucket_cap_mb=0.001)  # several buckets


def _attached(overlap, double_buffer=False):
    """A fresh model, its DDP wrapper and a DistributedLion attached to it."""
    import lionbit

    model = _net()
    ddp = _ddp(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION, double_buffer=double_buffer)
    opt.attach(ddp, overlap=overlap)
    return model, ddp, opt


def _train(ddp, opt, rank, steps, loop="bare"):
    for step in steps:
        opt.zero_grad()
        if loop == "accumulate":
            with ddp.no_sync():
                _loss(ddp, rank, step, 0, "bare").backward()
            _loss(ddp, rank, step, 1, "bare").backward()
        else:
            _loss(ddp, rank, step, 0, "bare").backward()
        if loop == "clip":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()


def _same(model, want, what):
    for (name, got), w in zip(model.named_parameters(), want):
        assert torch.equal(got.detach(), w), f"{what}: {name} differs from the simulation"


# -- 1. uneven inputs: torch's Join ---------------------------------------------


def join_loop(rank, n, loop, overlap, double_buffer=False):
    """The user's loop over this rank's own number of batches, inside
    ``with Join([model, opt]):``."""
    from torch.distributed.algorithms.join import Join


    torch.set_num_threads(1)
    batches = BATCHES[n]
    model, ddp, opt = _attached(overlap, double_buffer)
    with Join([ddp, opt]):
        _train(ddp, opt, rank, range(batches[rank]), loop)
    _same(model, simulate(batches, loop), f"Join {loop} (overlap={overlap})")
    return {"digest": _digest(model.parameters()), "steps": opt.steps_taken, "overlap_now": opt.attachment.overlap}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "loop,overlap", [("bare", True), ("bare", False), ("clip", True), ("accumulate", True)],
    ids=["bare", "at_step", "clip", "accumulate"],
)
def test_join_with_uneven_inputs_trains_to_the_end(loop, overlap, n):
    res = values(run_ranks("test_habits:join_loop", n, kwargs={"loop": loop, "overlap": overlap},
                           pg_timeout=30, timeout=180))
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    assert all(r["steps"] == max(BATCHES[n]) for r in res), res
    # Clipping falls back to votes at step() on every rank alike, the joined ones too.
    assert all(r["overlap_now"] == (overlap and loop != "clip") for r in res), res


def join_without_the_optimizer(rank, n, how, overlap):
    """``model.join()`` / ``Join([model])`` without the optimizer: every
    rank fails at once with an error that names the fix. First, a Join that
    puts the optimizer before the model (or holds it alone) is refused when
    it is made, on every rank, before any collective."""
    from torch.distributed.algorithms.join import Join


    torch.set_num_threads(1)
    batches = BATCHES[n]
    model, ddp, opt = _attached(overlap)
    for joinables in ([opt, ddp], [opt]):
        with pytest.raises(ValueError, match=r"Join\(\[model, opt\]\)"):
            Join(joinables)
    ctx = ddp.join() if how == "model.join" else Join([ddp])
    start = time.monotonic()
    try:
        with ctx:
            _train(ddp, opt, rank, range(batches[rank]))
    except RuntimeError as err:
        error = str(err)
    else:
        raise AssertionError("the Join without the optimizer trained on")
    seconds = time.monotonic() - start
    dist.barrier()  # the standard path still works (and no rank leaves before its peers have their error)
    return {"error": error, "seconds": seconds, "joined": batches[rank] == min(batches)}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("how,overlap", [("model.join", True), ("Join([model])", False)])
def test_join_without_the_optimizer_fails_fast_naming_the_fix(how, overlap, n):
    # pg_timeout: a hang would end in a timeout error (not the one asserted) after 30 s. Fresh
    # ranks: the failed Join leaves its own collectives unmatched on the group.
    res = values(run_ranks("test_habits:join_without_the_optimizer", n, kwargs={"how": how, "overlap": overlap},
                           pg_timeout=30, timeout=120, fresh=True))
    for r in res:
        assert "`with Join([model, opt]):`" in r["error"], r
        if r["joined"]:
            assert "not part of that Join" in r["error"], r
        else:
            assert "rejected their input" in r["error"] and "join" in r["error"], r
        assert r["seconds"] < 20, r  # the whole loop, well inside the group's timeout


# -- 2. a parameter unfrozen after DDP wrapped the model -------------------------


def unfrozen_after_wrapping(rank, n):
    """``head`` is frozen when DDP wraps the model (so it is in none of DDP's
    buckets) and unfrozen at UNFREEZE_STEP: trained from then on, with votes
    in backward and at step() alike."""
    import lionbit

    torch.set_num_threads(1)
    want = simulate([STEPS] * n, frozen=HEAD, unfreeze_at=UNFREEZE_STEP)
    digests = {}
    for overlap in (True, False):
        model = _net()
        model.head.requires_grad_(False)
        ddp = _ddp(model)
        opt = lionbit.DistributedLion(ddp.parameters(), **LION)
        opt.attach(ddp, overlap=overlap)
        _train(ddp, opt, rank, range(UNFREEZE_STEP))
        before = model.head.weight.detach().clone()
        model.head.requires_grad_(True)
        _train(ddp, opt, rank, range(UNFREEZE_STEP, STEPS))
        assert not torch.equal(model.head.weight.detach(), before), f"overlap={overlap}: head was not trained"
        _same(model, want, f"unfrozen after wrapping (overlap={overlap})")
        assert opt.attachment.fallbacks == 0
        digests[str(overlap)] = _digest(model.parameters())
    assert digests["True"] == digests["False"]
    return digests["True"]


@pytest.mark.parametrize("n", [2, 3])
def test_a_parameter_unfrozen_after_wrapping_is_trained_in_both_modes(n):
    res = values(run_ranks("test_habits:unfrozen_after_wrapping", n))
    assert len(set(res)) == 1, "replicas differ"


# -- 3. re-wrapping the model ----------------------------------------------------


def rewrap(rank, n, how):
    """Train on one DDP wrapper, wrap the same module in a new DDP and attach
    the optimizer to it (after ``detach()``, or directly), then back to the
    first wrapper: bitwise an uninterrupted run (the momentum is kept)."""
    import lionbit

    torch.set_num_threads(1)
    model = _net()
    first = _ddp(model)
    opt = lionbit.DistributedLion(first.parameters(), **LION)
    opt.attach(first)
    with pytest.raises(RuntimeError, match="already attached"):
        opt.attach(first)
    _train(first, opt, rank, range(0, 3))
    second = _ddp(model)  # the first stays alive, its hook leaving the local gradients
    if how == "detach":
        opt.detach()
    opt.attach(second)
    _train(second, opt, rank, range(3, 6))
    if how == "detach":
        opt.detach()
    opt.attach(first)  # back: the first wrapper's hook slot serves again
    _train(first, opt, rank, range(6, 8))
    _same(model, simulate([8] * n), f"re-wrapped ({how})")
    return _digest(model.parameters())


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("how", ["detach", "direct"])
def test_rewrapping_keeps_the_momentum(how, n):
    res = values(run_ranks("test_habits:rewrap", n, kwargs={"how": how}))
    assert len(set(res)) == 1, "replicas differ"


def own_comm_hook(rank, n):
    """A script that compressed DDP's all-reduce with a comm hook of its own
    (bf16 here; PowerSGD alike) keeps registering it: attach refuses on every
    rank, naming the hook, and changes nothing; the same module in a DDP
    without the hook then trains as the simulation."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import lionbit

    model = _net()
    hooked = _ddp(model)
    hooked.register_comm_hook(None, default_hooks.bf16_compress_hook)
    opt = lionbit.DistributedLion(hooked.parameters(), **LION)
    with pytest.raises(RuntimeError) as err:
        opt.attach(hooked)
    ddp = _ddp(model)
    opt.attach(ddp)
    _train(ddp, opt, rank, range(4))
    _same(model, simulate([4] * n), "after the refused attach")
    return str(err.value)


def test_a_ddp_model_with_its_own_comm_hook_is_refused_naming_it():
    for rank, said in enumerate(values(run_ranks("test_habits:own_comm_hook", 2))):
        assert said == (f"DistributedLion.attach on rank {rank}: the DDP model already has a comm hook "
                        "(bf16_compress_hook), and DDP takes one; DistributedLion's own replaces DDP's all-reduce "
                        "with the 1-bit vote, so build the DDP model without registering bf16_compress_hook"), said


def steps_apart(rank, n, workdir, overlap):
    """A restart where rank 1 found no checkpoint of its own (a per-rank
    file missing, a glob that matched another run's): rank 0 goes on from
    step 3, rank 1 from scratch. The first vote fails on every rank, naming
    the two seeds (the steps), and no parameter changes; a vote one step
    against another would train on, or hang where the step counts end apart."""
    import os

    import lionbit

    model = _net()
    ddp = _ddp(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp, overlap=overlap)
    _train(ddp, opt, rank, range(3))
    mine = os.path.join(workdir, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, mine)
    dist.barrier()

    model = _net()
    ddp = _ddp(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp, overlap=overlap)
    if rank == 0:
        saved = torch.load(mine, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as err:
        _train(ddp, opt, rank, range(3, 4))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a parameter changed"
    return [str(err.value), opt.steps_taken]


@pytest.mark.parametrize("overlap", [True, False], ids=["votes in backward", "votes at step()"])
def test_ranks_at_different_steps_fail_their_first_vote(tmp_path, overlap):
    res = values(run_ranks("test_habits:steps_apart", 2, kwargs={"workdir": str(tmp_path), "overlap": overlap}))
    for rank, (said, steps) in enumerate(res):
        assert steps == (3 if rank == 0 else 0)
        mine, theirs = (3, 0) if rank == 0 else (0, 3)
        assert f"the tie rule's seed differs across ranks: rank {rank} has {mine}, rank {1 - rank} has {theirs} " \
               "(a caller that seeds each call with its step count has ranks at different steps)" in said, said


def sharded_steps_apart(rank, n, wrapper):
    """steps_apart under FSDP2, FSDP1 and HSDP (2 nodes x 2): after three
    steps every rank builds its model and optimizer again and loads the
    model's state, and every rank but the last its optimizer's (the last
    found none). The first vote fails, nothing changes, and the default
    group is still in step (an all-reduce after it)."""
    import lionbit

    torch.set_num_threads(1)

    def build():
        model = _net()
        if wrapper == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard")) if wrapper == "hsdp" \
                else None
            for layer in (model.a, model.b):
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        opt = lionbit.DistributedLion(wrapped.parameters(), **LION)
        opt.attach(wrapped)
        return wrapped, opt

    wrapped, opt = build()
    _train(wrapped, opt, rank, range(3))
    saved, weights = opt.state_dict(), wrapped.state_dict()
    wrapped, opt = build()
    wrapped.load_state_dict(weights)
    if rank != n - 1:
        opt.load_state_dict(saved)
    before = [p.detach().clone() for p in wrapped.parameters()]
    with pytest.raises((ValueError, RuntimeError)) as err:
        _train(wrapped, opt, rank, range(3, 4))
    assert all(torch.equal(p.detach(), b) for p, b in zip(wrapped.parameters(), before)), "a parameter changed"
    t = torch.ones(1)
    dist.all_reduce(t)
    return [str(err.value), opt.steps_taken, t.item()]


@pytest.mark.parametrize("wrapper,n", [("fsdp2", 2), ("fsdp1", 2), ("hsdp", 4)])
def test_sharded_ranks_at_different_steps_fail_their_first_vote(wrapper, n):
    res = values(run_ranks("test_habits:sharded_steps_apart", n, kwargs={"wrapper": wrapper}))
    seed = "the tie rule's seed differs across ranks: rank {} has {}, rank {} has {} (a caller that seeds each call " \
           "with its step count has ranks at different steps)"
    for rank, (said, steps, total) in enumerate(res):
        assert steps == (0 if rank == n - 1 else 3) and total == n, (rank, steps, total)
        if wrapper != "hsdp":
            mine, theirs = (0, 3) if rank == 1 else (3, 0)
            want = f"reduce_scatter_sign(op=vote) on rank {rank}: " + seed.format(rank, mine, 1 - rank, theirs)
            assert want in said, (rank, said)
        elif rank % 2 == 0:  # shard 0's replicas (global ranks 0 and 2) agreed; their node-mates did not
            assert f"(FSDP2, HSDP) on rank {rank}: another rank of this node failed its vote" in said, (rank, said)
        else:  # shard 1's replicas, global ranks 1 and 3 (ranks 0 and 1 of their replica group): named globally
            mine, theirs = (3, 0) if rank == 1 else (0, 3)
            assert f"all_reduce_sign(op=vote) on rank {rank} (group of ranks [1, 3]): " + seed.format(
                rank, mine, 4 - rank, theirs) in said, (rank, said)


def new_process_group(rank, n, workdir):
    """destroy_process_group(), a new init_process_group, a new DDP wrapper:
    opt.state_dict() works throughout and training goes on, bitwise."""
    import lionbit

    torch.set_num_threads(1)
    model = _net()
    ddp = _ddp(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp)
    _train(ddp, opt, rank, range(0, 3))
    assert opt.state_dict()["lionbit"].items() >= {"rank": rank, "world_size": n}.items()
    dist.destroy_process_group()
    sd = opt.state_dict()  # no process group: no marker, no error
    assert "lionbit" not in sd and len(sd["state"]) == len(list(model.parameters()))
    dist.init_process_group("lionbit", init_method=f"file://{workdir}/store-again", rank=rank, world_size=n)
    opt.state_dict()  # still attached to the destroyed group's model: no error either
    ddp = _ddp(model)
    opt.attach(ddp)
    assert opt.state_dict()["lionbit"].items() >= {"rank": rank, "world_size": n}.items()
    _train(ddp, opt, rank, range(3, 6))
    _same(model, simulate([6] * n), "after a new process group")
    return _digest(model.parameters())


@pytest.mark.parametrize("n", [2, 3])
def test_a_new_process_group_after_destroy(n, tmp_path):
    res = values(run_ranks("test_habits:new_process_group", n, kwargs={"workdir": str(tmp_path)}))
    assert len(set(res)) == 1, "replicas differ"


# -- 3b. a new optimizer for the same model ----------------------------------------

STAGE = 3  # new_optimizer: the steps the first optimizer takes
ADAMW = dict(lr=0.01, weight_decay=0.01)


def _wrap(model, wrapper):
    """``model`` under DDP, FSDP2 (a unit a layer and the root) or FSDP1."""
    if wrapper == "ddp":
        return _ddp(model)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.a, model.b):
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)


def _whole(model, wrapped, wrapper):
    """The model's parameters, whole, in the unwrapped model's order."""
    if wrapper == "fsdp2":
        return [p.full_tensor() for p in model.parameters()]
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapped):
            return [p.detach().clone() for p in wrapped.parameters()]
    return [p.detach().clone() for p in model.parameters()]


def simulate_adamw_after(start, n, steps):
    """torch's AdamW from the parameters ``start`` on the mean of the n
    ranks' gradients (what DDP and FSDP reduce), one process."""
    model = _net()
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in steps:
        grads = []
        for r in range(n):
            model.zero_grad()
            _loss(model, r, step, 0, "bare").backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, gs in zip(model.parameters(), zip(*grads)):
            p.grad = sum(g / n for g in gs)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def new_optimizer(rank, n, wrapper, then, how):
    """A script that builds a new optimizer (and scheduler) for the same
    model halfway, as fine-tuning stages and tuners' trials do, with no
    detach(): ``how`` "rebind" assigns the new ones to the old names (the
    old optimizer is still held while the new one attaches: the new one
    takes the model over), "del" drops the old ones first. Either way the
    first DistributedLion is freed with its momenta; a new DistributedLion
    trains from zero momenta, and torch's AdamW on the gradients DDP or FSDP
    averages, as if lionbit had never been attached."""
    import weakref

    import lionbit

    torch.set_num_threads(1)
    model = _net()
    wrapped = _wrap(model, wrapper)

    def build(kind):
        if kind == "lion":
            opt = lionbit.DistributedLion(wrapped.parameters(), **LION).attach(wrapped)
        else:
            opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    opt, sched = build("lion")
    first = weakref.ref(opt)
    for step in range(STEPS):
        if step == STAGE:
            if how == "del":
                del opt, sched
            opt, sched = build(then)
            freed = first() is None
        opt.zero_grad()
        _loss(wrapped, rank, step, 0, "bare").backward()
        opt.step()
        sched.step()
    got = _whole(model, wrapped, wrapper)
    if then == "lion":
        want = simulate([STEPS] * n, fresh_momentum_at=STAGE)
        same = [bool(torch.equal(g, w)) for g, w in zip(got, want)]
    else:
        want = simulate_adamw_after(simulate([STAGE] * n), n, range(STAGE, STEPS))
        same = [bool(torch.allclose(g, w, rtol=1e-5, atol=1e-6)) for g, w in zip(got, want)]
    return {"freed": freed, "same": same, "digest": _digest(got)}


@pytest.mark.parametrize("wrapper,then,how", [("ddp", "lion", "rebind"), ("ddp", "adamw", "del"),
                                              ("ddp", "adamw", "rebind"), ("fsdp2", "lion", "del"),
                                              ("fsdp2", "adamw", "rebind"), ("fsdp1", "lion", "rebind"),
                                              ("fsdp1", "adamw", "del")])
def test_a_new_optimizer_for_the_same_model_takes_it_over(wrapper, then, how):
    res = values(run_ranks("test_habits:new_optimizer", 2, kwargs={"wrapper": wrapper, "then": then, "how": how}))
    for r in res:
        assert r["freed"], "the first DistributedLion was not freed"
        assert all(r["same"]), r["same"]
    assert len({r["digest"] for r in res}) == 1, "replicas differ"


def still_held(rank, n, wrapper, case):
    """The first optimizer dropped by the script but still held elsewhere (a
    framework's list: accelerate keeps each prepared optimizer), so it stays
    attached: torch's AdamW stepping the model must not move the replicas
    apart. "held": refused on every rank, nothing changed, then detach() and
    AdamW trains as on the mean gradient; "rewrapped": the model wrapped
    again (a new DDP: its all-reduce), AdamW trains; "wrapper": an optimizer
    that wraps the DistributedLion (a Lookahead) steps it."""
    import lionbit

    torch.set_num_threads(1)
    model = _net()
    wrapped = _wrap(model, wrapper)
    held = [lionbit.DistributedLion(wrapped.parameters(), **LION).attach(wrapped)]  # the framework's reference
    out = {}
    for step in range(STEPS):
        if step == STAGE:
            if case == "wrapper":
                opt = _Lookahead(held[0])
            else:
                wrapped = _ddp(model) if case == "rewrapped" else wrapped
                opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
        elif step < STAGE:
            opt = held[0]
        opt.zero_grad()
        _loss(wrapped, rank, step, 0, "bare").backward()
        if step == STAGE and case == "held":
            before = _digest(_whole(model, wrapped, wrapper))
            try:
                opt.step()
            except RuntimeError as err:
                out["error"] = str(err)
            out["unchanged"] = _digest(_whole(model, wrapped, wrapper)) == before
            held[0].detach()  # the fix the error names; this step's gradients are still the local ones
            opt.zero_grad()
            _loss(wrapped, rank, step, 0, "bare").backward()
        opt.step()
    got = _whole(model, wrapped, wrapper)
    if case == "wrapper":
        want = simulate([STEPS] * n)
        out["same"] = [bool(torch.equal(g, w)) for g, w in zip(got, want)]
    else:
        want = simulate_adamw_after(simulate([STAGE] * n), n, range(STAGE, STEPS))
        out["same"] = [bool(torch.allclose(g, w, rtol=1e-5, atol=1e-6)) for g, w in zip(got, want)]
    return {**out, "digest": _digest(got)}


class _Lookahead(torch.optim.Optimizer):
    """A wrapper optimizer as Lookahead implementations write one: its
    param_groups are the wrapped optimizer's, its step calls that one's."""

    def __init__(self, base):
        self.base = base
        super().__init__(base.param_groups, {})
        self.param_groups = base.param_groups

    def step(self, closure=None):
        return self.base.step(closure)


@pytest.mark.parametrize("wrapper,case", [("ddp", "held"), ("fsdp2", "held"), ("ddp", "rewrapped"),
                                          ("ddp", "wrapper")])
def test_another_optimizer_on_a_model_a_held_distributed_lion_serves(wrapper, case):
    res = values(run_ranks("test_habits:still_held", 2, kwargs={"wrapper": wrapper, "case": case}))
    for rank, r in enumerate(res):
        if case == "held":
            assert f"AdamW.step on rank {rank}: its parameters" in r["error"] and "lion_opt.detach()" in r["error"] \
                and "list" in r["error"], r.get("error")
            assert r["unchanged"], "the refused step changed the parameters"
        else:
            assert "error" not in r, r
        assert all(r["same"]), r["same"]
    assert len({r["digest"] for r in res}) == 1, "replicas differ"


# -- 4. DDP's buckets as the gradients (gradient_as_bucket_view=True) ----------


def bucket_views(rank, n, loop):
    """``DDP(model, gradient_as_bucket_view=True)``, the setting that saves
    DDP's copy of each bucket back into ``p.grad``: ``p.grad`` is then a view
    of DDP's bucket. The loop trains as the simulation does; clipping edits
    the bucket itself in place, which the attachment must see (its votes at
    ``step()`` from then on)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp)
    _train(ddp, opt, rank, range(STEPS), loop)
    views = all(p.grad._base is not None for p in ddp.parameters())
    _same(model, simulate([STEPS] * n, loop), f"bucket views, {loop}")
    return {"digest": _digest(model.parameters()), "overlap_now": opt.attachment.overlap, "views": views}


@pytest.mark.parametrize("loop", ["bare", "clip"])
def test_ddp_with_gradients_as_bucket_views(loop):
    res = values(run_ranks("test_habits:bucket_views", 2, kwargs={"loop": loop}))
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    assert all(r["views"] for r in res), "p.grad is not a view of DDP's bucket: the case is not tested"
    assert all(r["overlap_now"] == (loop == "bare") for r in res), res


# -- 5. channels_last -------------------------------------------------------------


class ConvNet(torch.nn.Module):
    """Two convolutions, one with BatchNorm (DDP broadcasts its running
    statistics; in training mode they do not enter the gradients)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 6, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(6)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.c2(torch.relu(self.c1(x)))))
        return self.head(x.mean((2, 3)))


def _conv_net():
    torch.manual_seed(0)
    return ConvNet().to(memory_format=torch.channels_last)


def _conv_loss(model, rank, step):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    x = torch.randn(4, 3, 9, 9, generator=g).to(memory_format=torch.channels_last)
    return torch.nn.functional.cross_entropy(model(x), torch.randint(0, 4, (4,), generator=g))


def simulate_conv(n, loop, steps):
    """``simulate``'s Distributed Lion for the channels_last ConvNet: n
    replicas, each rank's gradient from its own copy (channels_last, as the
    user's), the rule in plain torch ops on the parameters' values."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    cb1, comb1, cb2, comb2, clr, cdecay = (_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd))
    model, rep = _conv_net(), _conv_net()
    momenta = [[torch.zeros(p.shape) for p in model.parameters()] for _ in range(n)]
    for step in range(steps):
        total = [torch.zeros(p.shape) for p in model.parameters()]
        for r in range(n):
            for p, q in zip(rep.parameters(), model.parameters()):
                p.data.copy_(q.data)
                p.grad = None
            _conv_loss(rep, r, step).backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(rep.parameters(), 1.0)
            for i, p in enumerate(rep.parameters()):
                g, m = p.grad, momenta[r][i]
                total[i] += torch.sign(torch.add(torch.mul(m, cb1), torch.mul(g, comb1)))
                momenta[r][i] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
        for p, t in zip(model.parameters(), total):
            p.data.copy_(torch.sub(torch.mul(p.data, cdecay), torch.mul(torch.sign(t), clr)))
    return [p.detach().clone() for p in model.parameters()], momenta


def channels_last(rank, n, wrapper, loop, fused=None):
    """The user's loop on a channels_last model: DDP (one bucket, so the
    weights lie at offsets inside it; ``bucket_view``: gradient_as_bucket_view),
    FSDP1 or the plain module (FSDP2 refuses such parameters itself), bare
    (DDP: votes in backward), clipping (at step()) or a GradScaler (the
    gradients scaled by 2^10 in backward, unscaled at step(): the contiguous
    copies of the weights' gradients must be taken after); the fused kernels
    (through contiguous copies) or, with ``fused=False``, torch ops.
    Parameters and this rank's momenta equal the simulation's (unscaled
    gradients: a power of 2 scales and unscales exactly)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    model = _conv_net()
    assert not model.c1.weight.is_contiguous()  # the case under test
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        run = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        run = DDP(model, gradient_as_bucket_view=wrapper == "bucket_view") if wrapper != "plain" else model
    opt = lionbit.DistributedLion(run.parameters(), fused=fused, **LION)
    if wrapper != "plain":
        opt.attach(run)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if loop == "scaler" else None
    for step in range(STEPS):
        loss = _conv_loss(run, rank, step)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if loop == "clip":
                torch.nn.utils.clip_grad_norm_(run.parameters(), 1.0)
            opt.step()
        opt.zero_grad()
    want, momenta = simulate_conv(n, loop, STEPS)
    if wrapper == "fsdp1":  # (its flat parameters hold the weights contiguously; the momenta are the flat shards')
        with FSDP.summon_full_params(run):
            full = [p.detach().clone() for p in model.parameters()]
        for (name, _), got, w in zip(model.named_parameters(), full, want):
            assert torch.equal(got, w), f"channels_last, fsdp1: {name} differs from the simulation"
        return _digest(full)
    _same(model, want, f"channels_last, {wrapper}, {loop}")
    for (name, p), m in zip(model.named_parameters(), momenta[rank]):
        assert torch.equal(opt.state[p]["exp_avg"], m), f"channels_last, {wrapper}, {loop}: {name}'s momentum"
    return _digest(model.parameters())


@pytest.mark.parametrize("wrapper,loop,fused", [("ddp", "bare", None), ("ddp", "clip", True), ("ddp", "bare", False),
                                                ("bucket_view", "bare", None), ("plain", "bare", None),
                                                ("plain", "scaler", None), ("plain", "scaler", False),
                                                ("ddp", "scaler", None), ("fsdp1", "bare", None)])
def test_a_channels_last_model_trains_as_the_simulation(wrapper, loop, fused):
    res = values(run_ranks("test_habits:channels_last", 2, kwargs={"wrapper": wrapper, "loop": loop, "fused": fused}))
    assert len(set(res)) == 1, "replicas differ"


def test_dense_layout_is_torchs_non_overlapping_and_dense():
    """lionbit.lion_math.dense_layout, which tells which parameters the fused
    kernels update through a contiguous copy: torch's "non-overlapping and
    dense" (the layouts DDP keeps a gradient in within its bucket)."""
    from lionbit.lion_math import dense_layout

    t = torch.zeros(4, 3, 5, 6)
    dense = [t, t.to(memory_format=torch.channels_last), t.permute(3, 1, 0, 2), t[:1], torch.zeros(7, 1).t(),
             torch.zeros(0, 3)]
    sparse = [t[:, :2], t[..., ::2], torch.zeros(3).expand(4, 3), t.transpose(0, 1)[1:]]
    assert [dense_layout(x) for x in dense] == [True] * len(dense)
    assert [dense_layout(x) for x in sparse] == [False] * len(sparse)


# -- two models, two optimizers: a GAN's loop ---------------------------------------------


def _gan():
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return gen, disc


def _gan_batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _gan_losses(gen, disc, rank, step):
    """The discriminator's loss (the generator's output detached) and a
    function for the generator's (through the discriminator as it stands)."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    real, z = _gan_batch(rank, step)
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    loss_d = bce(disc(real), ones) + bce(disc(gen(z).detach()), zeros)
    return loss_d, lambda: bce(disc(gen(z)), ones)


def simulate_gan(n, steps):
    """Each optimizer's Distributed Lion on n simulated ranks, plain torch ops:
    the discriminator's step from its loss, then the generator's from the
    loss through the updated discriminator (its gradients there unused)."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    cb1, comb1, cb2, comb2, clr, cdecay = (_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd))
    gen, disc = _gan()
    momenta = {id(p): [torch.zeros_like(p) for _ in range(n)] for p in [*gen.parameters(), *disc.parameters()]}

    def step_of(model, grads):  # grads[r]: rank r's gradients of model's parameters
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                vote = torch.zeros_like(p)
                for r in range(n):
                    m = momenta[id(p)][r]
                    vote += torch.sign(torch.add(torch.mul(m, cb1), torch.mul(grads[r][i], comb1)))
                    momenta[id(p)][r] = torch.add(torch.mul(m, cb2), torch.mul(grads[r][i], comb2))
                p.copy_(torch.sub(torch.mul(p, cdecay), torch.mul(torch.sign(vote), clr)))

    for step in range(steps):
        grads = []
        for r in range(n):
            loss_d, _ = _gan_losses(gen, disc, r, step)
            grads.append(torch.autograd.grad(loss_d, list(disc.parameters())))
        step_of(disc, grads)
        grads = []
        for r in range(n):
            _, loss_g = _gan_losses(gen, disc, r, step)
            grads.append(torch.autograd.grad(loss_g(), list(gen.parameters())))
        step_of(gen, grads)
    return [p.detach().clone() for p in [*gen.parameters(), *disc.parameters()]]


def gan_loop(rank, n, overlap):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    steps = 5
    gen, disc = _gan()
    g, d = DDP(gen, bucket_cap_mb=0.0001), DDP(disc, bucket_cap_mb=0.0001)  # a bucket or two a model
    opt_g = lionbit.DistributedLion(g.parameters(), **LION).attach(g, overlap=overlap)
    opt_d = lionbit.DistributedLion(d.parameters(), **LION).attach(d, overlap=overlap)
    for step in range(steps):
        opt_d.zero_grad()
        loss_d, loss_g = _gan_losses(g, d, rank, step)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g().backward()  # (the discriminator's hooks vote too: its next zero_grad drops them)
        opt_g.step()
    want = simulate_gan(n, steps)
    got = [p.detach() for p in [*gen.parameters(), *disc.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the GAN's loop differs from the simulation"
    return {"digest": _digest(got), "fallbacks": (opt_g.attachment.fallbacks, opt_d.attachment.fallbacks)}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_step"])
def test_two_ddp_models_with_their_own_optimizers_train_as_the_simulation(overlap):
    res = values(run_ranks("test_habits:gan_loop", 2, kwargs={"overlap": overlap}))
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    assert all(r["fallbacks"] == [0, 0] for r in res), res  # (the votes stay in backward)


# -- 7. hyperparameters that change every step -----------------------------------

SCHED_STEPS = 6


def _sched_groups(params: dict, lr_tensor: bool) -> list:
    """Three groups with their own lr, beta2 and weight decay (from named parameters)."""
    def lr(v):
        return torch.tensor(v) if lr_tensor else v

    return [dict(params=[params["a.weight"], params["b.weight"]], lr=lr(0.02), betas=(0.9, 0.99), weight_decay=0.1),
            dict(params=[params["a.bias"], params["b.bias"]], lr=lr(0.01), betas=(0.9, 0.98), weight_decay=0.0),
            dict(params=[params["head.weight"], params["head.bias"]], lr=lr(0.04), betas=(0.9, 0.999),
                 weight_decay=0.3)]


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01, 0.04], total_steps=SCHED_STEPS,
                                               cycle_momentum=True, base_momentum=0.8, max_momentum=0.95)


def _schedule() -> list:
    """Each step's (lr, beta1, beta2, weight decay) of each group, from the same
    scheduler on a stand-in optimizer that has betas (Adam)."""
    net = _net()
    stand_in = torch.optim.Adam(_sched_groups(dict(net.named_parameters()), False))
    sched, out = _one_cycle(stand_in), []
    for _ in range(SCHED_STEPS):
        out.append([(g["lr"], *g["betas"], g["weight_decay"]) for g in stand_in.param_groups])
        stand_in.step()
        sched.step()
    return out


def simulate_schedule(n: int) -> list:
    """Distributed Lion on n simulated ranks, each group at its step's values."""
    model = _net()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    params = dict(model.named_parameters())
    name_of = {id(p): name for name, p in params.items()}
    group_of = {name_of[id(p)]: i for i, g in enumerate(_sched_groups(params, False)) for p in g["params"]}
    momenta = [{name: torch.zeros_like(p) for name, p in model.named_parameters()} for _ in range(n)]
    for step, values_ in enumerate(_schedule()):
        coefs = [tuple(_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd)) for lr, b1, b2, wd in values_]
        directions = []
        for r, rep in enumerate(replicas):
            for p, q in zip(rep.parameters(), model.parameters()):
                p.data.copy_(q.data)
                p.grad = None
            _loss(rep, r, step, 0, "bare").backward()
            dirs = {}
            for name, p in rep.named_parameters():
                cb1, comb1, cb2, comb2, _, _ = coefs[group_of[name]]
                m = momenta[r][name]
                dirs[name] = torch.sign(torch.add(torch.mul(m, cb1), torch.mul(p.grad, comb1)))
                momenta[r][name] = torch.add(torch.mul(m, cb2), torch.mul(p.grad, comb2))
            directions.append(dirs)
        for name, p in model.named_parameters():
            *_, clr, cdecay = coefs[group_of[name]]
            total = sum((d[name] for d in directions), torch.zeros_like(p))
            p.data.copy_(torch.sub(torch.mul(p.data, cdecay), torch.mul(torch.sign(total), clr)))
    return [p.detach().clone() for p in model.parameters()]


def schedule_loop(rank, n, wrapper, lr_tensor):
    """The user's script: groups, OneCycleLR stepped after every step()."""
    import lionbit

    torch.set_num_threads(1)
    model = _net()
    names = dict(model.named_parameters())
    if wrapper == "plain":
        wrapped = model
    elif wrapper.startswith("ddp"):
        wrapped = _ddp(model)
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.a, model.b):
            fully_shard(layer)
        wrapped = fully_shard(model)
        names = dict(model.named_parameters())  # the sharded DTensors
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
        names = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in wrapped.named_parameters()}
    opt = lionbit.DistributedLion(_sched_groups(names, lr_tensor))
    if wrapper != "plain":
        opt.attach(wrapped, **({"overlap": wrapper == "ddp"} if wrapper.startswith("ddp") else {}))
    sched = _one_cycle(opt)
    for step in range(SCHED_STEPS):
        opt.zero_grad()
        _loss(wrapped, rank, step, 0, "bare").backward()
        opt.step()
        sched.step()
    if wrapper == "fsdp2":
        got = [p.full_tensor() for p in model.parameters()]
    elif wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapped):
            got = [p.detach().clone() for p in wrapped.parameters()]
    else:
        got = [p.detach() for p in model.parameters()]
    want = simulate_schedule(n)
    return {"same": [bool(torch.equal(g, w)) for g, w in zip(got, want)], "digest": _digest(got),
            "tensor_lr": isinstance(opt.param_groups[0]["lr"], torch.Tensor)}


@pytest.mark.parametrize("wrapper,lr_tensor,n", [("plain", False, 2), ("ddp", True, 2), ("ddp_at_step", False, 3),
                                                 ("fsdp2", True, 2), ("fsdp1", False, 2)])
def test_groups_and_a_schedule_that_cycles_beta1_train_as_the_simulation(wrapper, lr_tensor, n):
    res = values(run_ranks("test_habits:schedule_loop", n, kwargs={"wrapper": wrapper, "lr_tensor": lr_tensor}))
    for r in res:
        assert all(r["same"]), r
        assert r["tensor_lr"] == lr_tensor, r
    assert len({r["digest"] for r in res}) == 1


# -- 8. experts that the ranks route to differently -------------------------------


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x, route):
        h = torch.tanh(self.inp(x))
        for e in route:
            h = h + torch.tanh(self.experts[e](h))
        return self.out(h)


def _experts():
    torch.manual_seed(0)
    return _Experts()


def _route(rank, step):
    """Expert 2: never used. Expert 0: rank 0 only. Expert 1: the other ranks, and rank 0 on odd steps."""
    return ([0] if step % 2 == 0 else [0, 1]) if rank == 0 else [1]


def _experts_loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 2, (5,), generator=g)
    return torch.nn.functional.cross_entropy(model(x, _route(rank, step)), y)


def simulate_experts(n, steps):
    """Distributed Lion on n simulated ranks, a parameter a rank did not use
    taking gradient 0 there (what DDP leaves in its bucket), one no rank used
    not stepped (DDP leaves it no gradient)."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    cb1, comb1, cb2, comb2, clr, cdecay = (_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd))
    model = _experts()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    momenta = [{name: torch.zeros_like(p) for name, p in model.named_parameters()} for _ in range(n)]
    for step in range(steps):
        directions, used = [], set()
        for r, rep in enumerate(replicas):
            for p, q in zip(rep.parameters(), model.parameters()):
                p.data.copy_(q.data)
                p.grad = None
            _experts_loss(rep, r, step).backward()
            dirs = {}
            for name, p in rep.named_parameters():
                used |= {name} if p.grad is not None else set()
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                m = momenta[r][name]
                dirs[name] = torch.sign(torch.add(torch.mul(m, cb1), torch.mul(g, comb1)))
                momenta[r][name] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
            directions.append(dirs)
        for name, p in model.named_parameters():
            if name in used:
                total = sum((d[name] for d in directions), torch.zeros_like(p))
                p.data.copy_(torch.sub(torch.mul(p.data, cdecay), torch.mul(torch.sign(total), clr)))
    return [p.detach().clone() for p in model.parameters()]


def experts_loop(rank, n, overlap, steps=5):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    model = _experts()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.0005)  # several buckets
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp, overlap=overlap)
    for step in range(steps):
        opt.zero_grad()
        _experts_loss(ddp, rank, step).backward()
        opt.step()
    want = simulate_experts(n, steps)
    return {"same": {name: bool(torch.equal(p.detach(), w)) for (name, p), w in zip(model.named_parameters(), want)},
            "never_used": bool(torch.equal(model.experts[2].weight.detach(), _experts().experts[2].weight)),
            "digest": _digest(model.parameters())}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_step"])
def test_experts_routed_differently_per_rank_train_as_the_simulation(overlap, n):
    res = values(run_ranks("test_habits:experts_loop", n, kwargs={"overlap": overlap}))
    for r in res:
        assert all(r["same"].values()) and r["never_used"], r
    assert len({r["digest"] for r in res}) == 1
