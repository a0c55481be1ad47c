"""The examples a user starts from, at N = 2 and one epoch: `make demo`'s
DDP script, `make demo-fsdp`'s FSDP2 and FSDP1 scripts and `make
demo-sign`'s collective. Each must finish, print its
figures, and the training scripts (one task, one seed, one data order) must
end at the same test accuracy: DDP, FSDP2 and FSDP1 take the same steps
bitwise (tests/python/test_fsdp.py, test_fsdp1.py), and so do their layouts
for several nodes where each node is one rank: HSDP over 2 x 1 ranks (FSDP2's
2-D mesh, which the script picks by itself on two torchrun "nodes"; FSDP1's
HYBRID_SHARD), and DDP with hierarchy="node" on two torchrun "nodes" (exact:
the flat vote's result). At N = 4, HSDP over 2
nodes x 2 ranks sends the 1-bit figure of a rank's shard between nodes and
keeps half a momentum a rank; so does the tensor-parallel script at dp 2 x tp
2 (each rank its tensor-parallel part).

Two launches go through torchrun as the README writes them: the DDP
script's epoch (--standalone) and its node hierarchy on two torchrun
"nodes" (several agents' rendezvous, GROUP_RANK). The rest run the script's
ranks with the environment torchrun gives its workers, forked from the test
zygote (torchrun_env.py): the same script, a few seconds less a launch."""

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import lionbit
import torchrun_env

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _env():
    env = dict(os.environ)
    env.pop("LOCAL_WORLD_SIZE", None)  # Gloo's shared-memory shortcut
    env["OMP_NUM_THREADS"] = "1"
    return env


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(script, *args, ranks=2, env=None):
    r = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", os.path.join(EXAMPLES, script), *args],
                       capture_output=True, text=True, timeout=300, env={**_env(), **(env or {})})  # ~8 s each
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout.replace("\r", "\n")


def _launch(script, *args, ranks=2, nodes=1):
    """The script on nodes x ranks ranks with torchrun's worker environment (torchrun_env.py)."""
    return torchrun_env.run(os.path.join(EXAMPLES, script), *args, ranks=ranks, nodes=nodes)


def _torchrun_nodes(script, *args, nodes=2):
    """The script on `nodes` torchrun "nodes" of one rank each, on this host
    (as on several hosts: --nnodes, --node-rank, one master); node 0's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([TORCHRUN, f"--nnodes={nodes}", f"--node-rank={k}", "--nproc-per-node=1",
                               "--master-addr=127.0.0.1", f"--master-port={port}", os.path.join(EXAMPLES, script),
                               *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for k in range(nodes)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)  # a hang guard
            assert p.returncode == 0, out[-3000:] + err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return outs[0].replace("\r", "\n")


def _accuracy(out):
    return float(re.search(r"final test accuracy ([0-9.]+)%", out).group(1))


def _times_one_bit(out):
    """The printed ratio of the gradient path's bytes to the 1-bit figure."""
    return float(re.search(r"([0-9.]+)x (?:it\)|the 1-bit figure)", out).group(1))


@pytest.fixture(scope="module")
def ddp():
    return _torchrun("ddp_train.py", "--epochs", "1")


def test_the_ddp_example(ddp):
    assert "replicas identical: True" in ddp, ddp
    assert 1.0 <= _times_one_bit(ddp) <= 1.05, ddp
    assert _accuracy(ddp) > 20.0, ddp  # ten classes: one epoch learns something


def test_the_ddp_example_on_one_rank():
    """A first run on one process (a debug run) finishes: there are no bytes between ranks to report."""
    out = _launch("ddp_train.py", "--epochs", "1", ranks=1)
    assert "bytes sent: one rank, nothing sent" in out and _accuracy(out) > 20.0, out


def _digest(out):
    return re.search(r"parameters ([0-9a-f]{12})", out).group(1)


@pytest.fixture(scope="module")
def two_epochs():
    """Two epochs of the DDP script, never stopped (DDP, FSDP2, HSDP at 2 x 1
    and FSDP1 take the same steps: every resumed script must end here)."""
    return _launch("ddp_train.py", "--epochs", "2")


@pytest.fixture(scope="module")
def hsdp_cut(tmp_path_factory):
    """The FSDP2 script on HSDP over 2 x 1 ranks stopped after its first
    epoch: its output and its checkpoint (each test resumes a copy)."""
    ckpt = str(tmp_path_factory.mktemp("hsdp_cut") / "ckpt")
    out = _launch("fsdp_train.py", "--epochs", "2", "--replicas", "2", "--checkpoint", ckpt, "--stop-after", "1")
    return out, ckpt


@pytest.fixture(scope="module")
def ddp_cut(tmp_path_factory):
    """The DDP script on 2 ranks stopped after its first epoch: its output
    and its checkpoint (each test resumes a copy)."""
    ckpt = str(tmp_path_factory.mktemp("ddp_cut") / "ckpt")
    return _launch("ddp_train.py", "--epochs", "2", "--checkpoint", ckpt, "--stop-after", "1"), ckpt


@pytest.mark.parametrize("script,flags", [("ddp_train.py", []), ("fsdp_train.py", ["--replicas", "2"]),
                                          ("fsdp_train.py", ["--fsdp1"])], ids=["ddp", "hsdp_dcp", "fsdp1_files"])
def test_the_examples_resume_from_their_checkpoints_bitwise(two_epochs, ddp_cut, hsdp_cut, tmp_path, script, flags):
    """Stopped after an epoch and started again with the same command, each
    takes the steps of a run that was never stopped: every rank resumes its
    own momentum (DDP and FSDP2: torch.distributed.checkpoint; FSDP1: its
    file of shards), the schedule and the data order too."""
    ckpt = str(tmp_path / "ckpt")
    if script == "ddp_train.py" or flags == ["--replicas", "2"]:
        cut, saved = ddp_cut if script == "ddp_train.py" else hsdp_cut
        shutil.copytree(saved, ckpt)
    else:
        cut = _launch(script, "--epochs", "2", *flags, "--checkpoint", ckpt, "--stop-after", "1")
    resumed = _launch(script, "--epochs", "2", *flags, "--checkpoint", ckpt)
    assert 1.0 <= _times_one_bit(cut) <= 1.05, cut  # the gradient path's bytes, each script's own count
    assert "resumed from" in resumed and "after epoch 1 (step 22)" in resumed, resumed
    assert _digest(cut) != _digest(two_epochs), (cut, two_epochs)
    assert _digest(resumed) == _digest(two_epochs), (resumed, two_epochs)
    assert _accuracy(resumed) == _accuracy(two_epochs)


@pytest.mark.parametrize("script,cut_name,ranks,says", [
    ("ddp_train.py", "ddp_cut", 4, "replicas identical: True"),
    ("fsdp_train.py", "hsdp_cut", 1, "gradient path: one rank, nothing sent"),
], ids=["ddp 2 -> 4 ranks", "hsdp 2 x 1 -> 1 rank"])
def test_the_examples_resume_on_another_number_of_ranks(two_epochs, request, tmp_path, script, cut_name, ranks, says):
    """Stopped after an epoch and started again on another number of ranks
    (torchrun's --nproc-per-node changed; the FSDP script's --replicas
    dropped): each loads its DCP checkpoint through
    lionbit.ElasticLoadPlanner, every rank starting from the mean of the
    saved workers' momenta, the parameters, schedule and data order as saved,
    and trains on to an accuracy near the uninterrupted run's. DDP: 2 ranks,
    then 4 (a node added; each rank's own file, as the script kept them
    before, left ranks 2 and 3 with none: they began at epoch 0 and the
    ranks' steps no longer paired). FSDP2: HSDP on 2 nodes of 1 rank, then
    FSDP2 on a 1-D mesh of 1 (a node lost)."""
    cut, saved = request.getfixturevalue(cut_name)
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    resumed = _launch(script, "--epochs", "2", "--checkpoint", ckpt, ranks=ranks)
    assert f"{ranks} ranks on cpu" in resumed and "after epoch 1 (step 22)" in resumed, resumed
    assert says in resumed, resumed
    assert _digest(resumed) not in (_digest(cut), _digest(two_epochs)), (resumed, cut, two_epochs)
    assert abs(_accuracy(resumed) - _accuracy(two_epochs)) < 5.0, (resumed, two_epochs)


@pytest.mark.parametrize(
    "flags,nodes",
    [([], 1), ([], 2), (["--fsdp1", "--replicas", "2"], 1)],
    ids=["fsdp2", "hsdp_on_two_nodes", "fsdp1_hybrid"],
)
def test_the_fsdp_example_steps_as_the_ddp_one(ddp, flags, nodes):
    """On two torchrun nodes the script shards inside each node by itself (HSDP). (FSDP1 alone: its resume
    test ends on the DDP script's parameters, bitwise, and checks its bytes.)"""
    if nodes > 1:
        out = _launch("fsdp_train.py", "--epochs", "1", *flags, nodes=nodes, ranks=1)
    else:
        out = _launch("fsdp_train.py", "--epochs", "1", *flags)
    assert 1.0 <= _times_one_bit(out) <= 1.05, out
    assert ("(2 replicas (nodes) x 1 shards)" in out) == (nodes > 1 or "--replicas" in flags), out
    assert _accuracy(out) == _accuracy(ddp), (out, ddp)


def test_the_fsdp_example_in_bf16_steps_alike_on_fsdp2_and_fsdp1():
    """--bf16: FSDP2's MixedPrecisionPolicy and FSDP1's MixedPrecision, both
    bf16 compute reduced in float32: the same local gradients, the same steps."""
    two, one = (_launch("fsdp_train.py", "--epochs", "1", "--bf16", *flags) for flags in ([], ["--fsdp1"]))
    assert "(bf16 compute)" in two and "(bf16 compute)" in one, (two, one)
    assert _digest(one) == _digest(two), (one, two)
    assert _accuracy(one) > 20.0, one


def test_the_hsdp_example_on_two_nodes_of_two():
    out = _launch("fsdp_train.py", "--epochs", "1", "--replicas", "2", ranks=4)
    assert "(2 replicas (nodes) x 2 shards)" in out, out
    assert 1.0 <= _times_one_bit(out) <= 1.05, out  # of the vote between nodes: 2(M-1)/M (d/L)/8
    assert "(its shard of the node's, 2.0 B/param)" in out, out  # 1/2 of a 4-byte momentum
    assert _accuracy(out) > 20.0, out


def test_the_fsdp_tp_example():
    """dp 2 x tp 2: the dp ranks vote with 1 bit on each rank's tensor-parallel part,
    and a rank keeps about half a momentum (the blocks' linears are split; the
    embedding, norms and head are not)."""
    out = _launch("fsdp_tp_train.py", "--epochs", "1", ranks=4)
    assert "4 ranks as dp 2 x tp 2" in out, out
    assert 1.0 <= _times_one_bit(out) <= 1.05, out
    per_param = float(re.search(r"bytes \(([0-9.]+) B/param: its tensor-parallel part", out).group(1))
    assert 2.0 <= per_param <= 2.5, out
    assert _accuracy(out) > 20.0, out


def test_the_ddp_example_on_two_nodes_with_the_node_hierarchy(ddp):
    out = _torchrun_nodes("ddp_train.py", "--epochs", "1", "--hierarchy", "node")
    assert "hierarchy='node'" in out and "replicas identical: True" in out, out
    between = int(re.search(r"between nodes ([0-9,]+)", out).group(1).replace(",", ""))
    assert between > 0, out
    assert _accuracy(out) == _accuracy(ddp), (out, ddp)  # exact: the flat vote's result


def test_the_sign_allreduce_example():
    out = _launch("sign_allreduce_demo.py")
    ratios = [float(x) for x in re.findall(r"lionbit sent ([0-9.]+)x that", out)]
    assert ratios and all(1.0 <= x <= 1.01 for x in ratios), out


GPU_SKIP = ("lionbit was built without the CUDA path" if not lionbit.built_with_cuda
            else "no CUDA device" if not torch.cuda.is_available() else "")


@pytest.mark.parametrize("script", ["ddp_train.py", "fsdp_train.py"])
def test_the_examples_say_when_cuda_is_not_there(script):
    if not GPU_SKIP:
        pytest.skip("there is a GPU here")
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--device", "cuda"], capture_output=True,
                       text=True, timeout=120, env=_env())
    assert r.returncode == 1 and r.stderr.strip().startswith("--device cuda: "), (r.returncode, r.stderr[-2000:])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "script,flags",
    [("ddp_train.py", []), ("fsdp_train.py", []), ("fsdp_train.py", ["--replicas", "2"]),
     ("fsdp_train.py", ["--fsdp1", "--replicas", "2"])],
    ids=["ddp", "fsdp2", "hsdp", "fsdp1_hybrid"],
)
def test_the_examples_on_a_gpu(script, flags):
    """What a user runs first on a GPU machine: the examples with their ranks
    on CUDA (two ranks, sharing the GPU where there is one: the Gloo
    transport). CUDA's kernels round unlike the CPU's: the figures, not the
    CPU runs' accuracy."""
    if GPU_SKIP:
        pytest.skip(GPU_SKIP)
    out = _torchrun(script, "--epochs", "1", "--device", "cuda", *flags, env={"LIONBIT_CUDA_TRANSPORT": "gloo"})
    assert "2 ranks on cuda" in out, out
    assert 1.0 <= _times_one_bit(out) <= 1.05, out
    assert _accuracy(out) > 20.0, out
    if script == "ddp_train.py":
        assert "replicas identical: True" in out, out
