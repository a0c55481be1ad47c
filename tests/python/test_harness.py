"""The harness's own promises (harness.py) when a case goes wrong: a pooled
rank that dies fails its case at once, with its exit status and what a
sanitizer wrote about it, not at the deadline with empty output; a rank's
error reaches the failure's message even after an earlier case on the same
ranks redirected sys.stderr; a rank killed by SIGSEGV shows its Python stack;
a pool whose ranks hold too many process groups ends, so that their Gloo I/O
threads stop waking."""

import os
import sys
import time

import pytest
import torch.distributed as dist

import harness
from harness import RanksFailed, run_ranks, values


def die_with_a_report(rank, world_size, prefix):
    """Rank 1 dies as a rank that ASan stops does (its report in
    <prefix>.<pid>, exit status 1); its peers wait for it in a barrier."""
    if rank == 1:
        with open(f"{prefix}.{os.getpid()}", "w") as f:
            f.write("==1==ERROR: AddressSanitizer: heap-use-after-free (written by the test)\n")
        os._exit(1)
    dist.barrier()
    return rank


def test_a_pooled_rank_that_dies_fails_the_case_at_once_with_its_report(tmp_path, monkeypatch):
    prefix = str(tmp_path / "report")
    monkeypatch.setattr(harness, "_sanitizer_log_paths", lambda: [prefix])
    monkeypatch.setattr(harness, "DEAD_RANK_GRACE", 2.0)
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks("test_harness:die_with_a_report", 3, kwargs=dict(prefix=prefix), timeout=240,
                  pool="harness-dies")
    took = time.monotonic() - start
    msg = str(err.value)
    assert msg.startswith("test_harness:die_with_a_report on 3 ranks failed:"), msg[:300]  # not "hung past"
    assert took < 60, took  # the grace after the death (and the ranks' start), not the 240 s deadline
    assert "--- rank 1 (exit 1) ---" in msg, msg
    assert "AddressSanitizer: heap-use-after-free (written by the test)" in msg, msg
    assert msg.count("AddressSanitizer") == 1, msg  # only the rank it is about


def segfault_on_rank_1(rank, world_size):
    """Rank 1 dies of SIGSEGV (a read of address 0), as a fault in native
    code kills a rank; its peers wait for it in a barrier."""
    if rank == 1:
        import ctypes
        import faulthandler
        import signal

        # faulthandler hands the signal on to the handler it found; under make
        # test-sanitize-python that is ASan's, whose report of this intended
        # fault would fail the run. The default action ends the rank as a
        # process without a sanitizer ends.
        faulthandler.disable()
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        faulthandler.enable()
        ctypes.string_at(0)
    dist.barrier()
    return rank


def test_a_rank_that_segfaults_shows_its_python_stack():
    """faulthandler in every rank: the report says where it died, not only
    its exit status."""
    with pytest.raises(RanksFailed) as err:
        run_ranks("test_harness:segfault_on_rank_1", 2, timeout=240, pool="harness-segfault")
    msg = str(err.value)
    assert "Fatal Python error: Segmentation fault" in msg, msg
    assert "in segfault_on_rank_1" in msg, msg


def swallow_stderr(rank, world_size):
    import io

    sys.stderr = io.StringIO()  # a case that forgets to put it back
    return rank


def raise_on_rank_0(rank, world_size):
    if rank == 0:
        raise ValueError("the next case's error, on rank 0")
    return rank


def test_a_raised_error_shows_after_a_case_redirected_stderr():
    assert values(run_ranks("test_harness:swallow_stderr", 2, pool="harness-stderr")) == [0, 1]
    with pytest.raises(RanksFailed) as err:
        run_ranks("test_harness:raise_on_rank_0", 2, pool="harness-stderr", timeout=120)
    msg = str(err.value)
    assert "Traceback" in msg and "ValueError: the next case's error, on rank 0" in msg, msg
    assert "(it raised ValueError: the next case's error, on rank 0)" in msg, msg


def make_groups(rank, world_size, count):
    """``count`` new groups over every rank (a case's meshes); this rank's pid."""
    for _ in range(count):
        dist.new_group(list(range(world_size)), backend="lionbit")
    return os.getpid()


def test_a_pool_past_its_groups_makes_way_for_fresh_ranks(monkeypatch):
    monkeypatch.setattr(harness, "MAX_GROUPS_PER_POOL", 6)
    # (a variable of its own: a pool of its own, unnamed, as most tests' are)
    call = lambda count: values(run_ranks("test_harness:make_groups", 2, kwargs=dict(count=count),  # noqa: E731
                                          env={"HARNESS_TEST": "groups"}))
    first = call(2)  # the default group and 2 more: 3
    assert call(2) == first  # 5, still warm
    assert call(2) == first  # 7 > 6: this case ran on them, then the pool ended
    fresh = call(0)
    assert set(fresh).isdisjoint(first), (first, fresh)
    assert call(0) == fresh
