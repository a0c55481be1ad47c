"""``DistributedLion(double_buffer=True)`` (lionbit.next_momenta): the pass
that packs a step's directions also writes every momentum's next value into
a second buffer, swapped in once every rank has agreed to the step.

As the user's scripts: DDP's loops (bare, clipping, which drops the votes
started in backward, a GradScaler that skips a step for an inf on one rank,
gradient accumulation under ``no_sync()``; votes in backward and at
``step()``) and uneven inputs under ``Join`` on 2 and 3 ranks, each equal
to Distributed Lion simulated in plain torch ops (the simulations of
test_training_loops and test_habits); the plain module's planned steps are
test_step_plan's, HSDP's test_hsdp's, run with ``double_buffer=True`` too;
FSDP2 on a 1-D mesh equal to DDP. Here also: the swap
keeps each momentum's tensor object while its storage alternates between
two buffers, a checkpoint holds the momentum alone and resumes bitwise, a
step that fails or is skipped leaves the momentum as it was (the second
buffer, written by the failed step, is not swapped in by the next one), the
refusals (l1, FSDP1) and the kernels' argument checks.
"""

import copy

import pytest
import torch

from harness import run_ranks, values

LOOPS = [("bare", True), ("bare", False), ("clip", True), ("grad_scaler", True), ("grad_scaler", False),
         ("accumulate", True)]


def ddp_loops(rank, n):
    """test_training_loops' DDP loops and test_habits' Join loop with
    ``double_buffer=True``; each asserts equality with its simulation."""
    import test_habits
    import test_training_loops

    out = {}
    for loop, overlap in LOOPS:
        res = test_training_loops.ddp_loop(rank, n, loop, overlap, double_buffer=True)
        out[f"{loop}/{overlap}"] = (res["digest"], res["fallbacks"], res["overlap_now"])
    for overlap in (True, False):
        res = test_habits.join_loop(rank, n, "bare", overlap, double_buffer=True)
        out[f"join/{overlap}"] = (res["digest"], 0, overlap)
    # The votes started in backward wrote the second buffers, which step() swapped in: two storages in turn.
    _, ddp, opt = test_habits._attached(True, double_buffer=True)
    ptrs = []
    for step in range(3):
        opt.zero_grad()
        test_training_loops._loss(ddp, rank, step, 0, "bare").backward()
        opt.step()
        ptrs.append([s["exp_avg"].data_ptr() for s in opt.state.values()])
    out["swapped"] = ptrs[0] == ptrs[2] and all(a != b for a, b in zip(ptrs[0], ptrs[1]))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_loops_with_a_second_momentum_buffer_equal_the_simulation(n):
    res = values(run_ranks("test_double_buffer:ddp_loops", n))
    assert all(r.pop("swapped") for r in res), "the DDP hook's passes did not write the second buffers"
    for key in res[0]:
        assert len({r[key][0] for r in res}) == 1, f"{key}: replicas differ"
        loop, overlap = key.split("/")
        if loop in ("clip", "grad_scaler") and overlap == "True":
            assert all(list(r[key][1:]) == [1, False] for r in res), (key, res)  # the votes of backward dropped once


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.nn.functional.cross_entropy(model(torch.randn(16, 8, generator=g)),
                                             torch.randint(0, 4, (16,), generator=g))


def buffers_and_checkpoints(rank, n):
    """A plain module trained with and without the second buffers: the same
    parameters and momenta every step; each momentum keeps its tensor object
    while its storage alternates; a checkpoint taken mid-run holds the
    momentum alone and a restart from it ends bitwise where the run does; a
    step with an inf on the last rank raises on every rank and the next
    step is exact (the second buffer the failed step wrote is not swapped
    in)."""
    import lionbit

    torch.set_num_threads(1)
    runs = {}
    for double in (False, True):
        model = _model()
        opt = lionbit.DistributedLion(model.parameters(), lr=0.01, weight_decay=0.1, double_buffer=double)
        history, ptrs, saved = [], [], None
        for step in range(8):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            if step == 5 and rank == n - 1:
                model[0].weight.grad[1, 2] = float("inf")
            ids = {id(s["exp_avg"]) for s in opt.state.values()}
            try:
                opt.step()
            except RuntimeError as err:
                assert step == 5 and "non-finite gradient" in str(err), err
                assert "no parameter or momentum changed on any rank" in str(err)
            if step > 0:
                assert {id(s["exp_avg"]) for s in opt.state.values()} == ids, "a momentum's tensor was replaced"
            ptrs.append([s["exp_avg"].data_ptr() for s in opt.state.values()])
            history.append([p.detach().clone() for p in model.parameters()]
                           + [s["exp_avg"].clone() for s in opt.state.values()])
            if step == 3:
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        runs[double] = history
        if double:
            # Steps 1-4 and 6-7 swapped (two storages in turn); step 5 failed (no swap).
            swapped = [ptrs[s] != ptrs[s - 1] for s in range(1, 8)]
            assert swapped == [True, True, True, True, False, True, True], swapped
            assert all(len(ptrs[s]) == len(set(ptrs[s])) for s in range(8))
            assert set(saved[1]["state"][0]) == {"exp_avg"}, saved[1]["state"][0].keys()
            # A restart from step 3's checkpoint (a fresh model and optimizer).
            model2 = _model()
            opt2 = lionbit.DistributedLion(model2.parameters(), lr=0.01, weight_decay=0.1, double_buffer=True)
            model2.load_state_dict(saved[0])
            opt2.load_state_dict(saved[1])
            for step in range(4, 8):
                opt2.zero_grad()
                _loss(model2, rank, step).backward()
                if step == 5 and rank == n - 1:
                    model2[0].weight.grad[1, 2] = float("inf")
                try:
                    opt2.step()
                except RuntimeError:
                    assert step == 5
            got = [p.detach() for p in model2.parameters()] + [s["exp_avg"] for s in opt2.state.values()]
            assert all(torch.equal(a, b) for a, b in zip(got, history[-1])), "the restart differs"
    for step, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: the second buffer changed the step"
    return True


def test_second_buffers_swap_storage_keep_tensors_and_checkpoint_bitwise():
    assert values(run_ranks("test_double_buffer:buffers_and_checkpoints", 2)) == [True, True]


def refusals(rank, n):
    """double_buffer=True where it cannot serve: "l1" and FSDP1."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import lionbit

    errors = []
    try:
        lionbit.DistributedLion(_model().parameters(), aggregation="l1", double_buffer=True)
    except ValueError as err:
        errors.append(str(err))
    fsdp1 = FSDP(_model(), device_id=torch.device("cpu"))
    try:
        lionbit.DistributedLion(fsdp1.parameters(), double_buffer=True).attach(fsdp1)
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_double_buffer_is_refused_where_it_cannot_serve():
    for errors in values(run_ranks("test_double_buffer:refusals", 2)):
        assert len(errors) == 2, errors
        assert "double_buffer=True" in errors[0] and "'l1'" in errors[0], errors[0]
        assert "FSDP1" in errors[1] and "double_buffer=False" in errors[1], errors[1]


def fsdp2_runs(rank, n, accumulate=1, aggregation="vote", list_kernels=True):
    """test_fsdp's FSDP2 run (nested units, 12 steps) with double_buffer=True
    against DDP with one buffer (test_fsdp checks DDP against the
    simulation), then a short run whose momenta must alternate between two
    storages: the step's spans (FSDP's chunks of each full-size momentum)
    tile every momentum, so the general path's first step and the plan's
    replays swap them in. Without the list kernels (``list_kernels=False``:
    where a GPU's first-use check failed) every step takes the general path,
    each span through the per-tensor kernel."""
    import lionbit
    import test_fsdp

    choice = lionbit.kernel_choice
    allowed = choice.list_kernels_allowed
    if not list_kernels:  # (the ranks' processes serve later tests too: restored below)
        choice.list_kernels_allowed = lambda device: False
    try:
        same = test_fsdp.fsdp_vs_ddp(rank, n, 12, accumulate, aggregation, double_buffer=True)["same"]
        return {"same": same, **_fsdp2_swaps(rank)}
    finally:
        choice.list_kernels_allowed = allowed


def _fsdp2_swaps(rank):
    import lionbit
    import test_fsdp

    model = test_fsdp._shard(test_fsdp._net(), True)
    opt = lionbit.DistributedLion(model.parameters(), double_buffer=True, **test_fsdp.LION).attach(model)
    ptrs = []
    for step in range(4):
        test_fsdp._loss(model, rank, step, 0).backward()
        opt.step()
        opt.zero_grad()
        ptrs.append([s["exp_avg"].data_ptr() for s in opt.state.values()])
    swapped = all(ptrs[s] == ptrs[s - 2] and all(map(int.__ne__, ptrs[s], ptrs[s - 1])) for s in (2, 3))
    return {"swapped": swapped, "replayed": opt.attachment.plan.replayed}


@pytest.mark.parametrize("n,accumulate,aggregation", [(2, 1, "vote"), (3, 2, "avg")])
def test_fsdp2_with_a_second_momentum_buffer_equals_ddp_bitwise(n, accumulate, aggregation):
    res = values(run_ranks("test_double_buffer:fsdp2_runs", n,
                           kwargs=dict(accumulate=accumulate, aggregation=aggregation)))
    for r in res:
        assert all(r["same"]) and r["swapped"] and r["replayed"] == 3, r


def test_fsdp2_with_a_second_momentum_buffer_without_the_list_kernels():
    for r in values(run_ranks("test_double_buffer:fsdp2_runs", 2, kwargs={"list_kernels": False})):
        assert all(r["same"]) and r["swapped"] and r["replayed"] == 0, r


def test_the_kernels_write_the_next_momentum_into_m_out_and_check_it():
    """The bindings' m_out / m_outs: the in-place update's bits, m only read;
    a wrong buffer is a ValueError naming the op and the argument."""
    from lionbit import _C

    torch.manual_seed(0)
    for gdt, mdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)):
        g, m = torch.randn(1000, dtype=gdt), torch.randn(1000).to(mdt)
        planes = [torch.zeros(2 * 128, dtype=torch.uint8) for _ in range(4)]
        want = m.clone()
        _C.lion_direction_into(g, want, 0.9, 0.1, 0.99, 0.01, planes[0], planes[1], 3)
        got, out = m.clone(), torch.full_like(m, 7.0)
        _C.lion_direction_into(g, got, 0.9, 0.1, 0.99, 0.01, planes[2], planes[3], 3, m_out=out)
        assert torch.equal(got, m) and torch.equal(out, want)
        assert torch.equal(planes[0], planes[2]) and torch.equal(planes[1], planes[3])
        outs = [torch.full_like(m, 7.0), torch.full_like(m, 7.0)]
        got = [m.clone(), m.clone()]
        _C.lion_direction_list([g, g], got, 0.9, 0.1, 0.99, 0.01, None, None, [0, 0], update_momentum=True,
                               starts=[0, 10], lengths=[1000, 90], m_outs=outs)
        assert all(torch.equal(t, m) for t in got) and torch.equal(outs[0], want)
        assert torch.equal(outs[1][10:100], want[10:100]) and bool((outs[1][:10] == 7).all())
    g, m = torch.randn(100), torch.randn(100)
    sign, zero = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    for kwargs, what in (({"m_out": m}, "m_out overlaps m"), ({"m_out": m[:50]}, r"m_out \(Float, 50 elements\)"),
                         ({"m_out": torch.empty(100, dtype=torch.bfloat16)}, "must have the dtype and size of m"),
                         ({"m_out": torch.empty(100), "update_momentum": False}, "needs update_momentum=True"),
                         ({"m_out": g}, "m_out overlaps the gradient")):
        with pytest.raises(ValueError, match=r"lionbit\.lion_direction_into: .*" + what):
            _C.lion_direction_into(g, m, 0.9, 0.1, 0.99, 0.01, sign, zero, 0, **kwargs)
    with pytest.raises(ValueError, match=r"lionbit\.lion_direction_list: m_outs\[1\] overlaps ms\[1\]"):
        m2 = m.clone()
        _C.lion_direction_list([g, g], [m, m2], 0.9, 0.1, 0.99, 0.01, None, None, [0, 0],
                               update_momentum=True, m_outs=[torch.empty(100), m2.view(10, 10)])
    before = m.clone()
    with pytest.raises(ValueError, match=r"m_outs\[1\]"):
        _C.lion_direction_list([g, g], [m, m.clone()], 0.9, 0.1, 0.99, 0.01, None, None, [0, 0],
                               update_momentum=True, m_outs=[torch.empty(100), torch.empty(3)])
    assert torch.equal(m, before), "a refused list call changed a momentum"


def test_the_storage_swap_keeps_each_tensor_and_checks_every_pair_first():
    from lionbit import _C

    ms, spares = [torch.zeros(3), torch.zeros(2, 2)], [torch.ones(3), torch.ones(2, 2)]
    objects = [id(t) for t in ms + spares]
    _C.swap_storages(ms, spares)
    assert [id(t) for t in ms + spares] == objects
    assert all(bool((m == 1).all()) for m in ms) and all(bool((s == 0).all()) for s in spares)
    assert ms[1].shape == (2, 2) and ms[1].is_contiguous()
    for bad, what in (([torch.ones(3), torch.ones(4)], "pair 1 differs"),
                      ([torch.ones(3), torch.ones(2, 2, dtype=torch.bfloat16)], "pair 1 differs"),
                      ([torch.ones(3), torch.ones(2, 2).t()], "pair 1 is not contiguous"),
                      ([torch.ones(3), ms[1]], "pair 1 share memory")):
        with pytest.raises(ValueError, match=r"lionbit\.swap_storages: .*" + what):
            _C.swap_storages(ms, bad)
        assert bool((ms[0] == 1).all()), "a refused swap swapped the first pair"
    with pytest.raises(ValueError, match="2 tensors and 1 buffers"):
        _C.swap_storages(ms, spares[:1])
