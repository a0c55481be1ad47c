"""Suite 7: a transformer LM's training step on a two-level cluster: HSDP and its alternatives.

    python bench/hsdp.py                      # 2 nodes x 2 ranks, 1 Gbit/s between nodes
    python bench/hsdp.py --steps 5 --link 1gbit --json bench/results/hsdp.json

The cluster is bench/netns.py's two-level one (bench/hierarchy.py's): a
network namespace a node, its ranks reaching each other over the node's
loopback, nodes joined through veth pairs shaped with tc tbf at the link
rate, checked with iperf3. Each rank trains the same causal transformer LM
(vocabulary 8192, width 320, 8 blocks: 12.5M parameters, float32, tied
head, GPT-2's initialization; --vocab 256: 10.0M, every token in every
step's batch) on its own random tokens, the same steps under each method:

  HSDP + AdamW (fp32)            fully_shard over a 2-D (replicate, shard) mesh, torch's AdamW:
                                 FSDP's reduce-scatter inside the node, its fp32 all-reduce across nodes
  HSDP + AdamW (bf16 reduce)     the same with MixedPrecisionPolicy(reduce_dtype=bfloat16)
  HSDP + DistributedLion         the same mesh, DistributedLion attached: the node's shard of the mean
                                 gradient, the 1-bit vote across nodes, the momentum sharded
  FSDP2 (1-D) + DistributedLion  fully_shard over all 4 ranks: every rank a worker, the flat vote
  DDP + DistributedLion "node"   DDP, DistributedLion(hierarchy="node")

Per method: the step's median time (the slowest rank's, after warm-up
steps; 4 ranks on 2 cores are CPU-bound, two ranks a core: the times say so
and compare methods only within one run), the bytes a rank sends to other
nodes per step (the node's veth tx_bytes over its ranks, frames included,
warm-up excluded) and per rank the bytes of its parameters, gradients and
optimizer state, counted from the torch tensors it holds (a DTensor's local
shard). Between nodes: wire bytes (frames included), payload (less 66
header bytes a frame) and the bytes lionbit's sign path sent
(lionbit.stats(); under HSDP every one of them crosses a node).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from hierarchy import read_tx, run_on_cluster  # noqa: E402  (bench/ on the path first)

METHODS = ("HSDP + AdamW (fp32)", "HSDP + AdamW (bf16 reduce)", "HSDP + DistributedLion",
           "FSDP2 (1-D) + DistributedLion", "DDP + DistributedLion \"node\"")
VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 8192, 320, 8, 5, 128, 4  # --vocab changes VOCAB


def _model():
    import torch
    import torch.nn.functional as F

    from gpt2_init import gpt2_init

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
            self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
            self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            b, t, w = x.shape
            q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, w // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
            return x + self.down(F.gelu(self.up(self.ln_2(x))))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(SEQ, WIDTH)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = torch.nn.LayerNorm(WIDTH)
            gpt2_init(self, LAYERS)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.tok.weight.t()

    torch.manual_seed(0)
    return LM()


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _build(method, L, M):
    """(model, optimizer) for one method, on the default group's ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = _model()
    if method.startswith("DDP"):
        model = DDP(model)
        opt = lionbit.DistributedLion(model.parameters(), lr=1e-4, weight_decay=0.1, hierarchy="node")
        return model, opt.attach(model)
    if method.startswith("HSDP"):
        mesh = init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (M * L,))
    kw = {"mesh": mesh}
    if "bf16" in method:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if "AdamW" in method:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-4, weight_decay=0.1)
    return model, opt.attach(model)


def _state_tensors(opt) -> list:
    """The optimizer state a rank holds: AdamW's exp_avg / exp_avg_sq, DistributedLion's momenta."""
    import torch

    if isinstance(opt, torch.optim.AdamW):
        return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return list(opt.attachment.momenta())


FRAME_HEADER = 66  # bytes a frame: 14 Ethernet + 20 IPv4 + 32 TCP with timestamps (bench/hierarchy.py)


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import lionbit

    torch.set_num_threads(1)
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    topo = lionbit.detect_topology()
    L, M = topo.ranks_per_node, topo.num_nodes
    first_of_node = topo.local_rank(rank) == 0
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, VOCAB, (a.warmup + a.steps, BATCH, SEQ + 1), generator=gen)
    out = []
    params = sum(p.numel() for p in _model().parameters())
    for method in a.methods:
        model, opt = _build(method, L, M)
        # HSDP votes over the replicate group: its lionbit backend counts the sign path's bytes
        group = next(model.parameters()).device_mesh.get_group("replicate") if method.startswith("HSDP") else None
        times = []
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                dist.barrier()
                lionbit.reset_stats(group)
                tx0 = read_tx(ifname) if first_of_node else (0, 0)
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(tokens[i, :, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens[i, :, 1:].reshape(-1)).backward()
            opt.step()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        sign_bytes = lionbit.stats(group)["bytes_sent"]
        dist.barrier()
        tx1 = read_tx(ifname) if first_of_node else (0, 0)
        rec = {"rank": rank, "median_s": statistics.median(times),
               "node_tx": tx1[0] - tx0[0], "node_frames": tx1[1] - tx0[1], "sign_bytes": sign_bytes,
               "param_bytes": _local_bytes(model.parameters()),
               "grad_bytes": _local_bytes(p.grad for p in model.parameters()),
               "state_bytes": _local_bytes(_state_tensors(opt))}
        recs = [None] * n
        dist.all_gather_object(recs, rec)
        if rank == 0:
            row = {"method": method, "params": params, "nodes": M, "per_node": L, "steps": a.steps,
                   "step_s": max(r["median_s"] for r in recs),
                   "inter_node_bytes_per_rank_step": sum(r["node_tx"] for r in recs) / (n * a.steps),
                   "inter_node_payload_per_rank_step": sum(r["node_tx"] - FRAME_HEADER * r["node_frames"]
                                                           for r in recs) / (n * a.steps),
                   "sign_bytes_per_rank_step": max(r["sign_bytes"] for r in recs) / a.steps,
                   "param_bytes": max(r["param_bytes"] for r in recs),
                   "grad_bytes": max(r["grad_bytes"] for r in recs),
                   "state_bytes": max(r["state_bytes"] for r in recs)}
            out.append(row)
            print(line(row), flush=True)
        del model, opt
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def line(r) -> str:
    mb = 1 << 20
    return (f"{r['method']:32s} {r['step_s']:7.3f} s/step  "
            f"{r['inter_node_bytes_per_rank_step'] / 1e3:10.1f} kB/rank/step between nodes  "
            f"params {r['param_bytes'] / mb:6.1f} MiB  grads {r['grad_bytes'] / mb:6.1f} MiB  "
            f"optimizer state {r['state_bytes'] / mb:6.1f} MiB")


def markdown(doc: dict) -> str:
    m = doc["meta"]
    rows = doc["results"]
    d = rows[0]["params"] if rows else 0
    L, M = m["per_node"], m["nodes"]
    ideal = 2 * (M - 1) / M * (d / L) / 8
    out = [f"# Suite 7: HSDP on {M} nodes x {L} ranks, {m['link']} between nodes",
           "",
           f"{m['cluster']}; iperf3 {m['iperf3']}; {m['cores']} cores, {M * L} ranks (CPU-bound: two ranks a "
           f"core; times compare methods within this run only); git {m['git']}; {m['finished']}.",
           f"Model: {d / 1e6:.1f}M parameters (float32). The 1-bit ideal between nodes, 2(M-1)/M (d/L)/8: "
           f"{ideal / 1e3:.1f} kB a rank a step.",
           "",
           "| method | s/step | kB a rank a step between nodes: wire (frames) | payload | lionbit's sign path "
           "(all ranks' peers) | parameters MiB | gradients MiB | optimizer state MiB |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    mb = 1 << 20
    for r in rows:
        out.append(f"| {r['method']} | {r['step_s']:.3f} | {r['inter_node_bytes_per_rank_step'] / 1e3:.1f} | "
                   f"{r['inter_node_payload_per_rank_step'] / 1e3:.1f} | {r['sign_bytes_per_rank_step'] / 1e3:.1f} | "
                   f"{r['param_bytes'] / mb:.1f} | {r['grad_bytes'] / mb:.1f} | {r['state_bytes'] / mb:.1f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    global VOCAB
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--link", default="1gbit", help="rate between nodes (tbf)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + "; ".join(METHODS))
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help=f"vocabulary (default {VOCAB}; the tied head gives every row a gradient each step, "
                        "so no row's direction is exactly 0)")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default="bench/results/hsdp.json")
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args()
    VOCAB = a.vocab
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()] if isinstance(a.methods, str) else a.methods
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if a.worker:
        worker(a)
        return

    worker_args = ["--vocab", str(a.vocab), "--warmup", str(a.warmup), "--steps", str(a.steps), "--methods",
                   ",".join(a.methods)]
    run_on_cluster("hsdp", os.path.abspath(__file__), a, worker_args, markdown, vocab=a.vocab)


if __name__ == "__main__":
    main()
