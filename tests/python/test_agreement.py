"""A vote's agreement (lionbit._C.Agreement, backend/agreement.hpp): once
every rank's header round has agreed to a flat all-reduce of packed signs or
levels, DistributedLion updates its momenta while the vote's bits still
move. Checked here on real ranks: the agreement comes from the header round
(at_header), before the call ends where the call has data to move after it,
for every form of the call (two-phase, the two-rank exchange with its
second round, levels, one rank, the reduce-scatter of FSDP2's step); a NaN on one rank fails it on every rank
with the vote's own error; a peer's rejected input, and a call that never
ran (the backend shut down), fail it as they fail the call, so a waiter
never waits for a call that will not run; ranks that disagree on the call
fail it with the header round's error. The step's side: a non-finite
direction still changes nothing anywhere (test_optim, test_bad_input), and
the user's loops give the references' parameters (test_step_plan,
test_habits)."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values


def _packed(rank, n, nan_rank=None):
    from lionbit import _C, lion_math

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g)
    if rank == nan_rank:
        x[n // 2] = float("nan")
    nb = lion_math.plane_bytes(n)
    sign, zero = torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8)
    nans = _C.pack_signs_into(x, sign, zero, 0)[1]
    return sign, zero, nans, nb


def agreements(rank, world):
    """Per case: whether the agreement came from the header round, whether the
    call's result with an agreement equals the one without, and whether the
    agreement was settled while the call still ran (a large call whose data
    moves after its last header round)."""
    import time

    from lionbit import _C, lion_math
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    out = {}
    for n in (1, 4097, 32 << 20):
        sign, zero, nans, nb = _packed(rank, n)
        plain = torch.empty(2 * nb, dtype=torch.uint8)
        backend.all_reduce_sign_packed(sign, zero, n, nans, plain, "vote", "zero", 5, "flat", True).wait()
        ag = _C.Agreement()
        got = torch.empty(2 * nb, dtype=torch.uint8)
        work = backend.all_reduce_sign_packed(sign, zero, n, nans, got, "vote", "zero", 5, "flat", True, None, ag)
        ag.wait()
        agreed_at = time.perf_counter()
        running = not work.is_completed()
        work.wait()
        ended_at = time.perf_counter()
        same = torch.equal(lion_math.VotedPlanes(got[:nb], got[nb:], 0, n).values(),
                           lion_math.VotedPlanes(plain[:nb], plain[nb:], 0, n).values())
        out[f"vote {n}"] = {"at_header": ag.at_header, "same": same, "running": running,
                            "ms_after": (ended_at - agreed_at) * 1e3}
    # The reduce-scatter (FSDP2's vote at step()): its header round, before the shards move.
    for shard in (64, 24 << 20):
        sign, zero, nans, nb = _packed(rank, world * shard)
        plain = torch.empty(2 * (shard // 8), dtype=torch.uint8)
        backend.reduce_scatter_sign_packed(sign, zero, shard, nans, plain, "vote", "zero", 5, "flat", True).wait()
        ag = _C.Agreement()
        got = torch.empty(2 * (shard // 8), dtype=torch.uint8)
        work = backend.reduce_scatter_sign_packed(sign, zero, shard, nans, got, "vote", "zero", 5, "flat", True,
                                                  agreement=ag)
        ag.wait()
        agreed_at = time.perf_counter()
        running = not work.is_completed()
        work.wait()
        out[f"scatter {shard}"] = {"at_header": ag.at_header, "same": torch.equal(got, plain), "running": running,
                                   "ms_after": (time.perf_counter() - agreed_at) * 1e3}
    # Levels (Lion Cub's "l1"): the same Run, its header round.
    n, bits = 5000, 4
    nb = (n + 63) // 64 * 8
    planes = torch.randint(0, 256, (bits * nb,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    ag = _C.Agreement()
    backend.all_reduce_levels_packed(planes, bits, n, 0, torch.empty(n), "zero", -1, ag).wait()
    ag.wait()  # settled before the call completed
    out["levels"] = {"at_header": ag.at_header}
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_header_round_settles_the_agreement(world):
    env = {"LIONBIT_CHUNK_ELEMS": str(1 << 18)}  # the large call in chunks: the exchange's second round
    for ranks in values(run_ranks("test_agreement:agreements", world, case_env=env, timeout=300)):
        for case, r in ranks.items():
            assert r["at_header"], (world, case, r)
            if not case.startswith("levels"):
                assert r["same"], (world, case, r)
        # The large calls move data after their last round: settled while they still ran.
        assert ranks[f"vote {32 << 20}"]["running"], ranks
        if world > 1:
            assert ranks[f"scatter {24 << 20}"]["running"], ranks


def failures(rank, world):
    """Per case, the agreement's error on this rank ("ok" if none)."""
    import lionbit
    from lionbit import _C
    from lionbit._backend import backend_for

    backend = backend_for(None, torch.device("cpu"), "test")
    out = {}

    def outcome(ag, work):
        try:
            ag.wait()
            got = "ok"
        except lionbit.NonFiniteInput as err:
            got = f"NonFiniteInput {err.ranks}"
        except lionbit.PeerRejected as err:
            got = f"PeerRejected {err.ranks}"
        except (RuntimeError, ValueError) as err:
            got = f"{type(err).__name__}: {err}"
        try:
            work.wait()
            call = "ok"
        except Exception as err:  # noqa: BLE001 - compared with the agreement's
            call = type(err).__name__
        return {"agreement": got, "call": call}

    # A NaN on rank 1 (the exchange's second round at N = 2: chunks of 2^18).
    n = 1 << 20
    sign, zero, nans, nb = _packed(rank, n, nan_rank=1)
    ag = _C.Agreement()
    work = backend.all_reduce_sign_packed(sign, zero, n, nans, torch.empty(2 * nb, dtype=torch.uint8), "vote",
                                          "zero", -1, "flat", True, None, ag)
    out["nan"] = outcome(ag, work)
    # The ranks disagree on the call (its size): every rank's header round raises.
    sign, zero, nans, nb = _packed(rank, 1000)
    ag = _C.Agreement()
    work = backend.all_reduce_sign_packed(sign, zero, 999 if rank == 0 else 1000, nans,
                                          torch.empty(2 * nb, dtype=torch.uint8), "vote", "zero", -1, "flat", True,
                                          None, ag)
    out["mismatch"] = outcome(ag, work)
    # Rank 0 rejects its own input (its call raises at once); the others' agreements fail naming it.
    ag = _C.Agreement()
    try:
        work = backend.all_reduce_sign_packed(sign, zero, 1000, nans,
                                              torch.empty(7 if rank == 0 else 2 * nb, dtype=torch.uint8), "vote",
                                              "zero", -1, "flat", True, None, ag)
        out["rejected"] = outcome(ag, work)
    except ValueError:
        out["rejected"] = {"agreement": "not waited for", "call": "ValueError at once"}
    # A call on a backend shut down before it ran.
    g = dist.new_group(backend="lionbit")
    gb = g._get_backend(torch.device("cpu"))
    dist.destroy_process_group(g)
    ag = _C.Agreement()
    work = gb.all_reduce_sign_packed(sign, zero, 1000, nans, torch.empty(2 * nb, dtype=torch.uint8), "vote",
                                     "zero", -1, "flat", True, None, ag)
    out["shut down"] = outcome(ag, work)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_failed_call_fails_its_agreement_on_every_rank(world):
    env = {"LIONBIT_CHUNK_ELEMS": str(1 << 18)}
    for rank, r in enumerate(values(run_ranks("test_agreement:failures", world, case_env=env, fresh=True,
                                              timeout=300))):
        assert r["nan"] == {"agreement": "NonFiniteInput [1]", "call": "NonFiniteInput"}, (rank, r)
        assert r["mismatch"]["call"] == "ValueError", (rank, r)
        assert r["mismatch"]["agreement"].startswith("ValueError: ") and "differs across ranks" in r["mismatch"][
            "agreement"], (rank, r)
        if rank == 0:
            assert r["rejected"]["call"] == "ValueError at once", r
        else:
            assert r["rejected"] == {"agreement": "PeerRejected [0]", "call": "PeerRejected"}, (rank, r)
        assert "shut down before the call ran" in r["shut down"]["agreement"], (rank, r)
        assert r["shut down"]["call"] != "ok", (rank, r)
