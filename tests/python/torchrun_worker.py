"""Started by torchrun in test_ddp_and_launch.py: argv[1] is the backend spec,
argv[2] "import" or "noimport" (rely on torch's backend autoloading)."""

import sys

import torch
import torch.distributed as dist

spec, how = sys.argv[1], sys.argv[2]
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
dist.destroy_process_group()
