"""lionbit.estimate, the two-level cost model and its command line: the CLI runs
as users run it and rejects bad input naming the argument; the byte formulas
match values worked out here by hand, with small round numbers."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lionbit import estimate

EXAMPLE = ["--params", "7e9", "--nodes", "16", "--gpus-per-node", "8", "--inter", "100gbit"]
LABELS = [
    "flat vote",
    "exact hierarchical",
    "node vote",
    "fp32 ring all-reduce",
    "bf16 ring all-reduce",
    "fp32 hierarchical all-reduce",
    "bf16 hierarchical all-reduce",
]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "lionbit.estimate", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_prints_every_method_and_a_recommendation():
    r = run_cli(*EXAMPLE)
    assert r.returncode == 0, r.stdout + r.stderr
    for label in LABELS:
        assert label in r.stdout, label
    assert "recommended: " in r.stdout
    assert "node vote (approximate)" in r.stdout
    assert "assumptions" in r.stdout


def test_cli_json_recommends_an_exact_method():
    r = run_cli(*EXAMPLE, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    methods = {m["method"]: m for m in doc["methods"]}
    assert [m["label"] for m in doc["methods"]] == LABELS
    assert methods[doc["recommended"]]["exact"]
    assert doc["cluster"]["ranks"] == 128


@pytest.mark.parametrize(
    "args, named",
    [
        (["--params", "7e9", "--nodes", "16", "--inter", "fast"], "--inter"),
        (["--params", "7e9", "--nodes", "16", "--inter", "100"], "--inter"),
        (["--params", "7e9", "--nodes", "0", "--inter", "100gbit"], "--nodes"),
        (["--params", "7e9", "--nodes", "2", "--gpus-per-node", "-1", "--inter", "100gbit"], "--gpus-per-node"),
        (["--params", "lots", "--nodes", "2", "--inter", "100gbit"], "--params"),
        (["--params", "7e9", "--nodes", "2", "--inter", "100gbit", "--intra", "quick"], "--intra"),
    ],
)
def test_cli_rejects_bad_input_naming_the_argument(args, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        estimate.main(args)
    assert exit_info.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_cli_exits_2_on_bad_input():
    r = run_cli("--params", "7e9", "--nodes", "16", "--inter", "fast")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "argument --inter: invalid rate 'fast'" in r.stderr, r.stderr


def test_parse_rate():
    assert estimate.parse_rate("100gbit") == 12.5e9
    assert estimate.parse_rate("25gbit") == 25e9 / 8
    assert estimate.parse_rate("10g") == 1.25e9
    assert estimate.parse_rate("400Gbps") == 50e9
    assert estimate.parse_rate("450GB/s") == 450e9
    assert estimate.parse_rate("nvlink") == 450e9
    for bad in ("fast", "100", "-5gbit", "0gbit", "10 furlongs", ""):
        with pytest.raises(ValueError):
            estimate.parse_rate(bad)


def test_parse_count():
    assert estimate.parse_count("7e9") == 7_000_000_000
    assert estimate.parse_count("7B") == 7_000_000_000
    assert estimate.parse_count("125M") == 125_000_000
    for bad in ("0", "x", "-3", "inf", "nan"):
        with pytest.raises(ValueError):
            estimate.parse_count(bad)


# d = 8M parameters: d/8 = 1M bytes of signs. 4 nodes of 4 GPUs: N = 16.
D, MB = 8_000_000, 1_000_000
CLUSTER = estimate.Cluster(nodes=4, gpus_per_node=4, inter_bytes_per_s=1e9, inter_latency_s=10e-6)


def test_flat_vote_bytes():
    e = estimate.flat_vote(D, CLUSTER)
    # The wire as built: one GPU chunk (256M elements) padded to 64 * 16, a shard of 7813
    # words (62,504 bytes, not 1M / 16), each vote message 16 bytes longer, and the
    # 72-byte header round (a ring all-gather: 15 hops out of each node).
    sb = 7813 * 8
    assert estimate.sign_wire("vote", 16, D, gpu=True)["shards"] == [(D, 1, 7813)]
    # all-to-all: each of a node's 4 ranks sends 12 of its 16 shards to other nodes;
    # ring all-gather: one hop out of the node per step, 15 steps of a vote message.
    assert e.inter_bytes_per_node == 15 * 72 + 4 * 12 * sb + 15 * (16 + sb)
    assert e.inter_bytes_per_node == pytest.approx(3 * MB + 15 / 16 * MB, rel=1e-3)  # the d/8 approximation
    # The L * 2(N-1)/N * d/8 (7.5M) counts every byte a rank sends as leaving the
    # node: only an upper bound (it would be right for a direct all-gather).
    assert e.inter_bytes_per_node < 4 * 2 * 15 / 16 * MB
    # NVLink: 3 shards to the node's other ranks, then 15 forwarded in the ring.
    assert e.intra_bytes_per_gpu == 15 * 72 + 3 * sb + 15 * (16 + sb)
    assert e.phases == ["header round", "all-to-all of the packed signs", "ring all-gather of the votes"]


def test_exact_hierarchical_bytes():
    assert estimate.count_bits(4) == 4  # -4..4: 9 values
    assert estimate.count_bits(8) == 5  # -8..8: 17 values
    assert estimate.count_bits(1) == 2
    e = estimate.exact_hierarchical(D, CLUSTER)
    # d * (4 + 1)/8 * (M-1)/M = 5 * 1M * 3/4
    assert e.inter_bytes_per_node == pytest.approx(3.75 * MB)
    assert e.intra_bytes_per_gpu == pytest.approx(2 * 3 / 4 * MB)  # 1-bit in, 1-bit back


def test_node_vote_bytes():
    e = estimate.node_vote(D, CLUSTER)
    assert e.inter_bytes_per_node == pytest.approx(2 * 3 / 4 * MB)  # 1 bit there, 1 bit back
    assert not e.exact


def test_ring_and_hierarchical_allreduce_bytes_and_time():
    k = estimate.Kernels(stream_bytes_per_s=1e12, count_bytes_per_s=1e12)
    e = estimate.ring_allreduce(D, CLUSTER, 4, k)
    # 2 (N-1)/N * 4 d = 2 * 15/16 * 32M = 60M; the ring leaves each node once a step.
    assert e.inter_bytes_per_node == pytest.approx(60 * MB)
    # alpha-beta: 30 steps of 10 us, 60M at 1 GB/s, the reduction of 15/16 d elements
    # reading 8 and writing 4 bytes at 1 TB/s.
    assert e.time_s == pytest.approx(30 * 10e-6 + 60 * MB / 1e9 + 15 / 16 * D * 12 / 1e12)
    assert estimate.ring_allreduce(D, CLUSTER, 2).inter_bytes_per_node == pytest.approx(30 * MB)
    h = estimate.hierarchical_allreduce(D, CLUSTER, 4)
    assert h.inter_bytes_per_node == pytest.approx(2 * 3 / 4 * 32 * MB)
    assert h.intra_bytes_per_gpu == pytest.approx(2 * 3 / 4 * 32 * MB)


def test_one_node_sends_nothing_between_nodes():
    one = estimate.Cluster(nodes=1, gpus_per_node=8)
    for e in estimate.estimate_all(D, one):
        assert e.inter_bytes_per_node == 0, e.method
        assert e.inter_s == 0, e.method
        assert e.time_s > 0, e.method


def test_recommendation_is_the_fastest_exact_method():
    es = estimate.estimate_all(7e9, estimate.Cluster(nodes=16, gpus_per_node=8, inter_bytes_per_s=12.5e9))
    best = estimate.recommend(es)
    assert best.exact
    assert best.time_s == min(e.time_s for e in es if e.exact)
    assert best.method == "exact_hierarchical"  # 16 nodes of 8 at 100 Gbit/s
    assert all(math.isfinite(e.time_s) and e.time_s > 0 for e in es)


def test_cli_imports_no_torch_and_no_extension():
    """The command is standard library only: it answers without torch or a built lionbit."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "lionbit.estimate", *EXAMPLE],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "lionbit" in imported, r.stderr[-2000:]  # the package, imported first (the module itself runs as __main__)
    assert not {m for m in imported if m.split(".")[0] == "torch" or m == "lionbit._C"}, sorted(imported)


def test_one_collective_on_one_link():
    # The model suite 4 validates: 1M float32 elements, N = 4, one 4M chunk, no ties.
    link = estimate.LinkRates(goodput=1e8, alpha=1e-4, msg_overhead=1e-5)
    core = estimate.CoreRates(pack=1e10, unpack=2e10, read=1e10, vote_a=1e-9, vote_b=1e-10, kappa=2.0)
    t = estimate.sign_allreduce_on_link("vote", 4, 1 << 20, link, core)
    sb = (1 << 20) // 64 // 4 * 8  # a shard: 4096 words
    assert t["bytes"] == 3 * 72 + 3 * (sb + 16 + sb)  # header round; phase 1; phase 2
    # header and phase 1: all-to-alls; phase 2 (4 messages of 32 KiB) round the ring
    assert t["steps"] == 1 + 1 + 3 and t["chunks"] == 1
    assert t["latency_s"] == pytest.approx(5e-4 + 2 * 3e-5)
    small = estimate.sign_allreduce_on_link("vote", 4, 1 << 16, link, core)  # 4 messages of 2 KiB
    assert small["steps"] == 1 + 1 + 1  # every message to every peer at once
    assert t["bandwidth_s"] == pytest.approx(t["bytes"] / 1e8)
    vote = (1 << 20) // 4 * (1e-9 + 4e-10)  # the own shard's elements
    assert t["kernel_s"] == pytest.approx(2.0 * (4 * (1 << 20) / 1e10 + vote + 4 * (1 << 20) / 2e10))
    assert t["time_s"] == pytest.approx(t["latency_s"] + t["bandwidth_s"] + t["kernel_s"])
    assert t["bound"] == "kernels"
    r = estimate.ring_allreduce_on_link(4, 1 << 20, 4, 8, link, core)
    assert r["bytes"] == 1.5 * 4 * (1 << 20) and r["steps"] == 6
    assert r["kernel_s"] == pytest.approx(2.0 * 0.75 * (1 << 20) * 8 / 1e10) and r["bound"] == "bandwidth"


# HSDP on CLUSTER (4 nodes of 4 GPUs): each rank holds d/L = 2M elements and exchanges them
# with the M = 4 ranks holding the same shard; its node's 4 ranks share the link.
PART = D // 4
HSDP_LABELS = ["HSDP + DistributedLion", "HSDP + AdamW (fp32 all-reduce)", "HSDP + AdamW (bf16 all-reduce)"]


def test_hsdp_lion_bytes_between_nodes_are_one_bit_a_shard_element():
    e = estimate.hsdp_lion(D, CLUSTER)
    closed = 2 * 3 / 4 * PART / 8  # 2 (M-1)/M (d/L)/8 = 375,000
    # The wire: one GPU chunk, a shard of ceil(2M / 64 / 4) = 7813 words; the header round
    # (3 x 72), the all-to-all (3 shards) and the ring all-gather (3 votes of 16 + sb).
    sb = 7813 * 8
    assert e.inter_bytes_per_rank == 3 * 72 + 3 * sb + 3 * (16 + sb)
    headers = 3 * (72 + 16)  # the header round and each vote's zero code
    padding = 2 * 3 * (sb - PART / 4 / 8)  # 2M / 4 = 500,000 elements padded to 500,032
    assert closed < e.inter_bytes_per_rank <= closed + headers + padding
    assert e.inter_bytes_per_node == 4 * e.inter_bytes_per_rank
    assert e.phases[-1].startswith("sign all-reduce")
    # M = 2: one exchange of the packed shard (d/L/8) and a 72-byte header each way.
    two = estimate.hsdp_lion(D, estimate.Cluster(nodes=2, gpus_per_node=4))
    assert two.inter_bytes_per_rank == 72 + 2 * (PART // 2 // 8)
    assert two.inter_bytes_per_rank == pytest.approx(2 * 1 / 2 * PART / 8, abs=72)


def test_hsdp_adamw_bytes_and_lion_is_a_32nd_of_fp32():
    lion, fp32, bf16 = estimate.estimate_hsdp(D, CLUSTER)
    assert [e.label for e in (lion, fp32, bf16)] == HSDP_LABELS
    assert fp32.inter_bytes_per_rank == pytest.approx(2 * 3 / 4 * PART * 4)  # 12M
    assert bf16.inter_bytes_per_rank == pytest.approx(2 * 3 / 4 * PART * 2)
    assert fp32.inter_bytes_per_node == pytest.approx(4 * 12 * MB)
    assert fp32.inter_bytes_per_rank / lion.inter_bytes_per_rank == pytest.approx(32, rel=1e-3)
    assert bf16.inter_bytes_per_rank / lion.inter_bytes_per_rank == pytest.approx(16, rel=1e-3)


def test_hsdp_counts_fsdp_inside_the_node_alike():
    # Defaults: fp32 all-gather of the parameters twice (reshard_after_forward), fp32
    # reduce-scatter: 3 x (L-1)/L x 4 d = 72M a GPU; nothing else uses NVLink.
    for e in estimate.estimate_hsdp(D, CLUSTER):
        assert e.intra_bytes_per_gpu == pytest.approx(3 * 3 / 4 * 4 * D), e.method
        assert e.fsdp_intra_bytes_per_gpu == e.intra_bytes_per_gpu
    f = estimate.Fsdp(param_bytes=2, reduce_bytes=2, reshard_after_forward=False)
    for e in estimate.estimate_hsdp(D, CLUSTER, f=f):
        assert e.intra_bytes_per_gpu == pytest.approx(2 * 3 / 4 * 2 * D), e.method
        assert len([p for p in e.phases if p.startswith("FSDP")]) == 2


def test_hsdp_adamw_time_in_closed_form():
    k = estimate.Kernels(stream_bytes_per_s=1e12, count_bytes_per_s=1e12)
    e = estimate.hsdp_adamw(D, CLUSTER, 4, k)
    nvlink = 450e9
    fsdp = 3 * (3 * 2e-6 + 3 / 4 * 4 * D / nvlink)  # 3 rings of L-1 = 3 steps at 2 us
    cross = 2 * 3 * 10e-6 + 4 * 12 * MB / 1e9  # 2 (M-1) steps at 10 us; 4 ranks' 12M on 1 GB/s
    kernels = (3 / 4 * D + 3 / 4 * PART) * 12 / 1e12  # reduce-scatter and all-reduce reductions
    assert e.cross_node_s == pytest.approx(cross)
    assert e.time_s == pytest.approx(fsdp + cross + kernels)
    four = estimate.hsdp_adamw(D, CLUSTER, 4, k, estimate.Fsdp(units=4))
    assert four.latency_s == pytest.approx(4 * e.latency_s)  # every unit pays its steps again


def test_hsdp_memory_per_rank():
    lion, fp32, _ = estimate.estimate_hsdp(D, CLUSTER)
    assert lion.optimizer_state_bytes_per_rank == 4 * PART  # the momentum of the shard
    assert fp32.optimizer_state_bytes_per_rank == 8 * PART  # exp_avg and exp_avg_sq
    assert lion.memory_bytes_per_rank == 12 * PART and fp32.memory_bytes_per_rank == 16 * PART
    bf16_momentum = estimate.hsdp_lion(D, CLUSTER, f=estimate.Fsdp(momentum_bytes=2))
    assert bf16_momentum.memory_bytes_per_rank == 10 * PART


def test_hsdp_on_one_node_sends_nothing_between_nodes():
    for e in estimate.estimate_hsdp(D, estimate.Cluster(nodes=1, gpus_per_node=8)):
        assert e.inter_bytes_per_rank == 0 and e.inter_bytes_per_node == 0 and e.cross_node_s == 0, e.method
        assert e.time_s > 0


def test_recommend_never_picks_hsdp():
    c = estimate.Cluster(nodes=8, gpus_per_node=8, inter_bytes_per_s=12.5e9)
    ddp, hsdp = estimate.estimate_all(7e9, c), estimate.estimate_hsdp(7e9, c)
    assert hsdp[0].time_s < estimate.recommend(ddp).time_s  # faster here, but another memory regime
    assert estimate.recommend(ddp + hsdp) is estimate.recommend(ddp)


def test_cli_hsdp_table_and_json():
    r = run_cli(*EXAMPLE, "--hsdp")
    assert r.returncode == 0, r.stdout + r.stderr
    main_table, hsdp_table = r.stdout.split("\nHSDP (", 1)
    for label in LABELS:
        assert label in main_table, label
    for label in HSDP_LABELS:
        assert label in hsdp_table and label not in main_table, label
    assert "Another memory regime" in hsdp_table
    plain = run_cli(*EXAMPLE)
    assert "HSDP" not in plain.stdout
    assert r.stdout.startswith(plain.stdout)  # the existing table unchanged
    doc = json.loads(run_cli(*EXAMPLE, "--hsdp", "--fsdp-reduce-dtype", "bf16", "--json").stdout)
    assert [m["label"] for m in doc["hsdp"]["methods"]] == HSDP_LABELS
    assert doc["hsdp"]["fsdp"]["reduce_bytes"] == 2
    assert [m["label"] for m in doc["methods"]] == LABELS
    assert "hsdp" not in json.loads(run_cli(*EXAMPLE, "--json").stdout)


def test_cost_model_doc_hsdp_table_is_what_its_commands_print():
    """docs/cost-model.md's HSDP table: each row's figures from the command in its last cell."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cost-model.md").read_text()
    rows = [line for line in doc.split("\n## HSDP", 1)[1].splitlines() if line.startswith("|") and "--hsdp`" in line]
    assert len(rows) == 12
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        args = estimate.parser().parse_args(cells[-1].strip("`").split()[3:])
        assert args.hsdp
        c = estimate.Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, inter_bytes_per_s=args.inter)
        lion, _, bf16 = estimate.estimate_hsdp(args.params, c, f=estimate.fsdp_config(args))
        figures = [
            f"{lion.inter_bytes_per_node / 1e9:.3f}",
            f"{bf16.inter_bytes_per_node / 1e9:.3f}",
            f"{lion.cross_node_s * 1e3:,.1f}",
            f"{bf16.cross_node_s * 1e3:,.1f}",
            f"{lion.time_s * 1e3:,.1f}",
            f"{bf16.time_s * 1e3:,.1f}",
            f"{bf16.time_s / lion.time_s:.1f}x",
        ]
        assert cells[:3] == [estimate.count_label(args.params), estimate.rate_label(args.inter),
                             f"{args.nodes} ({c.ranks})"], row
        assert cells[3:-1] == figures, row


# The kernel rates of a make gpu-check run (H200): lionbit.estimate --gpu-rates.
ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "docs" / "benchmarks" / "gpu_check_h200_5.json"


def test_gpu_rates_are_the_largest_rows_of_a_gpu_check_json():
    rates = estimate.gpu_rates(str(H200))
    rows = {(r["kernel"], r["elements_M"]): r for r in json.loads(H200.read_text())["figures"]["bench_kernels"]}
    per_elem = lambda name: rows[(name, 256)]["time_us"] * 1e-6 / 256e6  # noqa: E731
    assert rates.device == "NVIDIA H200"
    assert rates.pack_s == pytest.approx(per_elem("pack_signs f32"))  # 673.1 us, not the 16M row's 49.9
    assert rates.unpack_s == pytest.approx(per_elem("unpack f32 (2 planes)"))
    assert rates.apply_s == pytest.approx(per_elem("lion_apply_dense f32/f32"))
    copy = rows[("memcpy D2D (f32)", 256)]
    assert rates.copy_bytes_per_s == pytest.approx(copy["MB"] * 1e6 / (copy["time_us"] * 1e-6))  # ~4.24 TB/s
    assert [n for n, _ in rates.vote] == [2, 4, 8, 16, 32, 64]
    v = dict(rates.vote)
    assert rates.per_element(rates.vote, 1) == v[2]  # below the table: its first
    assert rates.per_element(rates.vote, 8) == v[8]
    assert rates.per_element(rates.vote, 12) == pytest.approx((v[8] + v[16]) / 2)
    assert rates.per_element(rates.vote, 128) == pytest.approx(v[64] + (v[64] - v[32]) * 2)  # the last two's line


@pytest.mark.parametrize(
    "text, named",
    [
        ("{not json", "not a readable JSON file"),
        ('{"figures": {}}', "no figures.bench_kernels"),
        ('{"figures": {"bench_kernels": [{"kernel": "vote N=2", "elements_M": 16}]}}', "time_us > 0"),
        ('{"figures": {"bench_kernels": [{"kernel": "memcpy D2D (f32)", "elements_M": 16, "time_us": 37.5, '
         '"MB": 134.2}]}}', "'pack_signs f32'"),
    ],
)
def test_gpu_rates_refuse_a_file_naming_it_and_what_it_lacks(tmp_path, text, named):
    bad = tmp_path / "rates.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(bad))) as err:
        estimate.gpu_rates(str(bad))
    assert named in str(err.value)
    r = run_cli(*EXAMPLE, "--gpu-rates", str(bad))
    assert r.returncode == 2 and "--gpu-rates" in r.stderr and named in r.stderr and "Traceback" not in r.stderr


def test_measured_kernels_time_lionbit_per_element_and_streams_at_the_copy_rate():
    rates = estimate.gpu_rates(str(H200))
    k = estimate.Kernels.measured(rates)
    two = estimate.Cluster(nodes=2, gpus_per_node=1, inter_bytes_per_s=1e9)
    e = estimate.flat_vote(D, two, k)  # N = 2: each rank packs, votes every element and unpacks
    assert e.kernel_s == pytest.approx(D * (rates.pack_s + rates.unpack_s + dict(rates.vote)[2]))
    f = estimate.flat_vote(D, CLUSTER, k)  # N = 16: a rank votes its shard of 7813 words
    assert f.kernel_s == pytest.approx(D * (rates.pack_s + rates.unpack_s) + 7813 * 64 * dict(rates.vote)[16])
    r = estimate.ring_allreduce(D, CLUSTER, 4, k)
    assert r.kernel_s == pytest.approx(15 / 16 * D * 12 / rates.copy_bytes_per_s)
    assert estimate.flat_vote(D, CLUSTER).kernel_s != f.kernel_s  # the assumed rates differ


def test_step_estimates_in_closed_form():
    rates = estimate.gpu_rates(str(H200))
    k, d = estimate.Kernels.measured(rates), 1.3e9
    c = estimate.Cluster(nodes=8, gpus_per_node=8, inter_bytes_per_s=12.5e9)
    steps = {e.method: e for e in estimate.step_estimates(d, c, rates)}
    assert [e.label for e in steps.values()] == [m[1] for m in estimate.STEP_METHODS]
    es = {e.method: e for e in estimate.estimate_all(d, c, k)}
    vote = min(es["flat_vote"].time_s, es["exact_hierarchical"].time_s)
    bf16 = min(es["ring_bf16"].time_s, es["hierarchical_bf16"].time_s)
    lion_update = d * (rates.direction_s + rates.apply_s)
    assert steps["distributed_lion"].time_s == pytest.approx(vote + lion_update)
    assert steps["lion_bf16"].time_s == pytest.approx(bf16 + 20 * d / rates.copy_bytes_per_s)
    assert steps["adamw_bf16"].time_s == pytest.approx(bf16 + 28 * d / rates.copy_bytes_per_s)
    # PowerSGD, rank 4 on 1.3B's width 2048: P and Q of 9 r h elements a layer of 12 h^2
    assert estimate.transformer_width(d) == 2048 and estimate.transformer_width(7e9) == 4096
    elems = d / (12 * 2048**2) * 9 * 4 * 2048
    one = min(estimate.ring_allreduce(elems, c, 4, k).time_s, estimate.hierarchical_allreduce(elems, c, 4, k).time_s)
    assert steps["powersgd_adamw"].exchange_s == pytest.approx(2 * one + 32 * d / rates.copy_bytes_per_s)
    hsdp_lion, _, hsdp_bf16 = estimate.estimate_hsdp(d, c, k)
    assert steps["hsdp_lion"].time_s == pytest.approx(hsdp_lion.time_s + lion_update / 8)  # a rank updates d/L
    assert steps["hsdp_adamw_bf16"].time_s == pytest.approx(hsdp_bf16.time_s + 28 * d / 8 / rates.copy_bytes_per_s)
    assert steps["hsdp_lion"].regime == "HSDP" and steps["powersgd_adamw"].regime == "replicated"


def test_a_flat_vote_applies_from_its_planes_where_the_rates_have_that_row(tmp_path):
    """A make gpu-check run with lion_apply_planes f32: the flat vote (and HSDP's replicate vote)
    unpacks nothing and its update applies from the planes; the hierarchical vote still unpacks.
    A run without the row (the H200's) keeps the unpack and the dense apply."""
    assert estimate.gpu_rates(str(H200)).apply_planes_s is None
    doc = json.loads(H200.read_text())
    doc["figures"]["bench_kernels"] += [
        {"kernel": "lion_apply_planes f32", "elements_M": 16, "time_us": 99.0},
        {"kernel": "lion_apply_planes f32", "elements_M": 256, "time_us": 800.0},
    ]
    with_row = tmp_path / "rates.json"
    with_row.write_text(json.dumps(doc))
    old, rates = estimate.gpu_rates(str(H200)), estimate.gpu_rates(str(with_row))
    assert rates.apply_planes_s == pytest.approx(800e-6 / 256e6)  # the largest row
    k, d = estimate.Kernels.measured(rates), 1.3e9
    two = estimate.Cluster(nodes=2, gpus_per_node=1, inter_bytes_per_s=1e9)
    assert estimate.flat_vote(D, two, k).kernel_s == pytest.approx(D * (rates.pack_s + dict(rates.vote)[2]))
    c = estimate.Cluster(nodes=8, gpus_per_node=8, inter_bytes_per_s=12.5e9)
    flat_old = estimate.flat_vote(d, c, estimate.Kernels.measured(old))
    assert flat_old.time_s - estimate.flat_vote(d, c, k).time_s == pytest.approx(d * rates.unpack_s)
    hier = [estimate.exact_hierarchical(d, c, estimate.Kernels.measured(r)).time_s for r in (old, rates)]
    assert hier[0] == pytest.approx(hier[1])
    for cluster in (two, c):
        steps = {e.method: e for e in estimate.step_estimates(d, cluster, rates)}
        es = {e.method: e for e in estimate.estimate_all(d, cluster, k)}
        flat_s = es["flat_vote"].time_s + d * (rates.direction_s + rates.apply_planes_s)
        hier_s = es["exact_hierarchical"].time_s + d * (rates.direction_s + rates.apply_s)
        assert steps["distributed_lion"].time_s == pytest.approx(min(flat_s, hier_s))
        hsdp = estimate.estimate_hsdp(d, cluster, k)[0]
        hsdp_old = estimate.estimate_hsdp(d, cluster, estimate.Kernels.measured(old))[0]
        part = d / cluster.gpus_per_node
        update = part * (rates.direction_s + rates.apply_planes_s)
        assert steps["hsdp_lion"].time_s == pytest.approx(hsdp.time_s + update)
        assert hsdp.kernel_s == pytest.approx(hsdp_old.kernel_s - part * rates.unpack_s)


def test_the_step_takes_the_vote_whose_step_is_faster_not_its_exchange():
    """On 8 nodes of 8 at 100 Gbit/s the hierarchical vote's exchange is the faster, but with a
    dense apply far slower than the planes' the flat vote's step is: DistributedLion's row takes it."""
    base = estimate.gpu_rates(str(H200))
    rates = replace(base, apply_planes_s=base.apply_s, apply_s=base.apply_s + 1e-9)  # + 1 s a 1e9 elements
    d, c = 7e9, estimate.Cluster(nodes=8, gpus_per_node=8, inter_bytes_per_s=12.5e9)
    es = {e.method: e for e in estimate.estimate_all(d, c, estimate.Kernels.measured(rates))}
    assert es["exact_hierarchical"].time_s < es["flat_vote"].time_s
    step = next(e for e in estimate.step_estimates(d, c, rates) if e.method == "distributed_lion")
    assert step.exchange_s == pytest.approx(es["flat_vote"].time_s)
    assert step.update_s == pytest.approx(d * (rates.direction_s + rates.apply_planes_s))


def test_cli_step_table_needs_the_rates():
    r = run_cli(*EXAMPLE, "--step")
    assert r.returncode == 2 and "--step needs --gpu-rates" in r.stderr
    r = run_cli(*EXAMPLE, "--gpu-rates", str(H200), "--step")
    assert r.returncode == 0, r.stdout + r.stderr
    main_table, step_table = r.stdout.split("\nA step after the backward pass", 1)
    assert "as make gpu-check measured them on NVIDIA H200" in main_table
    for _, label, _ in estimate.STEP_METHODS:
        assert f"\n{label} " in step_table, label
    assert "replicated: DistributedLion" in step_table and "HSDP: HSDP + DistributedLion" in step_table
    doc = json.loads(run_cli(*EXAMPLE, "--gpu-rates", str(H200), "--step", "--json").stdout)
    assert [s["method"] for s in doc["step"]] == [m[0] for m in estimate.STEP_METHODS]
    assert doc["kernels"]["gpu"]["device"] == "NVIDIA H200"


def test_cost_model_doc_step_table_is_what_the_projection_prints():
    """docs/cost-model.md's step table is bench/gpu_step_projection.py's on the H200's rates."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_step_projection
    finally:
        sys.path.remove(str(ROOT / "bench"))
    doc = (ROOT / "docs" / "cost-model.md").read_text()
    assert "python bench/gpu_step_projection.py --gpu-rates docs/benchmarks/gpu_check_h200_5.json" in doc
    table = gpu_step_projection.table(gpu_step_projection.projection(estimate.gpu_rates(str(H200))))
    assert table in doc
