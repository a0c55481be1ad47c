"""Started by torchrun in test_ddp_and_launch.py: argv[1] is the backend spec,
argv[2] "import" or "noimport" (rely on torch's backend autoloading), argv[3]
how the rank ends: "destroy" (destroy_process_group) or "exit" (a few
DistributedLion steps under DDP, sign calls left in flight, and no
destroy_process_group: the interpreter finalizes while lionbit's worker
thread exists)."""

import sys

import torch
import torch.distributed as dist

spec, how, end = sys.argv[1], sys.argv[2], sys.argv[3]
if how == "import":
    import lionbit  # noqa: F401

dist.init_process_group(spec)
rank, n = dist.get_rank(), dist.get_world_size()
import lionbit  # noqa: E402  (already imported by torch's autoload in "noimport")

x = torch.full((1000,), 1.0 if rank == 0 else -1.0)
x[: 10 * (rank + 1)] = 0
lionbit.all_reduce_sign(x, "sum")
# Run with 2 ranks: rank 0 is 0 on [0, 10), rank 1 on [0, 20); elsewhere
# rank 0's +1 and rank 1's -1 cancel.
assert n == 2
expect = torch.zeros(1000)
expect[10:20] = 1.0
t = torch.ones(3)
dist.all_reduce(t)
assert torch.equal(x, expect), x[:30]
assert t.tolist() == [float(n)] * 3
assert dist.get_backend() == spec.split(":")[-1] or spec.startswith("cpu:")
sys.stdout.write(f"OK rank {rank} backend {dist.get_backend()}\n")  # one write: atomic on a pipe
sys.stdout.flush()
if end == "destroy":
    dist.destroy_process_group()
    sys.exit(0)

from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

model = DDP(torch.nn.Linear(8, 2))
opt = lionbit.DistributedLion(model.parameters(), lr=1e-3).attach(model)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
pending = [lionbit.all_reduce_sign(torch.randn(1 << 16), async_op=True) for _ in range(3)]
sys.stdout.write(f"EXITING {rank}\n")
sys.stdout.flush()
# no destroy_process_group, calls possibly still in flight
