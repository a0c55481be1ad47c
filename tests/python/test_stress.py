"""Determinism and stress, quick versions (tools/stress.py runs the long ones
with the same rank functions):

- DistributedLion steps (plain module and DDP-attached): a hash of every
  parameter is compared across ranks; they must be bitwise identical.
- random collectives: sign all-reduce vote/avg/sum on random sizes, dtypes
  and zero densities, sync and async batches, interleaved with forwarded
  all_reduce / broadcast / all_gather; every result is checked against a
  reference from an all_gather of torch.sign in float64. Resident memory is
  sampled at the start, middle and end.
"""

import hashlib
import random

import torch
import torch.distributed as dist

from harness import run_ranks, values

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]


def _rss_mb(trim: bool = True) -> float:
    """VmRSS in MB. With `trim`, glibc first returns its free heap pages to
    the system, so the figure follows live memory rather than the arenas'
    caching (each thread - caller, lionbit worker, Gloo workers - has one)."""
    if trim:
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _params_hash(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes() if p.numel() else b"")
    return h.hexdigest()


def lion_steps(rank, n, steps=100, seed=0, check_every=25):
    """DistributedLion on three set-ups; returns, per set-up, how many hash
    checks found ranks disagreeing, and whether training moved the weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    out = {}
    for setup in ("plain-vote", "ddp-vote", "ddp-avg-bf16momentum"):
        torch.manual_seed(seed)  # same initial weights on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)
        )
        start = _params_hash(model.parameters())
        agg = "avg" if "avg" in setup else "vote"
        mdt = torch.bfloat16 if "bf16" in setup else None
        if setup.startswith("ddp"):
            net = DDP(model, bucket_cap_mb=0.01)  # several buckets
            opt = lionbit.DistributedLion(net.parameters(), lr=1e-3, weight_decay=0.1, aggregation=agg,
                                          momentum_dtype=mdt)
            opt.attach(net)
        else:
            net = model
            opt = lionbit.DistributedLion(net.parameters(), lr=1e-3, weight_decay=0.1, aggregation=agg,
                                          momentum_dtype=mdt)
        g = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own data
        w = torch.randn(32, 10, generator=torch.Generator().manual_seed(seed))
        mismatches, checks = 0, 0
        for step in range(1, steps + 1):
            x = torch.randn(16, 32, generator=g)
            y = (x @ w).argmax(1)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % check_every == 0 or step == steps:
                mine = _params_hash(model.parameters())
                hashes = [None] * n
                dist.all_gather_object(hashes, mine)
                checks += 1
                mismatches += len(set(hashes)) != 1
        out[setup] = {"mismatches": mismatches, "checks": checks, "moved": _params_hash(model.parameters()) != start,
                      "hash": _params_hash(model.parameters())[:16], "last_loss": float(loss)}
    return out


def _reference(x, op, n):
    parts = [torch.empty(x.shape, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(parts, torch.sign(x.to(torch.float64)).contiguous())
    s = torch.stack(parts).sum(0)
    if op == "vote":
        s = torch.sign(s)
    elif op == "avg":
        s = s / n
    return s.to(x.dtype)


def _sign_input(rng, g, rank, n):
    dtype = rng.choice(DTYPES)
    op = rng.choice(["vote", "sum"] if dtype == torch.int8 else ["vote", "avg", "sum"])
    r = rng.random()
    if r < 0.1:
        numel = rng.randint(0, 3 * n)  # empty and d < N
    elif r < 0.9:
        numel = int(10 ** rng.uniform(1, 5))
    else:
        numel = int(10 ** rng.uniform(5, 6.3))  # several pipelined chunks
    density = rng.choice([0.0, 0.0, 1e-4, 0.01, 0.3, 1.0])
    correlated = rng.random() < 0.3  # shared signs: ties and unanimity
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30)) if correlated else g
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    if density > 0 and numel:
        x[torch.rand(numel, generator=g) < density] = 0.0
    if numel and rng.random() < 0.1:
        x[torch.rand(numel, generator=g) < 0.01] = float("inf")
    if dtype == torch.int8:
        x = (x * 50).clamp(-128, 127)
    x = x.to(dtype)
    if rng.random() < 0.15 and numel >= 4:  # a non-contiguous view
        x = torch.stack([x, x.clone()], 1)[:, 0]
    return x, op


def random_collectives(rank, n, count=300, seed=0):
    """`count` random collectives checked against their references; returns
    mismatch counts, RSS samples and what ran."""
    import lionbit

    rng = random.Random(seed)  # the same sequence of calls on every rank
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    kinds = {"sign_sync": 0, "sign_async": 0, "all_reduce": 0, "broadcast": 0, "all_gather": 0}
    mismatches = []
    rss = {}
    samples = []  # (calls done, MB) at every tenth of the run
    done = 0
    while done < count:
        if done >= 20 and "start" not in rss:
            rss["start"] = _rss_mb()
            rss["start_untrimmed"] = _rss_mb(trim=False)
        if done >= count // 2 and "middle" not in rss:
            rss["middle"] = _rss_mb()
        if done >= len(samples) * count / 10:
            samples.append((done, round(_rss_mb(), 1)))
        r = rng.random()
        if r < 0.45:
            x, op = _sign_input(rng, g, rank, n)
            want = _reference(x, op, n)
            lionbit.all_reduce_sign(x, op)
            if not torch.equal(x, want):
                mismatches.append(("sign_sync", op, str(x.dtype), x.numel()))
            kinds["sign_sync"] += 1
            done += 1
        elif r < 0.7:
            batch = [_sign_input(rng, g, rank, n) for _ in range(rng.randint(2, 4))]
            wants = [_reference(x, op, n) for x, op in batch]
            works = [lionbit.all_reduce_sign(x, op, async_op=True) for x, op in batch]
            if rng.random() < 0.3:  # a forwarded collective while sign work is in flight
                t = torch.full((7,), float(rank + 1))
                dist.all_reduce(t)
                if not torch.equal(t, torch.full((7,), n * (n + 1) / 2)):
                    mismatches.append(("all_reduce_during_async",))
            order = list(range(len(works)))
            rng.shuffle(order)
            for i in order:
                works[i].wait()
            for (x, op), want in zip(batch, wants):
                if not torch.equal(x, want):
                    mismatches.append(("sign_async", op, str(x.dtype), x.numel()))
            kinds["sign_async"] += len(batch)
            done += len(batch)
        elif r < 0.8:
            numel = rng.randint(1, 50000)
            t = torch.arange(numel, dtype=torch.float64) * (rank + 1)
            dist.all_reduce(t)
            if not torch.equal(t, torch.arange(numel, dtype=torch.float64) * (n * (n + 1) / 2)):
                mismatches.append(("all_reduce", numel))
            kinds["all_reduce"] += 1
            done += 1
        elif r < 0.9:
            root = rng.randrange(n)
            numel = rng.randint(1, 50000)
            src = torch.randn(numel, generator=torch.Generator().manual_seed(done * 31 + root))
            t = src.clone() if rank == root else torch.zeros(numel)
            dist.broadcast(t, root)
            if not torch.equal(t, src):
                mismatches.append(("broadcast", numel))
            kinds["broadcast"] += 1
            done += 1
        else:
            numel = rng.randint(1, 20000)
            mk = lambda r_: torch.randn(numel, generator=torch.Generator().manual_seed(done * 17 + r_))  # noqa: E731
            parts = [torch.empty(numel) for _ in range(n)]
            dist.all_gather(parts, mk(rank))
            if not all(torch.equal(parts[r_], mk(r_)) for r_ in range(n)):
                mismatches.append(("all_gather", numel))
            kinds["all_gather"] += 1
            done += 1
    rss["end_untrimmed"] = _rss_mb(trim=False)
    rss["end"] = _rss_mb()
    rss["samples"] = samples
    st = lionbit.stats()
    return {"mismatches": mismatches[:20], "n_mismatches": len(mismatches), "kinds": kinds, "rss_mb": rss,
            "sign_calls": st["sign_allreduce_calls"]}


QUICK_ENV = {"LIONBIT_CHUNK_ELEMS": "100000"}  # many pipelined chunks on small tensors


def test_lion_steps_keep_replicas_bitwise_identical():
    res = values(run_ranks("test_stress:lion_steps", 3, kwargs={"steps": 100}, timeout=300))
    for setup, r in res[0].items():
        assert r["mismatches"] == 0 and r["checks"] == 4 and r["moved"], (setup, r)
    # ... and the same final hash everywhere
    assert all({k: v["hash"] for k, v in r.items()} == {k: v["hash"] for k, v in res[0].items()} for r in res), res


def test_random_collectives_match_the_reference():
    res = values(run_ranks("test_stress:random_collectives", 3, kwargs={"count": 300, "seed": 11}, env=QUICK_ENV,
                           timeout=300))
    for r in res:
        assert r["n_mismatches"] == 0, r
        assert r["kinds"]["sign_sync"] > 50 and r["kinds"]["sign_async"] > 50, r
        # Resident memory does not keep growing (a leak of the per-call
        # buffers, ~MBs per call here, would show).
        assert r["rss_mb"]["end"] - r["rss_mb"]["middle"] < 64, r["rss_mb"]
