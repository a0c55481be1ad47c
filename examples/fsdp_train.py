"""Train a small transformer with FSDP2 (fully_shard) + DistributedLion over
backend "lionbit".

    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py [--fsdp1]

The same task and model as examples/ddp_train.py (scikit-learn's bundled
digits, 8 row tokens per image). Each encoder layer and the root are
fully_shard units; opt.attach(model) replaces FSDP's fp32 gradient
reduce-scatter with lionbit's 1-bit sign reduce-scatter. Parameters are still
all-gathered by FSDP (forwarded to Gloo), unchanged. At the end rank 0
compares the bytes of the gradient path with what fp32 FSDP would send, and
prints the optimizer memory per rank against FSDP + AdamW.
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lionbit


class RowTransformer(torch.nn.Module):
    def __init__(self, dim=64, heads=4, layers=2, classes=10):
        super().__init__()
        self.embed = torch.nn.Linear(8, dim)
        self.pos = torch.nn.Parameter(torch.zeros(8, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):  # x: (batch, 64) pixels
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.encoder(h).mean(1))


def progress(step, total, loss, width=30):
    done = int(width * step / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aggregation", default="vote", choices=["vote", "avg"])
    parser.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bfloat16)")
    parser.add_argument("--fsdp1", action="store_true", help="FSDP1 (FullyShardedDataParallel) instead of fully_shard")
    parser.add_argument("--momentum-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    dist.init_process_group("lionbit")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.batch % world == 0, "the global batch must split evenly across ranks"

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xte, yte, xtr, ytr = x[perm[:360]], y[perm[:360]], x[perm[360:]], y[perm[360:]]

    torch.manual_seed(0)
    model = RowTransformer()
    d = sum(p.numel() for p in model.parameters())
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert not args.bf16, "--bf16 needs FSDP2 (lionbit refuses FSDP1 MixedPrecision)"
        for i, layer in enumerate(model.encoder.layers):
            model.encoder.layers[i] = FSDP(layer, device_id=torch.device("cpu"))
        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if args.bf16 else {}
        for layer in model.encoder.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    units = 1 + len(model.encoder.layers)
    mdt = getattr(torch, args.momentum_dtype)
    opt = lionbit.DistributedLion(
        model.parameters(), lr=args.lr, weight_decay=0.1, aggregation=args.aggregation, momentum_dtype=mdt
    )
    opt.attach(model)
    steps_per_epoch = len(xtr) // args.batch
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    if rank == 0:
        print(f"lionbit {lionbit.__version__}: {world} ranks, backend {dist.get_backend()}, "
              f"transformer with {d:,} parameters in {units} {'FSDP1 instances' if args.fsdp1 else 'fully_shard units'}"
              f"{' (bf16 compute)' if args.bf16 else ''}, DistributedLion({args.aggregation}, "
              f"{args.momentum_dtype} momentum)")

    g = torch.Generator().manual_seed(1)
    step, t0 = 0, time.perf_counter()
    lionbit.reset_stats()
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=g)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch].view(world, -1)[rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and (step % 5 == 0 or step == total):
                progress(step, total, loss.item())
        with torch.no_grad():
            acc = 100.0 * (model(xte).argmax(1) == yte).float().mean().item()
        if not args.fsdp1:
            model.reshard()  # the root keeps its parameters unsharded after a forward
        if rank == 0:
            sys.stdout.write(f"  epoch {epoch + 1}: test accuracy {acc:.2f}%\n")
    secs = time.perf_counter() - t0

    stats = lionbit.stats()
    # Padded elements FSDP reduce-scatters per step (each parameter's dim 0
    # padded to a multiple of N).
    if args.fsdp1:  # each FlatParameter padded to a multiple of N
        padded = sum(-(-u.numel // world) * world for u in opt.attachment.units)
    else:
        padded = sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) for p in opt.param_groups[0]["params"])
    one_bit = (world - 1) / world * padded / 8 * step
    fp32_rs = (world - 1) / world * 4 * padded * step  # FSDP's fp32 reduce-scatter of gradients
    # FSDP's parameter all-gathers, the same with or without lionbit: forward
    # and backward (the root keeps its parameters unsharded after forward).
    ag = (world - 1) / world * 4 * padded * step * 2
    params = opt.param_groups[0]["params"]  # the sharded DTensors (FSDP1: FlatParameters)
    if args.fsdp1:
        mom_bytes = sum(u.momentum.numel() * u.momentum.element_size() for u in opt.attachment.units)
        shard_bytes = sum(p.numel() * 4 for p in params)
    else:
        mom_bytes = sum(opt.state[p]["exp_avg"].numel() * opt.state[p]["exp_avg"].element_size() for p in params)
        shard_bytes = sum(p.to_local().numel() * 4 for p in params)
    if rank == 0:
        print(f"\ndone: {step} steps in {secs:.1f}s, final test accuracy {acc:.2f}%")
        print(f"gradient path, bytes sent per rank: lionbit {stats['bytes_sent']:,} "
              f"({stats['bytes_sent'] / step:,.0f} per step, {stats['bytes_sent'] / one_bit:.2f}x the 1-bit figure "
              f"(N-1)/N*d/8, headers included)")
        print(f"                                    fp32 FSDP reduce-scatter would send {fp32_rs:,.0f}: "
              f"{fp32_rs / stats['bytes_sent']:.1f}x more")
        print(f"with FSDP's parameter all-gathers (~{ag:,.0f}, unchanged): lionbit FSDP {ag + stats['bytes_sent']:,.0f}"
              f" vs fp32 FSDP {ag + fp32_rs:,.0f} ({(ag + fp32_rs) / (ag + stats['bytes_sent']):.2f}x)")
        print(f"optimizer memory on rank 0: momentum {mom_bytes:,} bytes (full-size, {mom_bytes / d:.0f} B/param) "
              f"vs AdamW's two sharded moments {2 * shard_bytes:,} bytes ({2 * shard_bytes / d:.1f} B/param)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
