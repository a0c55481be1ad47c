"""Errors outside the one 3-rank job of test_bad_input.py (where every bad
argument to all_reduce_sign is a case, its typed outcomes included): use
before init, a group of another backend, a peer that never calls, destroy
with work in flight, a half-built backend - a clear error naming lionbit, the
op and the rank, on every rank and in time, never a crash, a hang or
garbage."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values


def _expect_error(fn, pattern, exc=Exception):
    """fn() raises exc with a message matching pattern."""
    try:
        fn()
    except exc as err:  # noqa: PERF203
        msg = str(err)
        assert re.search(pattern, msg), f"error {msg!r} does not match {pattern!r}"
        return msg
    raise AssertionError(f"no error raised; expected {pattern!r}")


def test_typed_outcomes_are_value_errors_that_pickle():
    import pickle

    import lionbit

    for cls in (lionbit.NonFiniteInput, lionbit.PeerRejected):
        err = cls("lionbit all_reduce_sign(op=vote) on rank 0: ...", [3, 1, 3])
        assert isinstance(err, ValueError) and err.ranks == [1, 3]
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.ranks == [1, 3] and str(back) == str(err)


def check_not_initialized(rank, n):
    import lionbit

    _expect_error(lambda: lionbit.all_reduce_sign(torch.ones(3)), r"default process group is not initialized",
                  RuntimeError)
    _expect_error(lambda: lionbit.stats(), r"not initialized", RuntimeError)
    return True


def test_use_before_init():
    assert values(run_ranks("test_errors:check_not_initialized", 1, backend=None)) == [True]


def check_wrong_backend(rank, n):
    import lionbit

    _expect_error(lambda: lionbit.all_reduce_sign(torch.ones(3)),
                  r"backend for device type 'cpu' is 'gloo', not lionbit")
    return True


def test_group_of_another_backend():
    assert values(run_ranks("test_errors:check_wrong_backend", 2, backend="gloo")) == [True, True]


def check_peer_never_calls(rank, n, done):
    import lionbit

    if rank == 1:
        # Never joins the call: stays away until rank 0 has its error (a file
        # rank 0 writes then; 30 s at most, past the 4 s timeout and the
        # test's bound), so it outlives the peer's timeout however long that
        # takes, and no longer.
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "absent"
    start = time.monotonic()
    try:
        msg = _expect_error(lambda: lionbit.all_reduce_sign(torch.ones(10)),
                            r"lionbit all_reduce_sign\(op=vote\) on rank 0: the header round")
    finally:
        open(done, "w").close()
    elapsed = time.monotonic() - start
    return {"elapsed": elapsed, "message": msg[:300]}


def test_a_missing_peer_gives_an_error_within_the_timeout(tmp_path):
    res = values(run_ranks("test_errors:check_peer_never_calls", 2, pg_timeout=4,
                           kwargs={"done": str(tmp_path / "rank0-has-its-error")}))
    assert res[1] == "absent"
    assert 3 <= res[0]["elapsed"] <= 4 + 10, res[0]


def check_destroy_with_work_in_flight(rank, n):
    import lionbit

    works = [lionbit.all_reduce_sign(torch.randn(1 << 16), "vote", async_op=True) for _ in range(4)]
    works[0].wait()
    dist.destroy_process_group()  # others may still be queued or running
    for w in works[1:]:
        try:
            w.wait()
        except Exception as err:  # noqa: BLE001 - a clean error is fine too
            assert "lionbit" in str(err), err
    return True


@pytest.mark.parametrize("world_size", [2])
def test_destroy_with_work_in_flight(world_size):
    assert all(values(run_ranks("test_errors:check_destroy_with_work_in_flight", world_size)))


def test_backend_construction_error_leaves_no_dangling_worker_registration(tmp_path):
    """A LionBitBackend whose inner backends span the wrong ranks raises;
    stopping every backend's worker afterwards (what lionbit does at exit)
    must not touch the half-built one."""
    from datetime import timedelta

    import torch.distributed as dist

    from lionbit import _C

    store = dist.FileStore(str(tmp_path / "store"), 1)
    t = timedelta(seconds=10)
    fwd = dist.ProcessGroupGloo(dist.PrefixStore("f/", store), 0, 1, t)
    sign = dist.ProcessGroupGloo(dist.PrefixStore("s/", store), 0, 1, t)
    with pytest.raises(ValueError, match="inner backends span rank 0/1"):
        _C.LionBitBackend(fwd, sign, 0, 2, t)
    _C._shutdown_workers()
    ok = _C.LionBitBackend(fwd, sign, 0, 1, t)
    assert ok.cuda_transport in ("gloo", "nccl")
    _C._shutdown_workers()


def check_subgroup_errors_name_global_ranks(rank, n):
    """Rank 0 evaluates; ranks 1 and 2 train a DDP model over their own
    group (``new_group([1, 2])``, whose ranks 0 and 1 they are): every error
    names them as ``dist.get_rank()`` and torchrun's log prefixes do."""
    import warnings

    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.new_group([0, 1], pg_options=dist.ProcessGroupGloo._Options())  # every rank creates every group
    told = [str(w.message) for w in caught if "pg_options" in str(w.message)]
    assert told == (["lionbit: pg_options=_Options is not used: lionbit configures its inner Gloo and NCCL "
                     "communicators itself (the group's timeout reaches them all)"] if rank < 2 else []), told
    trainers = dist.new_group([1, 2])
    said = {}
    if rank == 0:  # the default group's own errors are unchanged: "on rank 0:", no group
        said["default"] = _expect_error(lambda: lionbit.all_reduce_sign(torch.ones(3), "nope"),
                                        r"^lionbit all_reduce_sign\(op=nope\) on rank 0: ")
        dist.barrier()
        return said
    here = rf"on rank {rank} \(group of ranks \[1, 2\]\)"
    x = torch.ones(8)
    if rank == 2:
        x[3] = float("nan")
    try:
        lionbit.all_reduce_sign(x, group=trainers)
    except lionbit.NonFiniteInput as err:
        assert err.ranks == [2], err.ranks
        assert re.search(rf"all_reduce_sign\(op=vote\) {here}: input contains NaN on rank\(s\) \[2\]", str(err)), err
    else:
        raise AssertionError("no NonFiniteInput")
    y = torch.ones(8 + (rank == 2))
    said["sizes"] = _expect_error(lambda: lionbit.all_reduce_sign(y, group=trainers),
                                  rf"{here}: number of elements differs across ranks: rank {rank} has {y.numel()}, "
                                  rf"rank {3 - rank} has {17 - y.numel()}")
    bad = torch.ones(4, dtype=torch.int64 if rank == 1 else torch.float32)
    try:
        lionbit.all_reduce_sign(bad, group=trainers)
    except (lionbit.PeerRejected, TypeError, ValueError) as err:
        if rank == 2:
            assert isinstance(err, lionbit.PeerRejected) and err.ranks == [1], (type(err), err)
            assert re.search(rf"{here}: rank\(s\) \[1\] rejected their input", str(err)), err
        else:
            assert re.search(rf"all_reduce_sign\(op=vote\) {here}: ", str(err)), err
    # A training script: DDP over the trainers' group, a NaN gradient on global rank 2.
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2), process_group=trainers)
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-3)
    opt.attach(model)
    inputs = torch.randn(5, 4)
    if rank == 2:
        inputs[0, 0] = float("inf")
    model(inputs).sum().backward()
    said["step"] = _expect_error(opt.step, rf"DistributedLion.step on rank {rank}: non-finite gradient \(inf or NaN\) "
                                           rf"on rank\(s\) \[2\]")
    dist.barrier()
    return said


def test_errors_on_a_subgroup_name_global_ranks():
    res = values(run_ranks("test_errors:check_subgroup_errors_name_global_ranks", 3))
    assert "default" in res[0] and all("step" in r for r in res[1:]), res


def test_a_large_groups_errors_list_some_of_its_ranks():
    """A backend over torch's FakeProcessGroup (200 "ranks"): its group of
    global ranks 1000, 1002, ... shows its first ranks, its last and its
    size; a bad 'global_ranks' is refused naming it."""
    from datetime import timedelta

    from torch._C._distributed_c10d import FakeProcessGroup

    import lionbit

    fake = FakeProcessGroup._create_internal(3, 200)
    ranks = list(range(1000, 1400, 2))
    b = lionbit._C.LionBitBackend(fake, fake, 3, 200, timedelta(seconds=5), global_ranks=ranks)
    _expect_error(lambda: b.all_reduce_sign(torch.ones(10, dtype=torch.int8), "sum"),
                  r"^lionbit all_reduce_sign\(op=sum\) on rank 1006 \(group of 200 ranks \[1000, 1002, 1004, 1006, "
                  r"1008, 1010, 1012, \.\.\., 1398\]\): op 'sum' on int8 needs a world size <= 127")
    b.shutdown()
    for bad, why in ((ranks[:-1], r"has 199 ranks for a group of 200"),
                     ([0] * 200, r"must hold distinct ranks >= 0; it has 0 at 1"),
                     ([-1] + ranks[1:], r"must hold distinct ranks >= 0; it has -1 at 0")):
        _expect_error(lambda bad=bad: lionbit._C.LionBitBackend(fake, fake, 3, 200, timedelta(seconds=5),
                                                                global_ranks=bad),
                      r"lionbit: argument 'global_ranks' " + why, ValueError)
    lionbit._C._shutdown_workers()
