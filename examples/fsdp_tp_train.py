"""Train a small transformer with tensor parallelism and FSDP2 (torchtitan's
2-D parallelism) + DistributedLion over backend "lionbit".

    torchrun --standalone --nproc-per-node 4 examples/fsdp_tp_train.py [--tp 2] [--epochs 12]

The ranks form a (dp, tp) mesh: each block's linears are split over the tp
ranks (Megatron's column / row split, torch's ColwiseParallel and
RowwiseParallel), and fully_shard shards every parameter over the dp ranks.
On several nodes, put tp inside the node (torchrun numbers a node's ranks
consecutively, and tp is the mesh's last dim): FSDP's dp traffic then
crosses the nodes, and that is what opt.attach(model) makes 1-bit. Each dp
rank is one Distributed Lion worker: its tp ranks hold the parts of its
gradient and momentum that their kernels compute, so a rank keeps 1/tp of a
full momentum.

The same task as examples/fsdp_train.py (scikit-learn's digits, 8 row
tokens per image), with a transformer written from Linear layers so that a
tensor-parallel plan can split them. At the end rank 0 compares the bytes
of the gradient path with what fp32 FSDP would send over dp, and prints the
momentum a rank keeps.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lionbit


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.w1, self.w2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        # the heads of this rank's columns: the tp split gives each rank heads / tp of them
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(torch.nn.functional.gelu(self.w1(self.norm2(x))))

    def tensor_parallel(self, tp_mesh):
        plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1")}
        plan |= {name: RowwiseParallel() for name in ("wo", "w2")}
        parallelize_module(self, tp_mesh, plan)


class RowTransformer(torch.nn.Module):
    def __init__(self, dim=64, heads=4, layers=2, classes=10):
        super().__init__()
        self.embed = torch.nn.Linear(8, dim)
        self.pos = torch.nn.Parameter(torch.zeros(8, dim))
        self.blocks = torch.nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):  # x: (batch, 64) pixels
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))


def progress(step, total, loss, width=30):
    done = int(width * step / total)
    sys.stdout.write(f"\r  [{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the mesh's last dim)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split across the dp ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    dist.init_process_group("lionbit")  # the ranks run on the CPU: Gloo underneath
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % args.tp == 0, f"--tp {args.tp} must divide the {world} ranks"
    dp = world // args.tp
    assert args.batch % dp == 0, "the global batch must split evenly across the dp ranks"
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xte, yte, xtr, ytr = x[perm[:360]], y[perm[:360]], x[perm[360:]], y[perm[360:]]

    torch.manual_seed(0)
    model = RowTransformer()
    d = sum(p.numel() for p in model.parameters())
    for block in model.blocks:  # torchtitan's order: the tensor-parallel plan, then fully_shard over dp
        block.tensor_parallel(mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    opt = lionbit.DistributedLion(model.parameters(), lr=args.lr, weight_decay=0.1)
    opt.attach(model)  # the dp reduce-scatter of gradients becomes a 1-bit one
    steps_per_epoch = len(xtr) // args.batch
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    if rank == 0:
        print(f"lionbit {lionbit.__version__}: {world} ranks as dp {dp} x tp {args.tp}, backend "
              f"{dist.get_backend()}, transformer with {d:,} parameters, DistributedLion(vote)")

    def accuracy():
        with torch.no_grad():
            acc = 100.0 * (model(xte).argmax(1) == yte).float().mean().item()
        model.reshard()  # the root keeps its parameters unsharded after a forward
        return acc

    dp_rank = mesh["dp"].get_local_rank()  # a dp rank's tp ranks take the same batch
    g = torch.Generator().manual_seed(1)
    votes = mesh["dp"].get_group()  # the vote's group: the dp ranks of this rank's tp index
    lionbit.reset_stats(votes)
    step, acc, t0 = 0, None, time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=g)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch].view(dp, -1)[dp_rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and (step % 5 == 0 or step == total):
                progress(step, total, loss.item())
        acc = accuracy()
        if rank == 0:
            sys.stdout.write(f"  epoch {epoch + 1}: test accuracy {acc:.2f}%\n")
    secs = time.perf_counter() - t0

    stats = lionbit.stats(votes)
    # Elements of this rank's tensor-parallel part that FSDP reduce-scatters a step: each
    # momentum (the tensor-parallel-local shape) with its dim 0 padded to a multiple of dp.
    params = opt.param_groups[0]["params"]
    momenta = [opt.state[p]["exp_avg"] for p in params]
    padded = sum(-(-m.shape[0] // dp) * dp * (m.numel() // m.shape[0]) for m in momenta)
    one_bit = (dp - 1) / dp * padded / 8 * step
    fp32_rs = (dp - 1) / dp * 4 * padded * step
    mom_bytes = sum(m.numel() * m.element_size() for m in momenta)
    if rank == 0:
        print(f"\ndone: {step} steps in {secs:.1f}s, final test accuracy {acc:.2f}%")
        print(f"gradient path over dp, bytes sent per rank: lionbit {stats['bytes_sent']:,} "
              f"({stats['bytes_sent'] / step:,.0f} per step, {stats['bytes_sent'] / one_bit:.2f}x the 1-bit figure "
              f"(N-1)/N*(d/tp)/8, headers included)")
        print(f"                                            fp32 FSDP reduce-scatter would send {fp32_rs:,.0f}: "
              f"{fp32_rs / stats['bytes_sent']:.1f}x more")
        print(f"momentum on rank 0: {mom_bytes:,} bytes ({mom_bytes / d:.1f} B/param: its tensor-parallel part, "
              f"full-size over dp)")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
