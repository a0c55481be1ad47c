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
