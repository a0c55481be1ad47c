"""The README's adoption snippet runs as written (under torchrun, 2 ranks)."""

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

PRELUDE = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
"""

EPILOGUE = """
import lionbit as _lb
for step in range(5):
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
assert _lb.stats()["sign_allreduce_calls"] >= 5, _lb.stats()
sums = [None] * dist.get_world_size()
dist.all_gather_object(sums, [p.detach().sum().item() for p in model.parameters()])
assert sums[0] == sums[1]
import sys as _sys
_sys.stdout.write(f"SNIPPET OK {dist.get_rank()}\\n")  # one write: atomic on a pipe
_sys.stdout.flush()
"""


def _snippet():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(r"<!-- adoption-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its adoption snippet"
    return m.group(1)


def test_readme_adoption_snippet_runs():
    snippet = _snippet()
    assert "lionbit.DistributedLion" in snippet and "opt.attach(model)" in snippet
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "snippet.py")
        with open(script, "w") as f:
            f.write(PRELUDE + snippet + EPILOGUE)
        env = dict(os.environ)
        env.pop("LOCAL_WORLD_SIZE", None)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        r = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", script],
                           capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(re.findall(r"SNIPPET OK (\d)", r.stdout)) == ["0", "1"], r.stdout


def test_readme_launch_lines_are_ones_torchrun_accepts():
    """Every torchrun line of the README runs a file that exists, on one host (--standalone) or with
    the static rendezvous (--nnodes, --node-rank, --master-addr, --master-port; torchrun ignores
    --node-rank under --rdzv-backend c10d, so that must not be mixed in)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [ln.split("#")[0].strip() for ln in f if ln.lstrip().startswith("torchrun ")]
    assert lines, "README.md has no torchrun line"
    for ln in lines:
        args = ln.split()
        script = next((a for a in args if a.endswith(".py")), None)
        assert script and os.path.isfile(os.path.join(ROOT, script)), f"README.md: {ln!r} runs no existing file"
        if "--standalone" in args:
            continue
        for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port"):
            assert flag in args, f"README.md: {ln!r} lacks {flag} (static rendezvous)"
        assert not any(a.startswith("--rdzv") for a in args), f"README.md: {ln!r} mixes --node-rank with --rdzv-*"
