"""Suite 6: the sign vote on a two-level cluster: flat, hierarchy="node" and "node_vote".

    python bench/hierarchy.py                         # 2 nodes x 2 ranks, 1 Gbit/s between nodes, d 1M and 16M
    python bench/hierarchy.py --nodes 2 --per-node 2 --numel 16M --repeats 8

The cluster is bench/netns.py's two-level one: a network namespace a node,
its ranks inside it (they reach each other over the node's loopback,
unshaped), nodes joined by veth pairs into a bridge with tc tbf at the link
rate on both ends and segment offloads off, checked with iperf3. On this
2-core machine 2 x 2 ranks are CPU-bound (two ranks a core): the step times
say so; the byte counts are exact whatever the load.

Each rank calls lionbit.all_reduce_sign(x, "vote") on d float32 elements
(random signs, no zeros: a zero on any rank makes P = bit_width(2L); tie
rule "zero", DistributedLion's default),
warm-up calls first (they set the hierarchy up and the flat vote's inline-tie
hint), then `repeats` timed calls, each after a barrier. Per method:

- time: each rank's median call, the slowest rank's;
- inter-node bytes per node per call, three ways:
  wire: the node's veth tx_bytes (frames: Ethernet, IP and TCP headers, ACKs);
  payload: wire - 66 bytes a frame (14 Ethernet + 20 IPv4 + 32 TCP with
  timestamps; an ACK is all header), less the barriers' own bytes (measured
  alone);
  counted: lionbit.stats() (inter_node_bytes_sent x ranks a node, plus the
  header round's bytes that cross nodes), and the closed-form formula of
  each method (below), with payload / formula.

Formulas, bytes a node sends to other nodes per call (N = L M ranks, sw =
ceil(d / 64 N) words a shard, sb = 8 sw, P = bit_width(L) count planes,
trits = 13 sw bytes, a shard's result in base 3; ring all-gathers over ranks
numbered node by node cross a node's boundary once):

    header round   72 (N - 1)                      (every method; a ring all-gather)
    flat           L (N - L) sb                     phase 1: to every rank of other nodes
                   + (N - 1) (16 + ceil8(trits))    phase 2: the ring all-gather, inline ties
    node           L (M - 1) (P sb + trits)         counts across nodes, results back
    node_vote      L (M - 1) ((1 + z) sb + trits)   node votes (z = 1: their zeros' plane,
                                                    "zero" ties at even L), results back

The issue's approximations: flat L 2 (N - 1)/N d/8 (every byte of every
rank on the network); node d (ceil(log2(2L + 1)) + 1)/8 (M - 1)/M.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHODS = ("flat", "node", "node_vote")
FRAME_HEADER = 66


def parse_numel(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def formulas(d: int, L: int, M: int) -> dict:
    from lionbit.estimate import HEADER_BYTES, TIE_COUNT_BYTES  # the wire's sizes, stated once

    N = L * M
    sw = -(-d // (64 * N))
    sb = 8 * sw
    P = max(1, L.bit_length())
    trits = 13 * sw
    header = HEADER_BYTES * (N - 1)  # the header round
    z = 1 if L % 2 == 0 else 0
    return {
        "flat": header + L * (N - L) * sb + (N - 1) * (TIE_COUNT_BYTES + 8 * -(-trits // 8)),
        "node": header + L * (M - 1) * (P * sb + trits),
        "node_vote": header + L * (M - 1) * ((1 + z) * sb + trits),
        "header": header,
        "issue_flat": L * 2 * (N - 1) / N * d / 8,
        "issue_node": d * (math.ceil(math.log2(2 * L + 1)) + 1) / 8 * (M - 1) / M,
    }


def read_tx(ifname: str) -> tuple:
    """(tx_bytes, tx_packets) of a network interface."""
    base = f"/sys/class/net/{ifname}/statistics"
    with open(f"{base}/tx_bytes") as f, open(f"{base}/tx_packets") as g:
        return int(f.read()), int(g.read())


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    import lionbit

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    topo = lionbit.detect_topology()
    L, M = topo.ranks_per_node, topo.num_nodes
    first_of_node = topo.local_rank(rank) == 0
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
    out = []

    def tx():
        return read_tx(ifname) if first_of_node else (0, 0)

    # The barriers' own traffic, to take out of the timed loop's.
    dist.barrier()
    b0 = tx()
    for _ in range(a.repeats + 2):
        dist.barrier()
    b1 = tx()
    barrier_wire = (b1[0] - b0[0], b1[1] - b0[1])
    for d in a.numel:
        x = torch.randn(d, generator=torch.Generator().manual_seed(1000 + rank))
        x[x == 0] = 1.0  # randn has the odd exact 0; a zero anywhere costs the counts a plane
        y = torch.empty_like(x)
        for method in METHODS:
            for _ in range(a.warmup):
                y.copy_(x)
                lionbit.all_reduce_sign(y, "vote", hierarchy=method)
            dist.barrier()
            lionbit.reset_stats()
            t0 = tx()
            times = []
            for _ in range(a.repeats):
                y.copy_(x)
                dist.barrier()
                t = time.perf_counter()
                lionbit.all_reduce_sign(y, "vote", hierarchy=method)
                times.append(time.perf_counter() - t)
            dist.barrier()
            t1 = tx()
            st = lionbit.stats()
            rec = {"rank": rank, "node": topo.node_rank(rank), "first_of_node": first_of_node,
                   "median_s": statistics.median(times), "wire": t1[0] - t0[0], "frames": t1[1] - t0[1],
                   "inter_counted": st.get("inter_node_bytes_sent", 0), "bytes_sent": st["bytes_sent"]}
            recs = [None] * n
            dist.all_gather_object(recs, rec)
            if rank == 0:
                out.append(summarize(d, method, recs, L, M, a.repeats, barrier_wire))
                print(line(out[-1]), flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def summarize(d, method, recs, L, M, repeats, barrier_wire) -> dict:
    f = formulas(d, L, M)
    heads = [r for r in recs if r["first_of_node"]]
    # The barriers of the timed loop: repeats + 1 of them, as measured alone over repeats + 2.
    share = (repeats + 1) / (repeats + 2)
    wire = statistics.mean(r["wire"] - barrier_wire[0] * share for r in heads) / repeats
    frames = statistics.mean(r["frames"] - barrier_wire[1] * share for r in heads) / repeats
    payload = wire - FRAME_HEADER * frames
    counted = None
    if method != "flat":
        # Every rank's cross-node bytes, a node's summed, and the header round's crossing.
        per_node = {}
        for r in recs:
            per_node[r["node"]] = per_node.get(r["node"], 0) + r["inter_counted"]
        counted = statistics.mean(per_node.values()) / repeats + f["header"]
    return {"numel": d, "method": method, "nodes": M, "per_node": L,
            "median_s": max(r["median_s"] for r in recs), "wire_bytes_per_node": wire,
            "payload_bytes_per_node": payload, "counted_bytes_per_node": counted,
            "formula_bytes_per_node": f[method], "payload_vs_formula": payload / f[method],
            "issue_formula": f["issue_flat"] if method == "flat" else (f["issue_node"] if method == "node" else None)}


def line(r) -> str:
    c = f"{r['counted_bytes_per_node'] / 1e6:8.3f}" if r["counted_bytes_per_node"] else "     n/a"
    return (f"d={r['numel']:>9} {r['method']:>9}: {r['median_s'] * 1e3:8.1f} ms  inter-node per node: "
            f"wire {r['wire_bytes_per_node'] / 1e6:8.3f} MB, payload {r['payload_bytes_per_node'] / 1e6:8.3f}, "
            f"counted {c}, formula {r['formula_bytes_per_node'] / 1e6:8.3f} "
            f"(payload/formula {r['payload_vs_formula']:.4f})")


def markdown(doc: dict) -> str:
    m = doc["meta"]
    rows = doc["results"]
    out = [f"# Suite 6: the vote on {m['nodes']} nodes x {m['per_node']} ranks", "",
           f"`{m['command']}` ({m['started']}, lionbit {m['git']}). {m['cluster']}. "
           f"iperf3 node 1 -> node 0: {m['iperf3']}. Load outside the ranks before the run: {m['load_before']}.",
           f"{m['cores']} cores for {m['nodes'] * m['per_node']} ranks: the times are CPU-bound; "
           "the bytes are exact whatever the load.", "",
           "| d | method | call ms (slowest rank's median) | inter-node MB a node: wire | payload | "
           "lionbit counters | formula | payload / formula | vs flat payload |",
           "|---|---|---|---|---|---|---|---|---|"]
    flat = {r["numel"]: r["payload_bytes_per_node"] for r in rows if r["method"] == "flat"}
    for r in rows:
        c = f"{r['counted_bytes_per_node'] / 1e6:.3f}" if r["counted_bytes_per_node"] else "n/a"
        out.append(f"| {r['numel']:,} | {r['method']} | {r['median_s'] * 1e3:.1f} | "
                   f"{r['wire_bytes_per_node'] / 1e6:.3f} | {r['payload_bytes_per_node'] / 1e6:.3f} | {c} | "
                   f"{r['formula_bytes_per_node'] / 1e6:.3f} | {r['payload_vs_formula']:.4f} | "
                   f"{r['payload_bytes_per_node'] / flat[r['numel']]:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--link", default="1gbit", help="rate between nodes (tbf)")
    p.add_argument("--numel", default="1M,16M")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--json", default="bench/results/hierarchy.json")
    p.add_argument("--timeout", type=float, default=1200)
    a = p.parse_args()
    a.numel = [parse_numel(v) for v in a.numel.split(",")] if isinstance(a.numel, str) else a.numel
    if a.worker:
        worker(a)
        return

    worker_args = ["--numel", ",".join(str(v) for v in a.numel), "--warmup", str(a.warmup), "--repeats",
                   str(a.repeats)]
    run_on_cluster("hierarchy", os.path.abspath(__file__), a, worker_args, markdown)


def run_on_cluster(name: str, script: str, a, worker_args: list, to_markdown, **meta) -> None:
    """Runs `script --worker *worker_args --out FILE` as a.nodes x a.per_node ranks on the emulated
    cluster (a.link between nodes), then writes rank 0's results with the run's facts to a.json
    and to_markdown(doc) beside it. Suites 6 and 7 share it."""
    import collectives
    import netns
    import training

    ok, why = netns.can_make_namespaces()
    if not ok:
        sys.exit(f"{name}: needs network namespaces ({why})")
    n = a.nodes * a.per_node
    doc_meta = collectives.new_meta(True)
    doc_meta.update(nodes=a.nodes, per_node=a.per_node, link=a.link, cores=os.cpu_count(),
                    load_before=os.getloadavg()[0], git=training.git_commit(), **meta)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    tmp = os.path.abspath(a.json) + ".part"
    with netns.Cluster(n, netns.parse_rate(a.link), per_node=a.per_node) as c:
        ip = c.iperf3(seconds=1.0)
        doc_meta["cluster"] = c.describe()
        doc_meta["iperf3"] = (f"{ip['received_bps'] / 1e9:.3f} Gbit/s, {ip['retransmits']} retransmits"
                              if ip and "received_bps" in ip else f"n/a ({ip})")
        print(f"{name}: {doc_meta['cluster']}; iperf3 {doc_meta['iperf3']}", flush=True)
        results = collectives.launch(c, n, [sys.executable, script, "--worker", *worker_args, "--out", tmp], tmp,
                                     a.timeout)
    os.remove(tmp)
    doc_meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    doc_meta["load_after"] = os.getloadavg()[0]
    doc = {"meta": doc_meta, "results": results}
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    md = os.path.splitext(a.json)[0] + ".md"
    with open(md, "w") as f:
        f.write(to_markdown(doc))
    print(f"{name}: {a.json}, {md}")


if __name__ == "__main__":
    main()
