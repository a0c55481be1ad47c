"""Bad input gives a clear error naming lionbit, the op and the rank, on every
rank and in time - never a crash, a hang or garbage - and the group stays
usable afterwards."""

import re
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values


def _expect_error(fn, pattern, exc=Exception, ranks=None):
    """fn() raises exc with a message matching pattern (and, with ``ranks``,
    the typed outcome's .ranks equal to it)."""
    try:
        fn()
    except exc as err:  # noqa: PERF203
        msg = str(err)
        assert re.search(pattern, msg), f"error {msg!r} does not match {pattern!r}"
        if ranks is not None:
            assert err.ranks == ranks, (type(err), err.ranks, ranks)
        return msg
    raise AssertionError(f"no error raised; expected {pattern!r}")


def _good_call_still_works(rank, n):
    import lionbit

    x = torch.full((100,), 1.0 if rank == 0 else -1.0)
    lionbit.all_reduce_sign(x, "sum")
    assert torch.equal(x, torch.full((100,), float(2 - n)))


def check_bad_input(rank, n):
    import lionbit

    me = rf"lionbit all_reduce_sign\(op=(vote|avg|sum|max)\) on rank {rank}: "
    seen = {}

    # NaN on one rank: every rank raises, naming the NaN rank.
    x = torch.randn(1000)
    if rank == 1:
        x[17] = float("nan")
    seen["nan"] = _expect_error(lambda: lionbit.all_reduce_sign(x, "vote"),
                                me + r"input contains NaN on rank\(s\) \[1\]", lionbit.NonFiniteInput, [1])
    _good_call_still_works(rank, n)

    # ... also through the async path, on a bfloat16 tensor.
    y = torch.ones(64, dtype=torch.bfloat16)
    if rank == n - 1:
        y[3] = float("nan")
    work = lionbit.all_reduce_sign(y, "avg", async_op=True)
    _expect_error(work.wait, r"NaN on rank\(s\) \[%d\]" % (n - 1), lionbit.NonFiniteInput, [n - 1])
    fut = lionbit.all_reduce_sign(y, "avg", async_op=True).get_future()  # ... and through its Future
    _expect_error(fut.wait, r"NaN on rank\(s\) \[%d\]" % (n - 1), lionbit.NonFiniteInput, [n - 1])
    assert work.is_completed() and not work.is_success()
    _good_call_still_works(rank, n)

    # Sizes that differ across ranks.
    x = torch.ones(100 + rank)
    seen["size"] = _expect_error(lambda: lionbit.all_reduce_sign(x), me + r"number of elements differs across ranks")
    _good_call_still_works(rank, n)

    # dtypes that differ across ranks.
    x = torch.ones(50, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    seen["dtype"] = _expect_error(lambda: lionbit.all_reduce_sign(x), me + r"dtype differs across ranks")
    _good_call_still_works(rank, n)

    # ops that differ across ranks.
    x = torch.ones(50)
    seen["op"] = _expect_error(lambda: lionbit.all_reduce_sign(x, "vote" if rank == 0 else "sum"),
                               r"op differs across ranks")
    _good_call_still_works(rank, n)

    # An unsupported dtype on every rank: a local ValueError naming the argument.
    seen["int32"] = _expect_error(
        lambda: lionbit.all_reduce_sign(torch.ones(5, dtype=torch.int32)),
        me + r"argument 'tensor' has dtype Int; supported: float32, float16, bfloat16, float64, int8",
        ValueError,
    )
    _good_call_still_works(rank, n)

    # An unsupported dtype on rank 1 only: rank 1 raises locally, the others
    # learn it in the header round at once (not after the timeout).
    start = time.monotonic()
    x = torch.ones(5, dtype=torch.complex64 if rank == 1 else torch.float32)
    if rank == 1:
        _expect_error(lambda: lionbit.all_reduce_sign(x), me + r"argument 'tensor' has dtype ComplexFloat", ValueError)
    else:
        seen["peer_rejected"] = _expect_error(lambda: lionbit.all_reduce_sign(x),
                                              me + r"rank\(s\) \[1\] rejected their input", lionbit.PeerRejected, [1])
    assert time.monotonic() - start < 10
    _good_call_still_works(rank, n)

    # Other bad arguments, on every rank.
    cases = {
        "op_name": (lambda: lionbit.all_reduce_sign(torch.ones(3), "max"),
                    r"argument 'op' is 'max'; expected 'vote', 'avg' or 'sum'"),
        "int8_avg": (lambda: lionbit.all_reduce_sign(torch.ones(3, dtype=torch.int8), "avg"),
                     r"op 'avg' needs a floating dtype"),
        "overlap": (lambda: lionbit.all_reduce_sign(torch.zeros(1).expand(10)), r"share memory"),
        "meta": (lambda: lionbit.all_reduce_sign(torch.empty(4, device="meta")), r"argument 'tensor' is on meta"),
        "sparse": (lambda: lionbit.all_reduce_sign(torch.eye(3).to_sparse()), r"layout Sparse"),
        "bool": (lambda: lionbit.all_reduce_sign(torch.ones(3, dtype=torch.bool)), r"dtype Bool"),
    }
    for name, (fn, pattern) in cases.items():
        seen[name] = _expect_error(fn, pattern)
        _good_call_still_works(rank, n)
    _expect_error(lambda: lionbit.all_reduce_sign([1.0, 2.0]), r"argument 'tensor' must be a torch.Tensor", TypeError)
    if torch.cuda.is_available():
        seen["cuda"] = _expect_error(
            lambda: lionbit.all_reduce_sign(torch.ones(3, device="cuda")), r"is on cuda:0; this build of lionbit runs"
        )
    # int8 sum and an all-zero int8 tensor are fine.
    z = torch.zeros(10, dtype=torch.int8)
    lionbit.all_reduce_sign(z, "sum")
    assert torch.equal(z, torch.zeros(10, dtype=torch.int8))
    return sorted(seen)


def test_typed_outcomes_are_value_errors_that_pickle():
    import pickle

    import lionbit

    for cls in (lionbit.NonFiniteInput, lionbit.PeerRejected):
        err = cls("lionbit all_reduce_sign(op=vote) on rank 0: ...", [3, 1, 3])
        assert isinstance(err, ValueError) and err.ranks == [1, 3]
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.ranks == [1, 3] and str(back) == str(err)


def test_bad_input_gives_clear_errors_on_every_rank():
    results = values(run_ranks("test_errors:check_bad_input", 3, pg_timeout=60))
    assert len(results[0]) == 12 and len(results[1]) == 11  # rank 1 is the one that rejects


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


def check_peer_never_calls(rank, n):
    import lionbit

    if rank == 1:
        time.sleep(12)  # never joins the call; outlives the peer's timeout
        return "absent"
    start = time.monotonic()
    msg = _expect_error(lambda: lionbit.all_reduce_sign(torch.ones(10)),
                        r"lionbit all_reduce_sign\(op=vote\) on rank 0: the header round")
    elapsed = time.monotonic() - start
    return {"elapsed": elapsed, "message": msg[:300]}


def test_a_missing_peer_gives_an_error_within_the_timeout():
    res = values(run_ranks("test_errors:check_peer_never_calls", 2, pg_timeout=4))
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
