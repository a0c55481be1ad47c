"""The vote into planes (all_reduce_sign_packed(..., out_planes=True), and
FSDP's reduce_scatter_sign_packed(..., out_planes=True)): the
same Delta as the vote into values, bit for bit, in every phase-2 format
(sign planes with and without a tie round, ties inline in base 3, the
two-rank exchange and its two-phase twin), every tie rule, many chunks; and
lion_apply_planes, the DDP hook's apply of it, equal to the apply of the
values. Bad requests fail naming the argument."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values

CHUNKS = {"LIONBIT_CHUNK_ELEMS": "4096"}


def _directions(rank, numel, kind, seed):
    """What a rank votes: independent signs (dense ties at even N), shared
    ones (no ties), or independent with zeros in runs and scattered."""
    g = torch.Generator().manual_seed(seed * 1000 + (0 if kind == "shared" else rank))
    x = torch.randn(numel, generator=g)
    if kind == "zeros":
        x[numel // 5 : numel // 3] = 0  # a run (a frozen row)
        x[torch.rand(numel, generator=g) < 0.05] = 0  # scattered
    return x


def _planes_and_values(backend, x, tie_break, seed):
    """The vote of x's signs into planes and into values (the same seed):
    (VotedPlanes, bf16 values)."""
    from lionbit import _C, lion_math

    n = x.numel()
    nb = lion_math.plane_bytes(n)
    sign, zero = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)
    nans = _C.pack_signs_into(x, sign, zero, 0)[1]
    out = torch.full((2 * nb,), 0xA5, dtype=torch.uint8)  # garbage: every bit is written
    backend.all_reduce_sign_packed(sign, zero, n, nans, out, "vote", tie_break, seed, "flat", True).wait()
    vals = torch.empty(n, dtype=torch.bfloat16)
    backend.all_reduce_sign_packed(sign, zero, n, nans, vals, "vote", tie_break, seed, "flat", False).wait()
    return lion_math.VotedPlanes(out[:nb], out[nb:], 0, n), vals


def planes_equal_values(rank, n):
    """Per case: whether the planes give the values bit for bit, never both
    bits set, and the stats of the call."""
    import lionbit
    from lionbit import lion_math
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    out = []
    numels = [1, 63, 4096 * n + 65, 40_003]
    # Dense ties twice in a row: the second call carries its ties inline (base 3).
    cases = [(d, kind, tie) for d in numels for kind in ("independent", "shared", "zeros")
             for tie in ("zero", "alternate", "random")] + [(40_003, "independent", "zero")] * 2
    for i, (d, kind, tie) in enumerate(cases):
        x = _directions(rank, d, kind, i)
        lionbit.reset_stats()
        planes, vals = _planes_and_values(backend, x, tie, 7 + i)
        s = lionbit.stats()
        both = lion_math.VotedPlanes(planes.sign, planes.zero, 0, d)
        sb = (both.sign.view(torch.int64) & both.zero.view(torch.int64))
        last_bits = d % 64
        if last_bits:  # bits past numel are unspecified
            sb[-1] &= (1 << last_bits) - 1
        # Offsets: the same planes read from a bit inside them.
        off = d // 3
        part = lion_math.VotedPlanes(planes.sign, planes.zero, off, d - off).values()
        out.append({"case": [d, kind, tie], "equal": bool(torch.equal(planes.values(), vals)),
                    "part": bool(torch.equal(part, vals[off:])), "both": int(sb.count_nonzero()),
                    "inline": s["inline_tie_chunks"], "tie_rounds": s["tie_rounds"]})
    return out


def scattered_planes_equal_values(rank, n):
    """The reduce-scatter (FSDP's vote) into planes and into values, per
    case: whether this rank's shard is the same, and no element with both
    bits set."""
    from lionbit import _C, lion_math
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    out = []
    cases = [(s, kind, tie) for s in (1, 63, 64, 2049) for kind in ("independent", "shared", "zeros")
             for tie in ("zero", "alternate", "random")]
    for i, (s, kind, tie) in enumerate(cases):
        x = _directions(rank, n * s, kind, 100 + i)
        nb = lion_math.plane_bytes(lion_math.shard_bit(n, s))
        sign, zero = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)
        nans = 0
        for r in range(n):
            nans += _C.pack_signs_into(x[r * s : (r + 1) * s], sign, zero, lion_math.shard_bit(r, s))[1]
        sb = lion_math.plane_bytes(s)
        planes = torch.full((2 * sb,), 0xA5, dtype=torch.uint8)  # garbage: every bit is written
        backend.reduce_scatter_sign_packed(sign, zero, s, nans, planes, "vote", tie, 3 + i, "flat",
                                           out_planes=True).wait()
        vals = torch.empty(s, dtype=torch.bfloat16)
        backend.reduce_scatter_sign_packed(sign, zero, s, nans, vals, "vote", tie, 3 + i, "flat").wait()
        got = lion_math.VotedPlanes(planes[:sb], planes[sb:], 0, s)
        both = planes[:sb].view(torch.int64) & planes[sb:].view(torch.int64)
        if s % 64:  # bits past the shard are unspecified
            both[-1] &= (1 << (s % 64)) - 1
        part = lion_math.VotedPlanes(planes[:sb], planes[sb:], s // 3, s - s // 3).values()
        out.append({"case": [s, kind, tie], "equal": bool(torch.equal(got.values(), vals)),
                    "part": bool(torch.equal(part, vals[s // 3 :])), "both": int(both.count_nonzero())})
    return out


def every_vote_into_planes(rank, n):
    """Both collectives into planes, in one launch: the all-reduce's cases and the reduce-scatter's."""
    return {"all_reduce": planes_equal_values(rank, n), "reduce_scatter": scattered_planes_equal_values(rank, n)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_planes_are_the_values_bit_for_bit(world_size):
    """The all-reduce (every phase-2 format) and FSDP's reduce-scatter into planes."""
    res = values(run_ranks("test_vote_planes:every_vote_into_planes", world_size, case_env=CHUNKS, timeout=400))
    for r in res:
        assert len(r["reduce_scatter"]) == 36
        for c in r["all_reduce"] + r["reduce_scatter"]:
            assert c["equal"] and c["part"] and c["both"] == 0, c
    ranks = res[-1]["all_reduce"]
    if world_size == 4:
        # The formats were all seen: a tie round, and ties inline in base 3 after dense ties.
        assert any(c["tie_rounds"] for c in ranks) and any(c["inline"] for c in ranks), ranks


def test_planes_in_the_two_phases_of_two_ranks():
    # LIONBIT_SIGN_EXCHANGE=0: two ranks vote in two phases (phase 2's all-gather), not the exchange.
    for ranks in values(run_ranks("test_vote_planes:planes_equal_values", 2, env={"LIONBIT_SIGN_EXCHANGE": "0"},
                                  case_env=CHUNKS, timeout=400)):
        for c in ranks:
            assert c["equal"] and c["part"] and c["both"] == 0, c


def apply_planes_equals_values(rank, n):
    """lion_apply_planes against lion_apply of the values and against the
    torch formula, every parameter dtype, at bit offsets inside the planes."""
    from lionbit import _C, lion_math
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    x = _directions(rank, 10_000, "zeros", 3)
    planes, vals = _planes_and_values(backend, x, "alternate", 11)
    lr, decay = 0.01, 1 - 0.01 * 0.1
    ok = []
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for off, k in ((0, 10_000), (1, 999), (63, 4000), (64, 5000), (4097, 5903)):
            p = torch.randn(k, generator=g).to(dtype)
            want = p.clone()
            _C.lion_apply(want, vals[off : off + k], lr, decay)
            got = p.clone()
            _C.lion_apply_planes(got, planes.sign, planes.zero, off, lr, decay)
            # The torch path (LIONBIT_KERNELS=aten, dtypes the fused kernels do not take).
            torch_path = p.clone()
            lion_math.apply_update(torch_path, lion_math.VotedPlanes(planes.sign, planes.zero, off, k),
                                   lion_math.Coefs({"betas": (0.9, 0.99), "lr": lr, "weight_decay": 0.1}), False)
            ok.append(bool(torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       want.view(torch.int16 if dtype != torch.float32 else torch.int32)))
                      and bool(torch.equal(torch_path, want)))
    return ok


def test_apply_planes_equals_the_apply_of_the_values():
    for ok in values(run_ranks("test_vote_planes:apply_planes_equals_values", 3)):
        assert ok and all(ok), ok


def bad_planes_requests(rank, n):
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    sign, zero = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    out = torch.zeros(32, dtype=torch.uint8)
    errors = []
    # Views that start off an 8-byte boundary: the kernels read planes as 64-bit words.
    odd_sign, odd_out = torch.zeros(24, dtype=torch.uint8)[1:17], torch.zeros(40, dtype=torch.uint8)[4:36]
    for args in ((sign, zero, 100, 0, out, "avg"), (sign, zero, 100, 0, out[:24], "vote"),
                 (sign, zero, 100, 0, torch.zeros(32, dtype=torch.int8), "vote"),
                 (odd_sign, zero, 100, 0, out, "vote"), (sign, zero, 100, 0, odd_out, "vote")):
        try:
            backend.all_reduce_sign_packed(*args, "zero", -1, "flat", True).wait()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    # A reduce-scatter's planes hold this rank's shard: 64 elements a shard, 16 bytes.
    shards = torch.zeros(8 * n, dtype=torch.uint8)
    for args in ((shards, shards.clone(), 64, 0, torch.zeros(32, dtype=torch.uint8), "vote"),
                 (shards, shards.clone(), 64, 0, torch.zeros(16, dtype=torch.uint8), "sum")):
        try:
            backend.reduce_scatter_sign_packed(*args, "zero", -1, "flat", out_planes=True).wait()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    dist.barrier()
    return errors


def test_bad_planes_requests_name_the_argument():
    for errors in values(run_ranks("test_vote_planes:bad_planes_requests", 2)):
        avg, small, dtype, odd_sign, odd_out, scatter_size, scatter_sum = errors
        assert "argument 'sign' must be a contiguous uint8 tensor" in odd_sign, odd_sign
        assert "starting off an 8-byte boundary" in odd_sign and "on rank" in odd_sign, odd_sign
        assert "argument 'out' (out_planes)" in odd_out and "starting off an 8-byte boundary" in odd_out, odd_out
        assert "argument 'out_planes' takes op 'vote'" in avg and "'avg'" in avg, avg
        assert "uint8 tensor of exactly 16 bytes" in scatter_size and "of 32 bytes" in scatter_size, scatter_size
        assert "argument 'out_planes' takes op 'vote'" in scatter_sum and "'sum'" in scatter_sum, scatter_sum
        assert "argument 'out' (out_planes) must be a contiguous uint8 tensor of exactly 32 bytes" in small, small
        assert "got 24 bytes" in small or "of 24 bytes" in small, small
        assert "argument 'out' (out_planes)" in dtype and "on rank" in dtype, dtype


def planes_held_by_training_loops(rank, n):
    """Three steps of each loop a user writes; the dtype of what each path
    holds between the vote and the update: DDP with overlap (the hook's
    votes), DDP after clip_grad_norm_ (votes at step()), a plain module."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    held = {}
    for loop in ("ddp", "ddp_clip", "plain"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        net = DDP(model, bucket_cap_mb=0.005) if loop != "plain" else model
        opt = lionbit.DistributedLion(model.parameters(), lr=1e-3)
        if loop != "plain":
            opt.attach(net)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(torch.randn(8, 32, generator=g)),
                                              torch.randint(0, 4, (8,), generator=g)).backward()
            if loop == "ddp_clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        att = opt.attachment
        outs = [bv.out for bv in att.buckets.values()] if loop == "ddp" else att.buffers.outs
        held[loop] = sorted({str(o.dtype) for o in outs})
    return held


def test_training_loops_hold_planes_between_vote_and_update():
    # The loops' results are checked against an independent simulation in
    # test_training_loops.py and test_optim.py; here, that they ran on planes.
    for held in values(run_ranks("test_vote_planes:planes_held_by_training_loops", 2)):
        assert held == {"ddp": ["torch.uint8"], "ddp_clip": ["torch.uint8"], "plain": ["torch.uint8"]}, held


def test_a_gpu_votes_into_planes_where_its_list_kernels_passed(monkeypatch):
    """On a GPU the apply from planes is a list kernel: votes come back as
    planes where the device's list kernels passed their first-use checks
    (with "custom" unchecked), as values where one failed or with "aten";
    the CPU always takes planes. Flat votes only, over a process group."""
    from lionbit import kernel_choice
    from lionbit.voter import Voter

    verdicts = {}
    monkeypatch.setattr(kernel_choice, "list_kernels_allowed", lambda device: verdicts[torch.device(device)])
    group = object()  # any process group
    vote = Voter("vote", None, "zero", None)
    for passed in (True, False):
        verdicts[torch.device("cuda:1")] = passed
        assert vote.votes_into_planes("cuda:1", group) is passed
        assert vote.votes_into_planes("cpu", group)
    verdicts[torch.device("cuda:1")] = True
    assert not vote.votes_into_planes("cuda:1", None)  # no group, no process group: this rank's own vote
    for other in (Voter("avg", None, "zero", None), Voter("l1", 2, "zero", None),
                  Voter("vote", None, "zero", None, hierarchy="node")):
        assert not other.votes_into_planes("cuda:1", group) and not other.votes_into_planes("cpu", group)
