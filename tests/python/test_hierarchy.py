"""The sign collectives over a cluster's two levels (lionbit.hierarchy), on
real processes: "node" bitwise equal to the flat call (every op, dtype, tie
rule, zeros, sizes that do not divide, L = 1, M = 1), "node_vote" against an
independent simulation, the byte counters of each level against their
formulas, DistributedLion under DDP, FSDP2 and FSDP1 with a hierarchy, and
the errors."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_fsdp import _full_params, _train_ddp, _train_fsdp
from test_fsdp1 import _params, _train_fsdp1

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8)
SIZES = (0, 1, 63, 64, 65, 257, 1000, 4099, 20000)
OPS = (("vote", "zero"), ("vote", "alternate"), ("vote", "random"), ("avg", "zero"), ("sum", "zero"))
ZEROS = ("none", "sparse", "dense", "still")


def _data(case: int, rank: int, n: int, dtype, zeros: str) -> torch.Tensor:
    """Rank `rank`'s input of case `case`: random signs with zeros as asked
    ("sparse": a few, on even ranks only; "dense": a third; "still": elements
    that are 0 on every rank)."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    x = torch.randn(n, generator=g)
    if zeros == "dense":
        x = torch.randint(-1, 2, (n,), generator=g).float()
    elif zeros == "sparse" and rank % 2 == 0 and n:
        x[torch.randint(0, n, (max(1, n // 50),), generator=g)] = 0
    elif zeros == "still" and n:
        shared = torch.Generator().manual_seed(case)
        x[torch.randint(0, n, (max(1, n // 10),), generator=shared)] = 0
    if dtype == torch.int8:
        return (x.sign() * (1 + rank % 3)).to(torch.int8)
    return x.to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _nodes(node_of) -> str:
    """The pool of ranks (harness.py) for a topology: a group's hierarchy is set up
    once, so cases of different topologies never share ranks."""
    return f"nodes {tuple(node_of)}"


def _node_of(rank: int, node_of) -> None:
    import os

    os.environ["LIONBIT_NODE"] = f"box-{node_of[rank]}"


def flat_vs_node(rank, world_size, node_of, cases_every=1):
    """Every case twice, flat and hierarchy="node"; the all-reduce on the
    whole input and the reduce-scatter on its first N * (n // N) elements.
    Returns the cases whose results differ."""
    import lionbit

    topo = lionbit.Topology(tuple(node_of))
    differ, ran, case = [], 0, 0
    for n in SIZES:
        for op, tie in OPS:
            for zeros in ZEROS:
                case += 1
                if case % cases_every:
                    continue
                dtype = DTYPES[case % len(DTYPES)]
                if dtype == torch.int8 and op == "avg":
                    dtype = torch.float32
                x = _data(case, rank, n, dtype, zeros)
                if case % 7 == 0 and n >= 4:  # a non-contiguous tensor
                    x = x[: n - n % 2].view(2, -1).t()
                out = []
                for hierarchy in ("flat", "node"):
                    y = x.clone()
                    lionbit.all_reduce_sign(y, op, tie_break=tie, tie_seed=case, hierarchy=hierarchy,
                                            topology=topo)
                    s = x.numel() // world_size
                    rs = torch.empty(s, dtype=dtype)
                    lionbit.reduce_scatter_sign(rs, x.reshape(-1)[: s * world_size], op, tie_break=tie,
                                                tie_seed=case, hierarchy=hierarchy)
                    out.append((_bits(y), _bits(rs)))
                ran += 1
                if out[0][0] != out[1][0]:
                    differ.append(f"all_reduce n={n} {op}/{tie} zeros={zeros} {dtype}")
                if out[0][1] != out[1][1]:
                    differ.append(f"reduce_scatter n={n} {op}/{tie} zeros={zeros} {dtype}")
    return {"differ": differ, "ran": ran}


def uneven(rank, world_size):
    import lionbit

    try:
        lionbit.all_reduce_sign(torch.ones(10), hierarchy="node", topology=lionbit.Topology((0, 0, 1)))
    except ValueError as e:
        return str(e)
    return None


def test_uneven_nodes_are_refused_on_every_rank():
    # On the 3 ranks of the (0, 1, 2) cases below, before they set that
    # hierarchy up (this test comes first in the file): the refusal sets
    # nothing up, so those cases find the group as fresh ranks have it.
    for r in values(run_ranks("test_hierarchy:uneven", 3, pool=_nodes((0, 1, 2)))):
        assert "same number of ranks on every node" in r and "argument 'hierarchy'" in r


@pytest.mark.parametrize(
    "node_of,every",
    [
        ((0, 1, 0, 1), 1),  # 2 x 2, nodes {0, 2} and {1, 3}: not consecutive; every case
        ((0, 0, 0, 0), 2),  # M = 1; every other case
        ((0, 1, 2), 2),  # L = 1, M = 3
    ],
)
def test_node_is_the_flat_result_bit_for_bit(node_of, every):
    kwargs = {"node_of": node_of, "cases_every": every}
    res = values(run_ranks("test_hierarchy:flat_vs_node", len(node_of), kwargs=kwargs, timeout=420,
                           pool=_nodes(node_of)))
    for r in res:
        assert r["ran"] == len(SIZES) * len(OPS) * len(ZEROS) // every
        assert r["differ"] == []


def test_node_is_the_flat_result_on_three_nodes_of_two():
    res = values(run_ranks("test_hierarchy:flat_vs_node", 6, kwargs={"node_of": (0, 0, 1, 1, 2, 2),
                                                                     "cases_every": 3}, timeout=420,
                           pool=_nodes((0, 0, 1, 1, 2, 2))))
    assert all(r["differ"] == [] and r["ran"] > 50 for r in res)


def _simulate_node_vote(xs, nodes, tie: str, seed: int) -> torch.Tensor:
    """The vote of node votes from every rank's input, written directly:
    node n's vote is sign(sum of its ranks' signs) (an even split: 0 under
    "zero", +1 / -1 by the seed's parity under "alternate"; 0 where all its
    ranks sent 0); the result is the same rule over the node votes."""
    def vote(signs):  # signs: [k, n]
        s = signs.sum(0)
        out = s.sign()
        tied = (s == 0) & (signs != 0).any(0)
        if tie == "alternate":
            out[tied] = 1.0 if seed % 2 == 0 else -1.0
        return out

    signs = torch.stack([x.float().sign() for x in xs])
    node_votes = torch.stack([vote(signs[list(n)]) for n in nodes])
    return vote(node_votes)


def node_vote_vs_simulation(rank, world_size, node_of):
    import lionbit

    topo = lionbit.Topology(tuple(node_of))
    bad, case = [], 0
    for n in (1, 65, 1000, 4099):
        for tie in ("zero", "alternate"):
            for zeros in ZEROS:
                case += 1
                x = _data(case, rank, n, torch.float32, zeros)
                xs = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(xs, x)
                want = _simulate_node_vote(xs, topo.nodes, tie, case)
                y = x.clone()
                lionbit.all_reduce_sign(y, "vote", tie_break=tie, tie_seed=case, hierarchy="node_vote", topology=topo)
                if not torch.equal(y, want):
                    bad.append(f"n={n} {tie} {zeros}: {int((y != want).sum())} differ")
                flat = x.clone()
                lionbit.all_reduce_sign(flat, "vote", tie_break=tie, tie_seed=case)
                if zeros == "dense" and n == 4099 and torch.equal(flat, want):
                    bad.append("the node vote equals the flat vote: the test cannot tell them apart")
    return bad


def test_node_vote_matches_a_simulation():
    assert values(run_ranks("test_hierarchy:node_vote_vs_simulation", 4, kwargs={"node_of": (0, 0, 1, 1)},
                            pool=_nodes((0, 0, 1, 1)))) == [[]] * 4


def bytes_per_level(rank, world_size, node_of, n):
    import lionbit

    topo = lionbit.Topology(tuple(node_of))
    out = {}
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    lionbit.all_reduce_sign(x.clone(), "vote", hierarchy="node", topology=topo)  # sets it up
    for hierarchy, op, tie in (("node", "vote", "alternate"), ("node", "vote", "zero"),
                               ("node_vote", "vote", "alternate"),
                               ("node", "avg", "zero"), ("flat", "vote", "alternate")):
        lionbit.reset_stats()
        y = x.clone()
        lionbit.all_reduce_sign(y, op, tie_break=tie, tie_seed=0, hierarchy=hierarchy)
        st = lionbit.stats()
        keys = ("bytes_sent", "intra_node_bytes_sent", "inter_node_bytes_sent", "intra_node_bytes_received",
                "inter_node_bytes_received")
        out[f"{hierarchy}/{op}" + ("/zero" if tie == "zero" and op == "vote" else "")] = {k: st[k] for k in keys}
    return out


def test_bytes_of_each_level_are_their_formulas():
    L, M, n = 2, 2, 64 * 4 * 300 + 17  # does not divide: 301 words a shard
    N = L * M
    res = values(run_ranks("test_hierarchy:bytes_per_level", N, kwargs={"node_of": (0, 0, 1, 1), "n": n},
                           pool=_nodes((0, 0, 1, 1))))
    sw = -(-n // (64 * N))  # words a shard
    sb = 8 * sw
    P = 2  # planes that hold 0..L = 2 (no zeros)
    Q = 3  # planes that hold 0..N = 4
    header = 72 * (N - 1)  # the 72-byte header round
    want = {
        # intra: slices of M shards in the node's all-to-all, then the
        # gathered slices ([zeros: 8 bytes][sign plane] a shard) in the
        # node's all-gather; inter: P count planes in the all-to-all across
        # nodes, one result message in the all-gather across nodes.
        "node/vote": ((L - 1) * M * sb + (L - 1) * M * (8 + sb), (M - 1) * P * sb + (M - 1) * (8 + sb)),
        # "zero" at even N: the results in base 3, 13 bytes a word
        "node/vote/zero": ((L - 1) * M * sb + (L - 1) * M * 13 * sw,
                           (M - 1) * P * sb + (M - 1) * 13 * sw),
        # node vote: one sign plane a node vote (no zeros under "alternate")
        "node_vote/vote": ((L - 1) * M * sb + (L - 1) * M * (8 + sb), (M - 1) * sb + (M - 1) * (8 + sb)),
        # avg: the Q planes of the total count come back
        "node/avg": ((L - 1) * M * sb + (L - 1) * M * Q * sb, (M - 1) * P * sb + (M - 1) * Q * sb),
    }
    for r in res:
        for key, (intra, inter) in want.items():
            got = r[key]
            assert got["intra_node_bytes_sent"] == intra == got["intra_node_bytes_received"], (key, got)
            assert got["inter_node_bytes_sent"] == inter == got["inter_node_bytes_received"], (key, got)
            assert got["bytes_sent"] == header, (key, got)
        flat = r["flat/vote"]
        assert flat["intra_node_bytes_sent"] == 0 and flat["inter_node_bytes_sent"] == 0
    # Per node, the formula d (P + 1)/8 (M - 1)/M within 2 %.
    per_node = L * res[0]["node/vote"]["inter_node_bytes_sent"]
    assert abs(per_node / (n * (P + 1) / 8 * (M - 1) / M) - 1) < 0.02


def bad_arguments(rank, world_size):
    import lionbit

    errs = []
    topo = lionbit.Topology((0, 0, 1, 1))
    for kwargs in ({"hierarchy": "nodes"}, {"op": "avg", "hierarchy": "node_vote"}):
        try:
            lionbit.all_reduce_sign(torch.ones(10), **{"op": "vote", "topology": topo, **kwargs})
        except ValueError as e:
            errs.append(str(e))
    # Only rank 1 asks for the node vote: every rank fails at once, naming it.
    try:
        if rank == 1:
            lionbit.all_reduce_sign(torch.ones(10), hierarchy="node_vote")
        else:
            lionbit.all_reduce_sign(torch.ones(10))
    except (ValueError, RuntimeError) as e:
        errs.append(str(e))
    try:
        lionbit.DistributedLion(torch.nn.Linear(2, 2).parameters(), aggregation="l1", hierarchy="node")
    except ValueError as e:
        errs.append(str(e))
    return errs


def test_bad_hierarchy_arguments_raise_naming_them():
    # On the (0, 0, 1, 1) ranks of the tests around it: the second call sets
    # that topology's hierarchy up (or finds it set up), as on ranks of its own.
    res = values(run_ranks("test_hierarchy:bad_arguments", 4, pool=_nodes((0, 0, 1, 1))))
    for errs in res:
        assert "argument 'hierarchy' is 'nodes'" in errs[0]
        assert "'node_vote'" in errs[1] and "'avg'" in errs[1]
        assert "hierarchy differs across ranks" in errs[2] and ("rank 1" in errs[2])
        assert "'l1' runs flat" in errs[3]


def training(rank, world_size, node_of, steps=3):
    """DDP, FSDP2 and FSDP1 + DistributedLion, flat and hierarchy="node": the
    same parameters bit for bit; and "node_vote" moves them differently."""
    _node_of(rank, node_of)
    out = {}
    for agg in ("vote", "vote+alternate", "avg"):
        flat = _train_ddp(rank, steps, 1, agg)
        node = _train_ddp(rank, steps, 1, agg + "@node")
        out[f"ddp/{agg}"] = all(torch.equal(a, b) for a, b in zip(flat, node))
    model, _, _ = _train_fsdp(rank, steps, 1, "vote")
    flat = _full_params(model)
    model, _, _ = _train_fsdp(rank, steps, 1, "vote@node")
    out["fsdp2/vote"] = all(torch.equal(a, b) for a, b in zip(flat, _full_params(model)))
    model, _ = _train_fsdp1(rank, steps, 1, "vote", "FULL_SHARD", False)
    flat = _params(model)
    model, _ = _train_fsdp1(rank, steps, 1, "vote@node", "FULL_SHARD", False)
    out["fsdp1/vote"] = all(torch.equal(a, b) for a, b in zip(flat, _params(model)))
    # At L = 2 a node's vote of two signs is their sum / 2, so under "zero"
    # without zeros the vote of node votes is the flat vote; with "alternate"
    # a node's tie takes a side and the two differ.
    nv = _train_ddp(rank, steps, 1, "vote+alternate@node_vote")
    flat = _train_ddp(rank, steps, 1, "vote+alternate")
    out["node_vote differs"] = not all(torch.equal(a, b) for a, b in zip(flat, nv))
    return out


def test_distributed_lion_with_a_hierarchy_under_ddp_fsdp2_fsdp1():
    res = values(run_ranks("test_hierarchy:training", 4, kwargs={"node_of": (0, 0, 1, 1)}, timeout=420,
                           pool=_nodes((0, 0, 1, 1))))
    for r in res:
        assert all(r.values()), r


def lion_node_vote_vs_reference(rank, world_size, node_of, steps=4):
    """DDP + DistributedLion(hierarchy="node_vote") against Lion written out
    here: every rank's own gradient, its direction's sign gathered with a
    standard all_gather, the vote simulated (node vote, and flat to show the
    two apart), the update applied. Returns the largest difference from
    each reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit
    from test_fsdp import LION, _loss, _net

    _node_of(rank, node_of)
    topo = lionbit.detect_topology()
    model = DDP(_net())
    opt = lionbit.DistributedLion(model.parameters(), hierarchy="node_vote", **LION).attach(model)
    refs = {"node_vote": _net(), "flat": _net()}
    moms = {k: [torch.zeros_like(p) for p in r.parameters()] for k, r in refs.items()}
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    for step in range(steps):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        for kind, ref in refs.items():
            ref.zero_grad()
            _loss(ref, rank, step).backward()
            with torch.no_grad():
                for p, m in zip(ref.parameters(), moms[kind]):
                    c = (b1 * m + (1 - b1) * p.grad).sign()
                    cs = [torch.empty_like(c) for _ in range(world_size)]
                    dist.all_gather(cs, c)
                    nodes = topo.nodes if kind == "node_vote" else [list(range(world_size))]
                    u = _simulate_node_vote(cs, nodes, "zero", 0).view_as(p)
                    p.mul_(1 - lr * wd).add_(u, alpha=-lr)
                    m.mul_(b2).add_(p.grad, alpha=1 - b2)
    return {k: max(float((a - b).abs().max()) for a, b in zip(model.module.parameters(), r.parameters()))
            for k, r in refs.items()}


def test_distributed_lion_node_vote_matches_a_reference():
    # Nodes of 3: a node's vote never ties, and differs from the flat vote.
    res = run_ranks("test_hierarchy:lion_node_vote_vs_reference", 6, kwargs={"node_of": (0, 0, 0, 1, 1, 1)},
                    pool=_nodes((0, 0, 0, 1, 1, 1)))
    for err in values(res):
        assert err["node_vote"] < 1e-6 < err["flat"], err
