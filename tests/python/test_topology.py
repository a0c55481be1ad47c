"""lionbit.Topology and detect_topology / check_topology: which ranks share a
node, learned from the launch (torchrun's two "nodes" on one machine, the
LIONBIT_NODE variable, host names) or given by hand, and the same on every
rank."""

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

import lionbit
from harness import run_ranks, values

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- the class ----


def test_from_nodes_numbers_nodes_by_their_smallest_rank():
    t = lionbit.Topology.from_nodes([[3, 2], [1, 0]])
    assert t.nodes == [[0, 1], [2, 3]]
    assert t.node_of == (0, 0, 1, 1)
    assert (t.world_size, t.num_nodes, t.ranks_per_node, t.uniform) == (4, 2, 2, True)
    assert [t.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.node_rank(r) for r in range(4)] == [0, 0, 1, 1]
    interleaved = lionbit.Topology.from_nodes([[0, 2], [1, 3]])
    assert interleaved.node_of == (0, 1, 0, 1)
    assert interleaved.fingerprint() != t.fingerprint()
    assert lionbit.Topology.from_nodes([[1, 0], [2, 3]]).fingerprint() == t.fingerprint()


def test_uneven_nodes_are_a_topology_but_have_no_single_size():
    t = lionbit.Topology.from_nodes([[0, 1, 2], [3]])
    assert not t.uniform
    assert t.describe() == "2 nodes x 1-3 ranks: [[0, 1, 2], [3]]"
    with pytest.raises(ValueError, match="different numbers of ranks"):
        _ = t.ranks_per_node


@pytest.mark.parametrize(
    "nodes, match",
    [
        ([[0, 1], [1, 2]], "repeated: \\[1\\]"),
        ([[0, 1], [3]], "missing: \\[2\\]"),
        ([[0], []], "empty node"),
    ],
)
def test_from_nodes_refuses_what_is_not_a_partition(nodes, match):
    with pytest.raises(ValueError, match=match):
        lionbit.Topology.from_nodes(nodes)


def test_node_of_must_be_numbered_by_smallest_rank():
    with pytest.raises(ValueError, match="smallest rank"):
        lionbit.Topology((1, 1, 0, 0))
    with pytest.raises(ValueError, match="0..M-1"):
        lionbit.Topology((0, 2))
    with pytest.raises(ValueError, match="outside the group"):
        lionbit.Topology((0, 0)).local_rank(2)


# ------------------------------------------------------ detection, by ranks ----


def detect_with_env(rank, world_size, node_of_rank=None, source="auto"):
    import lionbit as lb

    if node_of_rank is not None:
        os.environ["LIONBIT_NODE"] = f"box-{node_of_rank[rank]}"
    else:
        os.environ.pop("LIONBIT_NODE", None)
    os.environ.pop("GROUP_RANK", None)
    t = lb.detect_topology(source=source)
    return {"nodes": t.nodes, "local": t.local_rank(rank)}


def test_lionbit_node_variable_groups_the_ranks():
    # Ranks 0 and 2 on one box, 1 and 3 on another: not consecutive.
    res = values(run_ranks("test_topology:detect_with_env", 4, kwargs={"node_of_rank": [7, 3, 7, 3]}))
    assert all(r == {"nodes": [[0, 2], [1, 3]], "local": [0, 0, 1, 1][i]} for i, r in enumerate(res)), res


def test_host_names_put_every_rank_of_one_machine_on_one_node():
    res = values(run_ranks("test_topology:detect_with_env", 3, kwargs={"source": "hostname"}))
    assert res == [{"nodes": [[0, 1, 2]], "local": i} for i in range(3)]


def _error_of(fn):
    """What fn() raised, as the harness reports a rank's error ("Type: message"),
    or None. The refusals below are collective (every rank raises after the
    same exchange), so the group stays in step and the case can run on the
    module's warm ranks instead of fresh ones."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is the answer
        return f"{type(err).__name__}: {err}"
    return None


def mixed_sources(rank, world_size):
    import lionbit as lb

    os.environ.pop("GROUP_RANK", None)
    if rank == 1:
        os.environ["LIONBIT_NODE"] = "odd"
    else:
        os.environ.pop("LIONBIT_NODE", None)
    return _error_of(lb.detect_topology)


def test_ranks_that_learn_from_different_sources_all_fail():
    for error in values(run_ranks("test_topology:mixed_sources", 3)):
        assert error is not None and "different sources" in error, error
        assert "'env': [1]" in error and "'hostname': [0, 2]" in error, error


def check_given(rank, world_size, differ_on=None):
    import lionbit as lb

    nodes = [[0, 1], [2, 3]] if rank != differ_on else [[0, 2], [1, 3]]
    if differ_on is not None:
        return _error_of(lambda: lb.check_topology(lb.Topology.from_nodes(nodes)))
    return lb.check_topology(lb.Topology.from_nodes(nodes)).nodes


def test_a_hand_given_topology_is_checked_equal_on_every_rank():
    assert values(run_ranks("test_topology:check_given", 4)) == [[[0, 1], [2, 3]]] * 4
    for error in values(run_ranks("test_topology:check_given", 4, kwargs={"differ_on": 2})):
        assert error is not None and "rank(s) [2] hold a different topology" in error, error


def check_wrong_size(rank, world_size):
    import lionbit as lb

    return _error_of(lambda: lb.check_topology(lb.Topology.from_nodes([[0, 1]])))


def test_a_topology_of_another_size_is_refused():
    for error in values(run_ranks("test_topology:check_wrong_size", 3)):
        assert error is not None and "has [2, 2, 2] ranks, the group 3" in error, error


# ------------------------------------------------- torchrun, two "nodes" ----

SCRIPT = """
import json, os, sys
import torch.distributed as dist
import lionbit
dist.init_process_group("lionbit")
t = lionbit.detect_topology()
given = lionbit.check_topology(lionbit.Topology.from_nodes(t.nodes))
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"nodes": t.nodes, "group_rank": os.environ["GROUP_RANK"],
               "local_rank": int(os.environ["LOCAL_RANK"]), "ours": t.local_rank(dist.get_rank()),
               "given": given.nodes}, f)
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes_on_one_machine():
    """torchrun --nnodes 2 --node-rank 0/1 --rdzv-backend c10d, 2 ranks each,
    all on this host: the host names are the same, GROUP_RANK tells the
    nodes apart."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "detect.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LIONBIT_NODE")}
        env["OMP_NUM_THREADS"] = "1"
        procs = [
            subprocess.Popen(
                [
                    torchrun,
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    "2",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    "lionbit-topo",
                    script,
                    out,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in (0, 1)
        ]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
        got = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]
    for g in got:
        assert g["nodes"] == [[0, 1], [2, 3]], got
        assert g["given"] == g["nodes"]
        assert g["ours"] == g["local_rank"], got  # our local rank is torchrun's
    assert got[0]["group_rank"] == got[1]["group_rank"] != got[2]["group_rank"] == got[3]["group_rank"]
