"""Bad and odd input to lionbit.all_reduce_sign: every row of
docs/bad-input.md is a case here (or names the test elsewhere that covers it).

Most cases run inside one 3-rank job (``all_cases``; one launch keeps this
file cheap), each reported as its own pytest test ``test_case[<name>]``. After
every case that raises, a good call checks that the group is still usable.
"""

import os
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

WORLD = 3


def _raises(fn, pattern, exc=Exception, ranks=None):
    """fn() raises exc with a message matching pattern (and, with ``ranks``,
    the typed outcome's .ranks equal to it)."""
    try:
        fn()
    except exc as err:  # noqa: PERF203
        msg = f"{type(err).__name__}: {err}"
        assert re.search(pattern, msg), f"error {msg!r} does not match {pattern!r}"
        if ranks is not None:
            assert err.ranks == ranks, (type(err), err.ranks, ranks)
        return msg
    raise AssertionError(f"no error raised; expected {pattern!r}")


def _reference(x, op, n, group=None):
    """sum/vote/avg of torch.sign over the ranks, from an all_gather in float64."""
    parts = [torch.empty(x.shape, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(parts, torch.sign(x.to(torch.float64)).contiguous(), group=group)
    s = torch.stack(parts).sum(0)
    if op == "vote":
        s = torch.sign(s)
    elif op == "avg":
        s = s / n
    return s.to(x.dtype)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (a, b)


def _reduce_and_check(x, op="vote", group=None):
    n = dist.get_world_size(group)
    want = _reference(x, op, n, group)
    import lionbit

    lionbit.all_reduce_sign(x, op, group=group)
    _same(x, want)


def _group_still_works(rank, n):
    import lionbit

    x = torch.full((100,), 1.0 if rank == 0 else -1.0)
    lionbit.all_reduce_sign(x, "sum")
    assert torch.equal(x, torch.full((100,), float(2 - n)))


def _me(rank, op="vote"):
    return rf"lionbit all_reduce_sign\(op={op}\) on rank {rank}: "


# --- the cases: name -> function(rank, n) -----------------------------------

def case_dtype_int32(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(5, dtype=torch.int32)),
            r"ValueError: " + _me(rank) + r"argument 'tensor' has dtype Int; supported: float32, float16, bfloat16, "
            r"float64, int8")


def case_dtype_uint8(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(5, dtype=torch.uint8), "sum"),
            r"ValueError: " + _me(rank, "sum") + r"argument 'tensor' has dtype Byte")


def case_dtype_bool(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(5, dtype=torch.bool)), r"ValueError: .*dtype Bool")


def case_dtype_unsupported_on_one_rank(rank, n):
    import lionbit

    x = torch.ones(5, dtype=torch.complex64 if rank == 1 else torch.float32)
    start = time.monotonic()
    if rank == 1:
        _raises(lambda: lionbit.all_reduce_sign(x), _me(rank) + r"argument 'tensor' has dtype ComplexFloat", ValueError)
    else:  # the typed outcome, naming the rank that rejected
        _raises(lambda: lionbit.all_reduce_sign(x), _me(rank) + r"rank\(s\) \[1\] rejected their input",
                lionbit.PeerRejected, [1])
    assert time.monotonic() - start < 10  # at once, not at the timeout


def case_device_meta(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.empty(4, device="meta")),
            r"ValueError: " + _me(rank) + r"argument 'tensor' is on meta")
    if torch.cuda.is_available():
        _raises(lambda: lionbit.all_reduce_sign(torch.ones(3, device="cuda")),
                r"is on cuda:0; this build of lionbit runs")


def case_device_differs_across_ranks(rank, n):
    import lionbit

    x = torch.empty(4, device="meta") if rank == 0 else torch.ones(4)
    pattern = r"argument .tensor. is on meta" if rank == 0 else r"rank\(s\) \[0\] rejected their input"
    _raises(lambda: lionbit.all_reduce_sign(x), _me(rank) + pattern)


def case_layout_sparse(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.eye(3).to_sparse()), r"ValueError: .*layout Sparse.*only dense")


def case_size_differs_across_ranks(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(100 + rank)),
            _me(rank)
            + r"number of elements differs across ranks: rank %d has %d, rank \d has \d+" % (rank, 100 + rank))


def case_shape_differs_same_numel(rank, n):
    # Only the number of elements must agree; each rank gets the result in its own shape.
    shape = [(12,), (3, 4), (2, 2, 3)][rank % 3]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
    flat = x.reshape(-1).clone()
    import lionbit

    want = _reference(flat, "sum", n)
    lionbit.all_reduce_sign(x, "sum")
    _same(x.reshape(-1), want)


def case_dtype_differs_across_ranks(rank, n):
    import lionbit

    x = torch.ones(50, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    _raises(lambda: lionbit.all_reduce_sign(x), _me(rank) + r"dtype differs across ranks")


def case_op_differs_across_ranks(rank, n):
    import lionbit

    op = "vote" if rank == 0 else "sum"
    _raises(lambda: lionbit.all_reduce_sign(torch.ones(50), op), _me(rank, op) + r"op differs across ranks")


def case_op_unknown(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(3), "max"),
            r"ValueError: .*argument 'op' is 'max'; expected 'vote', 'avg' or 'sum'")


def case_op_not_a_string(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(3), 1),
            r"TypeError: lionbit.all_reduce_sign: argument 'op' must be a str")


def case_not_a_tensor(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign([1.0, 2.0]),
            r"TypeError: lionbit.all_reduce_sign: argument 'tensor' must be a torch.Tensor")


def case_nan_on_one_rank(rank, n):
    import lionbit

    x = torch.randn(1000)
    if rank == 1:
        x[17] = float("nan")
    before = x.clone()
    _raises(lambda: lionbit.all_reduce_sign(x), _me(rank) + r"input contains NaN on rank\(s\) \[1\]",
            lionbit.NonFiniteInput, [1])  # the typed outcome, naming the NaN rank
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)  # nothing written


def _packed(rank, numel, seed=0):
    """This rank's clean directions packed as DistributedLion packs them: (sign, zero)."""
    from lionbit import _C, lion_math

    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 10 + rank))
    sign, zero = (torch.zeros(lion_math.plane_bytes(numel), dtype=torch.uint8) for _ in range(2))
    assert _C.pack_signs_into(x, sign, zero, 0)[1] == 0
    return sign, zero


def case_nans_tally_on_one_rank(rank, n):
    """A packed call's non-finite count still in a tensor (what a GPU's pack
    kernels leave, read by the collective when it runs): counted as nans, so
    a count on one rank fails the call on every rank, naming it, with
    nothing written; a zero count changes nothing."""
    import lionbit
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    numel = 1000
    sign, zero = _packed(rank, numel)
    want = torch.empty(numel, dtype=torch.bfloat16)
    backend.all_reduce_sign_packed(sign, zero, numel, 0, want, "vote").wait()
    got = torch.full((numel,), 7.0, dtype=torch.bfloat16)
    tally = torch.tensor([0], dtype=torch.int64)
    backend.all_reduce_sign_packed(sign, zero, numel, 0, got, "vote", nans_tally=tally).wait()
    _same(got, want)
    out = torch.full((numel,), 7.0, dtype=torch.bfloat16)
    counts = torch.tensor([5, 2 if rank == 1 else 0], dtype=torch.int64)  # (zeros, non-finite)
    work = backend.all_reduce_sign_packed(sign, zero, numel, 0, out, "vote", nans_tally=counts[1:])
    _raises(work.wait, r"all_reduce_sign\(op=vote\) on rank %d: input contains NaN on rank\(s\) \[1\]" % rank,
            lionbit.NonFiniteInput, [1])
    _same(out, torch.full((numel,), 7.0, dtype=torch.bfloat16))
    shard = torch.full((numel,), 7.0, dtype=torch.bfloat16)
    planes = [torch.cat([_packed(rank, numel, seed=r + 1)[i] for r in range(n)]) for i in range(2)]
    work = backend.reduce_scatter_sign_packed(*planes, numel, 0, shard, "vote", nans_tally=counts[1:])
    _raises(work.wait, r"reduce_scatter_sign\(op=vote\) on rank %d: input contains NaN on rank\(s\) \[1\]" % rank,
            lionbit.NonFiniteInput, [1])


def case_nans_tally_not_a_count(rank, n):
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    sign, zero = _packed(rank, 100)
    out = torch.empty(100, dtype=torch.bfloat16)
    for tally, got in ((torch.zeros(2, dtype=torch.int64), "of 2 elements"),
                       (torch.zeros(1, dtype=torch.float32), "got Float on cpu"),
                       (torch.zeros(1, dtype=torch.int64, device="meta"), "meta")):
        msg = _raises(lambda t=tally: backend.all_reduce_sign_packed(sign, zero, 100, 0, out, "vote", nans_tally=t),
                      r"ValueError: lionbit all_reduce_sign\(op=vote\) on rank %d: argument 'nans_tally' must be a "
                      r"one-element int64 tensor on cpu, got" % rank, ValueError)
        assert got in msg, msg


def case_nan_async_bfloat16(rank, n):
    import lionbit

    y = torch.ones(64, dtype=torch.bfloat16)
    if rank == n - 1:
        y[3] = float("nan")
    work = lionbit.all_reduce_sign(y, "avg", async_op=True)
    _raises(work.wait, r"NaN on rank\(s\) \[%d\]" % (n - 1), lionbit.NonFiniteInput, [n - 1])
    fut = lionbit.all_reduce_sign(y, "avg", async_op=True).get_future()  # ... and through its Future
    _raises(fut.wait, r"NaN on rank\(s\) \[%d\]" % (n - 1), lionbit.NonFiniteInput, [n - 1])
    assert work.is_completed() and not work.is_success()


def case_inf(rank, n):
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.where(torch.rand(1000, generator=g) < 0.5, float("inf"), -float("inf")).to(dtype)
        x[::7] = torch.randn(x[::7].shape, generator=g).to(dtype)
        for op in ("vote", "avg", "sum"):
            _reduce_and_check(x.clone(), op)


def case_negative_zero(rank, n):
    x = torch.full((300,), -0.0)
    x[rank::3] = 1.0 if rank == 0 else 0.0
    _reduce_and_check(x.clone(), "vote")
    _reduce_and_check(torch.full((70,), -0.0), "sum")  # -0.0 has sign 0


def case_subnormal_and_tiny(rank, n):
    for dtype, tiny in ((torch.float32, 1e-45), (torch.float64, 5e-324), (torch.float16, 6e-8),
                        (torch.bfloat16, 1e-40)):
        x = torch.full((129,), tiny, dtype=dtype)
        assert (x != 0).all()
        x[rank::2] = -x[rank::2]
        _reduce_and_check(x, "sum")


def case_all_zero(rank, n):
    for op in ("vote", "avg", "sum"):
        _reduce_and_check(torch.zeros(1000), op)


def case_empty(rank, n):
    import lionbit

    for shape in ((0,), (0, 5), (3, 0, 2)):
        for op in ("vote", "avg", "sum"):
            x = torch.empty(shape)
            lionbit.all_reduce_sign(x, op)
            assert x.shape == shape


def case_scalar_0d(rank, n):
    for op in ("vote", "avg", "sum"):
        x = torch.tensor(float(rank) - 0.5)
        _reduce_and_check(x, op)
        assert x.dim() == 0


def case_fewer_elements_than_ranks(rank, n):
    for d in (1, n - 1):
        x = torch.randn(d, generator=torch.Generator().manual_seed(rank + 10 * d))
        for op in ("vote", "avg", "sum"):
            _reduce_and_check(x.clone(), op)


def case_odd_sizes(rank, n):
    g = torch.Generator().manual_seed(rank)
    for d in (63, 64, 65, 64 * n + 1, 4097, 100003):
        x = torch.randn(d, generator=g)
        x[torch.rand(d, generator=g) < 0.01] = 0
        _reduce_and_check(x, "vote")


def case_non_contiguous_transpose(rank, n):
    base = torch.randn(37, 53, generator=torch.Generator().manual_seed(rank))
    x = base.t()
    assert not x.is_contiguous()
    want = _reference(x, "avg", n)
    import lionbit

    lionbit.all_reduce_sign(x, "avg")
    _same(x, want)
    _same(base.t(), want)  # written through the view into the base


def case_non_contiguous_strided_slice(rank, n):
    base = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    keep = base.clone()
    x = base[1::3]
    want = _reference(x, "sum", n)
    import lionbit

    lionbit.all_reduce_sign(x, "sum")
    _same(base[1::3], want)
    _same(base[0::3], keep[0::3])  # elements outside the view are untouched
    _same(base[2::3], keep[2::3])


def case_overlap_expand(rank, n):
    import lionbit

    x = torch.zeros(1).expand(10)
    _raises(lambda: lionbit.all_reduce_sign(x),
            r"ValueError: " + _me(rank) + r"argument 'tensor' has elements that share memory")


def case_overlap_as_strided(rank, n):
    import lionbit

    x = torch.randn(10).as_strided((5, 4), (1, 1))  # sliding windows: neighbours alias
    _raises(lambda: lionbit.all_reduce_sign(x, "sum"), r"ValueError: " + _me(rank, "sum") + r".*share memory")
    y = torch.randn(20).as_strided((3, 3), (4, 2))  # element 4 is [0, 2] and [1, 0]
    _raises(lambda: lionbit.all_reduce_sign(y, "sum"), r"share memory")
    # Views that do not overlap but are not dense still work.
    base = torch.randn(200, generator=torch.Generator().manual_seed(rank))
    for z in (base[::3], base.view(10, 20)[:, ::4], base.as_strided((4, 5), (40, 3)), base.view(20, 10).t()[1::2]):
        _reduce_and_check(z, "sum")


def case_requires_grad_leaf(rank, n):
    # Like torch.distributed collectives: the data is replaced in place,
    # autograd does not track it; lionbit bumps the version counter so a
    # tensor saved for backward is caught instead of silently used.
    x = torch.randn(100, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    v0 = x._version
    with torch.no_grad():
        want = _reference(x.detach(), "vote", n)
    import lionbit

    lionbit.all_reduce_sign(x, "vote")
    assert x.requires_grad and x.grad is None
    _same(x.detach(), want)
    assert x._version > v0
    # A tensor saved for backward and then reduced: autograd raises.
    a = torch.randn(10).requires_grad_()
    b = a * 2
    c = (b * b).sum()  # saves b
    lionbit.all_reduce_sign(b, "vote")
    _raises(c.backward, r"modified by an inplace operation")


def case_more_than_2_pow_48_elements(rank, n):
    import lionbit

    x = torch.zeros(1).expand(1 << 49)  # no memory behind it: the size check comes first
    _raises(lambda: lionbit.all_reduce_sign(x),
            r"ValueError: " + _me(rank) + r"argument 'tensor' has 562949953421312 elements; at most 2\^48")


def case_int8_avg(rank, n):
    import lionbit

    _raises(lambda: lionbit.all_reduce_sign(torch.ones(3, dtype=torch.int8), "avg"), r"op 'avg' needs a floating dtype")


def case_int8_extremes(rank, n):
    x = torch.tensor([-128, 127, 0, -1, 1] * 20, dtype=torch.int8).roll(rank)
    for op in ("vote", "sum"):
        _reduce_and_check(x.clone(), op)
    import lionbit

    z = torch.zeros(10, dtype=torch.int8)  # an all-zero int8 sum is fine
    lionbit.all_reduce_sign(z, "sum")
    assert torch.equal(z, torch.zeros(10, dtype=torch.int8))


def case_low_precision_avg(rank, n):
    # avg = sum / N, rounded once to the tensor's dtype (1/3 is inexact in fp16/bf16).
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(999, generator=g).to(dtype)
        _reduce_and_check(x, "avg")


def case_threads_separate_groups(rank, n):
    # Two threads, each on its own lionbit group: calls pair up per group.
    import lionbit

    groups = [dist.new_group(backend="lionbit") for _ in range(2)]
    errors = []

    def worker(t):
        try:
            g = torch.Generator().manual_seed(rank * 10 + t)
            for i in range(20):
                x = torch.randn(1000 + t * 500 + i, generator=g)
                want = _reference(x, "sum", n, groups[t])
                lionbit.all_reduce_sign(x, "sum", group=groups[t])
                _same(x, want)
        except BaseException as err:  # noqa: BLE001
            errors.append(repr(err))

    # _reference uses the group's forwarded all_gather: same group, same thread, in order.
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for g in groups:
        dist.destroy_process_group(g)


def case_threads_racing_on_one_group(rank, n):
    # Two threads racing on the same group: calls are matched by per-group
    # call order, which racing threads may not keep alike across ranks. Every
    # call completes with the result of the call it was matched with (the
    # same size here, so a well-formed result) or a clean mismatch error;
    # nothing hangs or crashes.
    import lionbit

    outcomes = {"ok": 0, "mismatch": 0}
    errors = []
    lock = threading.Lock()

    def worker(t):
        try:
            for _ in range(25):
                x = torch.full((1000 * (t + 1),), 1.0)
                try:
                    lionbit.all_reduce_sign(x, "sum")
                    assert torch.equal(x, torch.full_like(x, float(n))), x[:4]
                    with lock:
                        outcomes["ok"] += 1
                except ValueError as err:
                    if "differs across ranks" not in str(err):
                        raise
                    with lock:
                        outcomes["mismatch"] += 1
        except BaseException as err:  # noqa: BLE001
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert outcomes["ok"] + outcomes["mismatch"] == 50
    dist.barrier()


def case_destroyed_group(rank, n):
    import lionbit

    g = dist.new_group(backend="lionbit")
    x = torch.ones(10)
    lionbit.all_reduce_sign(x, group=g)
    dist.destroy_process_group(g)
    _raises(lambda: lionbit.all_reduce_sign(torch.ones(10), group=g),
            _me(rank) + r"the backend was shut down before the call ran")


def case_group_of_another_backend(rank, n):
    import lionbit

    g = dist.new_group(backend="gloo")
    _raises(lambda: lionbit.all_reduce_sign(torch.ones(3), group=g),
            r"RuntimeError: lionbit.all_reduce_sign on rank \d: the group's backend .* is 'gloo', not lionbit")
    _raises(lambda: lionbit.stats(g), r"not lionbit")
    # Nothing above talks over g, so without this barrier a fast rank could
    # destroy g (closing its sockets) while a slow peer is still inside
    # new_group's Gloo connectFullMesh, which then fails with "Connection
    # closed by peer" (seen once in CI on 2 cores).
    dist.barrier(group=g)
    dist.destroy_process_group(g)


def case_rank_outside_the_group(rank, n):
    """new_group(ranks=[0, 1]) hands rank 2 GroupMember.NON_GROUP_MEMBER (an
    int): there the collectives do nothing and warn, as torch.distributed's
    do; the optimizer and stats refuse it by name. Ranks 0 and 1 vote."""
    import warnings

    import lionbit

    g = dist.new_group(ranks=[0, 1], backend="lionbit")
    x = torch.full((70,), 1.0 if rank == 0 else -1.0)
    if rank < 2:
        lionbit.all_reduce_sign(x, "sum", group=g)
        assert torch.equal(x, torch.zeros(70))
    else:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert lionbit.all_reduce_sign(x, "sum", group=g, async_op=True) is None
            assert lionbit.reduce_scatter_sign(torch.empty(3), torch.ones(6), group=g) is None
        assert torch.equal(x, torch.full((70,), -1.0)), "changed on a rank outside the group"
        texts = [str(w.message) for w in seen]
        assert len(texts) == 2 and all("on global rank 2, which is not in the given group" in t for t in texts), texts
        _raises(lambda: lionbit.DistributedLion([torch.nn.Parameter(torch.ones(3))], group=g),
                r"ValueError: lionbit.DistributedLion on rank 2: argument 'group': this rank is not in the group "
                r"\(new_group\(ranks=...\) returned GroupMember.NON_GROUP_MEMBER on it\)")
        _raises(lambda: lionbit.stats(g), r"ValueError: lionbit.stats on rank 2: argument 'group': this rank is not")
    _raises(lambda: lionbit.all_reduce_sign(x, group="dp"),
            r"TypeError: lionbit.all_reduce_sign on rank %d: argument 'group' must be a "
            r"torch.distributed.ProcessGroup or None, not str" % rank)
    dist.barrier()
    if rank < 2:
        dist.destroy_process_group(g)


def case_group_with_a_backend_per_device(rank, n):
    """A group made "cpu:gloo,cuda:lionbit" calls itself "custom"; the
    error names the CPU's backend, gloo."""
    import lionbit

    g = dist.new_group(backend="cpu:gloo,cuda:lionbit")
    _raises(lambda: lionbit.all_reduce_sign(torch.ones(3), group=g),
            r"RuntimeError: lionbit.all_reduce_sign on rank \d: the group's backend for device type 'cpu' is 'gloo', "
            r"not lionbit")
    dist.barrier(group=g)
    dist.destroy_process_group(g)


def case_wait_timeout(rank, n):
    import lionbit

    if rank == 1:
        time.sleep(1.5)  # late to the call
    w = lionbit.all_reduce_sign(torch.ones(10), "sum", async_op=True)
    if rank == 0:
        _raises(lambda: w.wait(timedelta(milliseconds=100)),
                r"lionbit all_reduce_sign on rank 0: Work.wait\(\) timed out after 100 ms")
    w.wait()  # the call itself completes once the peer arrives
    assert w.is_success()


def case_distributed_lion_nan_gradient(rank, n):
    import lionbit

    p = torch.nn.Parameter(torch.ones(50))
    opt = lionbit.DistributedLion([p], lr=0.1)
    p.grad = torch.ones(50)
    if rank == 2:
        p.grad[7] = float("nan")
    _raises(opt.step, r"DistributedLion.step on rank %d: non-finite gradient \(inf or NaN\) on rank\(s\) \[2\]" % rank)
    assert torch.equal(p.detach(), torch.ones(50))  # no update applied
    assert torch.equal(opt.state[p]["exp_avg"], torch.zeros(50))  # nor a momentum change


def case_distributed_lion_inside_zero_redundancy_optimizer(rank, n):
    """ZeroRedundancyOptimizer(optimizer_class=DistributedLion) would give
    each rank a part of the parameters to vote: refused where it is built, on
    every rank, naming what to use instead."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import lionbit

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    _raises(lambda: ZeroRedundancyOptimizer(model.parameters(), optimizer_class=lionbit.DistributedLion, lr=1e-3),
            r"TypeError: DistributedLion: ZeroRedundancyOptimizer gives each rank a different part of the "
            r"parameters.*FSDP2 or HSDP")
    lionbit.DistributedLion(model.parameters())  # built directly: fine


def case_distributed_lion_complex_parameter(rank, n):
    """A complex parameter (a Fourier layer's weights): refused where the
    optimizer is built (torch's casts to a real dtype would drop the
    imaginary part without a word), naming it; made complex afterwards:
    refused at the step, nothing changed."""
    import lionbit

    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    _raises(lambda: lionbit.DistributedLion([{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [w]}]),
            r"TypeError: DistributedLion \(parameter group 1\) on rank %d: parameter 0 \(shape \(4, 3\)\) has dtype "
            r"torch.complex64;.*torch.view_as_real" % rank)
    p = torch.nn.Parameter(torch.ones(6))
    opt = lionbit.DistributedLion([p], lr=0.1)
    p.data = torch.ones(6, dtype=torch.complex64)
    p.grad = torch.ones(6, dtype=torch.complex64)
    _raises(opt.step, r"TypeError: DistributedLion \(step\) on rank %d: parameter 0 .* torch.complex64" % rank)
    assert torch.equal(p.detach(), torch.ones(6, dtype=torch.complex64)) and not opt.state


def case_distributed_lion_momentum_of_another_size(rank, n):
    """A parameter replaced by one of another size after two steps (the
    second planned: lionbit.step_plan), its momentum left as it was:
    refused at the step on every rank, naming it, nothing changed; its
    momentum started again, it trains."""
    import lionbit

    a, b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(60))
    opt = lionbit.DistributedLion([a, b], lr=0.1)
    for _ in range(2):
        a.grad, b.grad = torch.ones(5), torch.ones(60)
        opt.step()
    b.data = torch.ones(96)  # a grown vocabulary
    a.grad, b.grad = torch.ones(5), torch.ones(96)
    before = [t.detach().clone() for t in (a, b, opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])]
    _raises(opt.step, r"ValueError: DistributedLion.step on rank %d: parameter 1 of parameter group 0 \(shape "
            r"\(96,\)\) has 96 elements, its momentum \('exp_avg'\) 60: .*opt.state\[p\] = \{\}" % rank)
    after = (a, b, opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "a refused step changed something"
    opt.state[b] = {}
    opt.step()
    assert torch.equal(b.detach(), torch.full((96,), 0.9)) and opt.state[b]["exp_avg"].numel() == 96


def case_distributed_lion_ddp_parameters_outside_the_optimizer(rank, n):
    """A DDP model whose trainable backbone is in no optimizer yet (added
    later with add_param_group): refused at attach, naming the parameters
    and both ways that work; a parameter group with lr=0 attaches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model = DDP(net)
    _raises(lambda: lionbit.DistributedLion(net[1].parameters()).attach(model),
            r"ValueError: DistributedLion.attach: the DDP model's parameters \['0.weight', '0.bias'\] are not in this "
            r"optimizer; .*Freeze them \(requires_grad_\(False\)\) before wrapping the model in DDP, or give them "
            r"to this optimizer \(to train them later: a parameter group of their own with lr=0 until then\)")
    opt = lionbit.DistributedLion([{"params": net[1].parameters()}, {"params": net[0].parameters(), "lr": 0.0}])
    opt.attach(model)
    before = net[0].weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert torch.equal(net[0].weight.detach(), before)
    opt.detach()


def case_distributed_lion_meta_parameters(rank, n):
    """Parameters still on the meta device (a model built there, not yet
    to_empty()-ed): a clear error naming the order that works."""
    import lionbit

    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    p.grad = torch.empty(4, device="meta")
    _raises(lionbit.DistributedLion([p]).step,
            r"RuntimeError: DistributedLion.step: parameters on meta are not supported \(CPU and CUDA are\) \(a model "
            r"built on the meta device: attach after to_empty\(\) and its initialisation\)")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def all_cases(rank, n):
    """Runs every case in order (the same on every rank); returns
    {name: "ok" | failure text}."""
    out = {}
    for name, fn in CASES.items():
        try:
            fn(rank, n)
            out[name] = "ok"
        except BaseException as err:  # noqa: BLE001
            import traceback

            out[name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"
        try:
            _group_still_works(rank, n)
        except BaseException as err:  # noqa: BLE001
            out[name] = f"group unusable after the case: {err}"
            break
    return out


@pytest.fixture(scope="module")
def case_results():
    return values(run_ranks("test_bad_input:all_cases", WORLD, timeout=400))


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(case_results, name):
    for rank, res in enumerate(case_results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name)}"


# --- cases needing their own process set-up ---------------------------------

def check_world_size_one(rank, n):
    """A group of one rank, where the collectives move nothing (no inner
    collective runs): the sign of the input, in one chunk and in several
    (zeros in some only, a non-contiguous view), the reduce-scatter, a NaN
    an error naming rank 0 with nothing written, and the group usable after."""
    import lionbit

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for op in ("vote", "avg", "sum"):
            if dtype == torch.int8 and op == "avg":
                continue
            x = (torch.randn(1000, generator=g) * 10).to(dtype)
            x[::5] = 0
            want = torch.sign(x.double()).to(dtype)
            lionbit.all_reduce_sign(x, op)
            _same(x, want)
    os.environ["LIONBIT_CHUNK_ELEMS"] = "256"  # (read at each call) 5000 elements in 20 chunks
    try:
        for op in ("vote", "avg"):
            x = torch.randn(5000, generator=g)
            x[3000:3100] = 0  # zeros in a later chunk only
            want = torch.sign(x)
            lionbit.all_reduce_sign(x, op)
            _same(x, want)
            y = torch.randn(100, 60, generator=g)
            view = y.t()  # non-contiguous
            want = torch.sign(view)
            lionbit.all_reduce_sign(view, op)
            _same(y.t(), want)
            x = torch.randn(5000, generator=g)
            x[4321] = float("nan")
            before = x.clone()
            _raises(lambda: lionbit.all_reduce_sign(x, op), _me(0, op) + r"input contains NaN on rank\(s\) \[0\]",
                    ranks=[0])
            torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)
    finally:
        del os.environ["LIONBIT_CHUNK_ELEMS"]
    x = torch.randn(777, generator=g)
    out = torch.empty(777)
    lionbit.reduce_scatter_sign(out, x)
    _same(out, torch.sign(x))
    _group_still_works(rank, n)
    return True


def check_nan_in_later_chunks(rank, n, chunk):
    """NaN in any of 5 pipelined chunks, the last included: an error on every
    rank, no tensor written (not even the chunks before it), and the group
    still usable; zeros that appear only in later chunks, and a chunk 0 with
    zeros where the others have none, are exact."""
    import lionbit

    d = 5 * chunk - 3
    for op in ("vote", "avg"):
        for where_ in (200, chunk + 5, 2 * chunk + 1, 3 * chunk + 2, d - 1):
            x = torch.randn(d, generator=torch.Generator().manual_seed(rank + where_))
            if rank == 1:
                x[where_] = float("nan")
            before = x.clone()
            _raises(lambda: lionbit.all_reduce_sign(x, op), _me(rank, op) + r"input contains NaN on rank\(s\) \[1\]")
            torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)
            _group_still_works(rank, n)
        for zeros in ((3 * chunk, 3 * chunk + 40), (0, 10), (chunk - 7, 2 * chunk + 9)):
            x = torch.randn(d, generator=torch.Generator().manual_seed(100 + rank))
            if rank != 0:
                x[zeros[0]:zeros[1]] = 0.0
            _reduce_and_check(x, op)
    return True


def test_nan_in_any_chunk_is_an_error_on_every_rank_with_nothing_written():
    chunk = 64 * WORLD * 4
    res = values(run_ranks("test_bad_input:check_nan_in_later_chunks", WORLD, kwargs={"chunk": chunk},
                           case_env={"LIONBIT_CHUNK_ELEMS": str(chunk)}))
    assert res == [True] * WORLD


def test_world_size_one():
    assert values(run_ranks("test_bad_input:check_world_size_one", 1)) == [True]


def test_world_size_one_through_the_inner_collectives():
    """The same with LIONBIT_ONE_RANK_COPY=0: the one-rank group's header
    round and data through the inner Gloo communicator, as a larger group's."""
    env = {"LIONBIT_ONE_RANK_COPY": "0"}
    assert values(run_ranks("test_bad_input:check_world_size_one", 1, env=env)) == [True]


def test_int8_sum_needs_world_size_at_most_127_and_garbage_from_peers_is_rejected():
    """A backend over torch's FakeProcessGroup (200 "ranks", no data moves,
    the received buffers hold whatever memory held): int8 sum is refused for
    N > 127, and every call on that transport fails cleanly in the header
    round - what peers "sent" is garbage - never a crash."""
    from torch._C._distributed_c10d import FakeProcessGroup

    import lionbit

    fake = FakeProcessGroup._create_internal(0, 200)
    b = lionbit._C.LionBitBackend(fake, fake, 0, 200, timedelta(seconds=5))
    _raises(lambda: b.all_reduce_sign(torch.ones(10, dtype=torch.int8), "sum"),
            r"ValueError: lionbit all_reduce_sign\(op=sum\) on rank 0: "
            r"op 'sum' on int8 needs a world size <= 127 \(it is 200\)")
    for dtype, op in ((torch.float32, "sum"), (torch.int8, "vote"), (torch.bfloat16, "avg")):
        _raises(lambda: b.all_reduce_sign(torch.ones(1000, dtype=dtype), op).wait(),
                r"lionbit all_reduce_sign\(op=%s\) on rank 0: rank \d+ sent a (corrupt|malformed) header" % op)
    b.shutdown()


def check_huge(rank, n):
    import lionbit

    d = (1 << 31) + 129
    x = torch.ones(d, dtype=torch.int8)
    x[rank::7] = -1  # rank r holds -1 at r, r + 7, ...
    x[5] = 0
    start = time.monotonic()
    lionbit.all_reduce_sign(x, "sum")
    secs = time.monotonic() - start
    # Every element checked, in blocks (an int64 index of 2^31 would not fit).
    table = torch.tensor([sum(-1 if j == r else 1 for r in range(n)) for j in range(7)], dtype=torch.int8)
    assert int(x[5]) == 0
    x[5] = table[5]
    m = d // 7 * 7
    step = 7 << 22
    for s in range(0, m, step):
        e = min(s + step, m)
        assert torch.equal(x[s:e].view(-1, 7), table.expand((e - s) // 7, 7)), s
    assert x[m:].tolist() == [int(table[i % 7]) for i in range(m, d)]
    import resource

    return {"seconds": secs, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@pytest.mark.skipif(os.environ.get("LIONBIT_HUGE") != "1",
                    reason="2^31+ elements need ~6 GiB of free memory (3.1 GiB per rank); run with LIONBIT_HUGE=1")
def test_more_than_2_pow_31_elements():
    res = values(run_ranks("test_bad_input:check_huge", 2, timeout=1200, pg_timeout=600))
    print(res)
