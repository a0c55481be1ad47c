"""Resuming a torch.distributed.checkpoint checkpoint on another number of
ranks with lionbit.ElasticLoadPlanner (docs/checkpoints.md): a user's loop
trains on N ranks and saves through DCP; the job comes back on M != N ranks
(a node lost, nodes added) and loads with the planner. The same for a
consolidated full_state_dict=True file that rank 0 torch.save-d and every
rank reads ("full": torch's set_optimizer_state_dict distributes its rows;
"full-plain": without full_state_dict=True, the rows reach lionbit whole).

Checked against references computed here, apart from lionbit:
- the parameters and the hyperparameters (the learning rate changed before
  the save) come back as saved, bitwise;
- every worker's momentum is the mean of the N saved momenta (numpy,
  float64) to float32's rounding (bfloat16 momenta: to bfloat16's), the same
  bits on every worker;
- the steps after the restart (DDP) equal test_optim's ReferenceLion, numpy
  Distributed Lion of M workers started from the loaded parameters and
  momenta and fed the ranks' own gradients, bit for bit; FSDP2's equal DDP's
  from the same checkpointed state;
- on the same number of ranks the planner resumes as DCP's default does:
  bitwise as a run that never stopped (one rank too, whose momenta are
  plain);
- one rank's checkpoint loads on M ranks as every rank's momentum, and N
  ranks' on one rank or in a process without a process group as their
  mean;
- HSDP on another mesh: the nodes' momenta resharded where the number of
  nodes stays, their mean where it changes; FSDP2 beside tensor
  parallelism on another number of dp ranks: the mean;
- a state dict refused after some momenta were averaged changes none.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from test_fsdp import LION, _loss, _net
from test_fsdp_tp import K as TP_K
from test_optim import ReferenceLion

K, J = 4, 3  # steps before the save, after the restart
LR_AFTER = 0.005  # the learning rate set before step K - 1 (a schedule's change the checkpoint carries)
F32_EPS = float(np.finfo(np.float32).eps)


def _wrap(kind, seed, mesh_shape=None, device="cpu"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device == "cuda":  # every rank on the machine's GPU(s), round robin
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    model = _net(seed).to(device)
    if kind == "ddp":
        return model, DDP(model, bucket_cap_mb=0.0005)  # several buckets
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if kind == "hsdp":
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _params(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).tolist() for p in model.parameters()]


def _rows(kind, model, opt):
    """Every worker's momentum, a (workers, *shape) list a parameter."""
    if kind == "ddp":
        out = []
        for p in model.parameters():
            m = opt.state[p]["exp_avg"].float()
            parts = [torch.empty_like(m) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, m)
            out.append(torch.stack(parts).tolist())
        return out
    momentum = opt.sharded_state_dict()["momentum"]
    return [momentum[name].full_tensor().float().tolist() for name, _ in model.named_parameters()]


def _state_dict(net, opt, how):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if how == "stateful":  # dcp.save / dcp.load of the optimizer object
        return {"model": net.state_dict(), "optim": opt}
    if how == "sharded":  # FSDP2's lionbit form
        return {"model": net.state_dict(), "optim": opt.sharded_state_dict()}
    if how.startswith("full"):  # consolidated: every rank's momentum stacked, on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        model_sd, optim_sd = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"model": model_sd, "optim": optim_sd}
    model_sd, optim_sd = get_state_dict(net, opt, options=_options(how))
    return {"model": model_sd, "optim": optim_sd}


def _options(how):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=how == "flattened")  # torchtitan's: flattened


def _train(model, net, opt, rank, steps, grads=None):
    for step in steps:
        if step == K - 1:
            for g in opt.param_groups:
                g["lr"] = LR_AFTER
        opt.zero_grad()
        _loss(net, rank, step).backward()
        if grads is not None:  # every rank's own gradient (what step() reads), for the reference
            mine = []
            for p in model.parameters():
                parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, p.grad.contiguous())
                mine.append(parts)
            grads.append([[parts[r].cpu().tolist() for parts in mine] for r in range(dist.get_world_size())])
        opt.step()


def elastic(rank, world_size, path, kind, phase, **kw):
    """The user's loop: ``phase`` "save" trains K steps, saves, trains J more
    (the run that never stopped); "load" builds everything afresh (another
    seed, another lr), loads with the planner, trains J steps. "mean" in the
    result: what lionbit warned of a mean of saved momenta."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _elastic(rank, path, kind, phase, **kw)
    return {**out, "mean": sorted({str(w.message) for w in caught if "the checkpoint holds" in str(w.message)})}


def _elastic(rank, path, kind, phase, how="get/set", momentum_dtype=None, mesh_shape=None, plan=True, older=False,
             device="cpu"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import lionbit

    md = getattr(torch, momentum_dtype) if momentum_dtype else None
    model, net = _wrap(kind, 0 if phase == "save" else 7, mesh_shape, device)
    opt = lionbit.DistributedLion(net.parameters(), momentum_dtype=md, **{**LION, "lr": LION["lr"] if
                                                                          phase == "save" else 0.5})
    opt.attach(net)
    out = {}
    if phase == "save":
        _train(model, net, opt, rank, range(K))
        sd = _state_dict(net, opt, how)
        if older:  # as a lionbit before HSDP's mesh layout entry wrote it
            from test_hsdp_dcp import _drop_mesh_layout

            _drop_mesh_layout(sd["optim"])
        if how.startswith("full"):  # one consolidated file, every rank's momentum (rank 0 writes it)
            if rank == 0:
                torch.save(sd, path + ".pt")
            dist.barrier()
        else:
            dcp.save(sd, checkpoint_id=path)
        out["saved"] = {"params": _params(model), "rows": _rows(kind, model, opt)}
    elif how.startswith("full"):  # every rank reads the consolidated file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sd = torch.load(path + ".pt", weights_only=False)
        set_model_state_dict(net, sd["model"], options=StateDictOptions(full_state_dict=True))
        # "full": torch distributes the rows over the mesh; "full-plain": they reach lionbit as saved
        set_optimizer_state_dict(net, opt, sd["optim"], options=StateDictOptions(full_state_dict=how == "full"))
        out["loaded"] = _loaded(model, kind, opt)
    else:
        sd = _state_dict(net, opt, how)
        if not plan:
            from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

            try:
                dcp.load(sd, checkpoint_id=path)
                return {"error": None}
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported to the test
                return {"error": f"{type(err).__name__}: {err}"}
        dcp.load(sd, checkpoint_id=path, planner=lionbit.ElasticLoadPlanner())
        if how in ("get/set", "flattened"):
            set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=_options(how))
        else:
            net.load_state_dict(sd["model"])
            if how == "sharded":
                opt.load_sharded_state_dict(sd["optim"])
        out["loaded"] = _loaded(model, kind, opt)
    grads = [] if kind == "ddp" and phase == "load" else None
    _train(model, net, opt, rank, range(K, K + J), grads)
    out["after"] = _params(model)
    if grads is not None and rank == 0:
        out["grads"] = grads
    return out


def _loaded(model, kind, opt):
    return {"params": _params(model), "rows": _rows(kind, model, opt),
            "hyper": [(g["lr"], g["step"]) for g in opt.param_groups],
            "dtypes": sorted({str(st["exp_avg"].dtype) for st in opt.state.values()})}


def _run(n, path, kind, phase, env=None, **kw):
    return values(run_ranks("test_elastic_resume:elastic", n, kwargs=dict(path=path, kind=kind, phase=phase, **kw),
                            timeout=240, env=env))


def _check_mean(saved_rows, loaded_rows, momentum_dtype=None):
    """Every loaded worker's momentum against the mean of the saved ones."""
    for saved, loaded in zip(saved_rows, loaded_rows):
        saved, loaded = np.asarray(saved, dtype=np.float64), np.asarray(loaded, dtype=np.float64)
        mean = saved.mean(axis=0)
        scale = np.abs(saved).max(axis=0)
        if momentum_dtype == "bfloat16":
            tol = 2.0 ** -8 * np.maximum(np.abs(mean), scale * 2.0 ** -16) + 4 * F32_EPS * scale
        else:
            tol = 4 * F32_EPS * scale  # float32 sums of a few rows, a division
        assert np.all(np.abs(loaded - mean) <= tol), np.abs(loaded - mean).max()
        assert all(np.array_equal(row, loaded[0]) for row in loaded), "workers loaded different momenta"
        assert np.abs(mean).max() > 0


def _ddp_resumes(path, how, sizes, n=3, **kw):
    saved = _run(n, path, "ddp", "save", how=how, **kw)
    assert len({str(r["after"]) for r in saved}) == 1
    state = saved[0]["saved"]
    assert len(state["rows"][0]) == n and (n == 1 or state["rows"][0][0] != state["rows"][0][1])  # each rank's own
    out = []
    for m in sizes:
        res = _run(m, path, "ddp", "load", how=how, **kw)
        out.append(res)
        held = (f"the momenta of {n} workers" if n > 1 else "one momentum a parameter (a run of one worker's; or, "
                "where the script handed DCP a dict it made, one rank's copy of each)")
        for r in res:
            loaded = r["loaded"]
            assert loaded["params"] == state["params"]
            assert loaded["hyper"] == [[LR_AFTER, K]]
            assert r["after"] == res[0]["after"]
            assert len(r["mean"]) == (m != n) and all(f"holds {held} and this run has {m} " in w
                                                      for w in r["mean"]), r["mean"]
        if m == n:  # the same number of ranks: every rank its own momentum, bitwise as never stopped
            assert res[0]["loaded"]["rows"] == state["rows"]
            assert res[0]["after"] == saved[0]["after"]
            continue
        if n == 1:  # one worker's momentum on every rank, as saved
            assert res[0]["loaded"]["rows"] == [rows * m for rows in state["rows"]]
        else:
            _check_mean(state["rows"], res[0]["loaded"]["rows"])
        # the steps after it: numpy Distributed Lion of m workers from the loaded state, the ranks' own gradients
        ref = ReferenceLion([torch.tensor(p) for p in loaded["params"]], m, LR_AFTER, LION["betas"],
                            LION["weight_decay"], "vote")
        ref.m = [[np.asarray(rows[w], dtype=np.float32) for rows in loaded["rows"]] for w in range(m)]
        for step_grads in res[0]["grads"]:
            ref.step([[np.asarray(g, dtype=np.float32) for g in rank_grads] for rank_grads in step_grads])
        assert [x.tolist() for x in ref.x] == res[0]["after"], f"{m} ranks: the steps after the restart"
    return out


@pytest.mark.parametrize("how", ["get/set", "stateful", "full", "full-plain"])
def test_ddp_resumes_on_fewer_and_more_ranks(tmp_path, how):
    _ddp_resumes(str(tmp_path / "ckpt"), how, (2, 4, 1, 3))


@pytest.mark.parametrize("how", ["get/set", "stateful"])
def test_one_rank_checkpoint_resumes_on_one_and_more_ranks(tmp_path, how):
    """A run of one rank (its momenta plain, as single-process Lion's) saved
    through DCP: on one rank again it resumes bitwise; on 2 every rank
    starts from the saved momentum (the mean of one), and is told so."""
    res = _ddp_resumes(str(tmp_path / "ckpt"), how, (1, 2), n=1)
    assert res[1][1]["mean"][0].startswith("dcp.load with lionbit.ElasticLoadPlanner on rank 1: the checkpoint holds")
    assert res[1][1]["mean"][0].endswith("so every worker starts from the saved momentum (a momentum "
                                         "synchronization); the parameters load as saved")


def test_one_rank_checkpoints_move_between_ddp_and_fsdp2(tmp_path):
    """FSDP2 on one rank presents its momenta as one row, DDP's plain: each
    loads the other's one-rank checkpoint (an exact copy, nothing said on
    one rank; on 2, every rank the saved momentum, said)."""
    for saver, loader, m in (("fsdp2", "ddp", 1), ("ddp", "fsdp2", 2)):
        path = str(tmp_path / saver)
        state = _run(1, path, saver, "save")[0]["saved"]
        for r in _run(m, path, loader, "load"):
            assert r["loaded"]["params"] == state["params"]
            assert r["loaded"]["rows"] == [rows * m for rows in state["rows"]], (saver, loader)
            assert len(r["mean"]) == (m > 1), r["mean"]


def test_a_process_without_a_group_loads_a_checkpoint_of_ranks(tmp_path):
    """A single-process script or a notebook (no process group: there
    DistributedLion is single-process Lion) loads the DCP checkpoint of 3
    DDP ranks with the planner, as the docs write it: the parameters and
    hyperparameters as saved, the momentum the ranks' mean, said once; its
    steps after it are numpy Lion's from there."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import lionbit

    path = str(tmp_path / "ckpt")
    state = _run(3, path, "ddp", "save")[0]["saved"]
    assert not dist.is_initialized()
    model = _net(7)
    opt = lionbit.DistributedLion(model.parameters(), **{**LION, "lr": 0.5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_sd, optim_sd = get_state_dict(model, opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=path, planner=lionbit.ElasticLoadPlanner())
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    said = [str(w.message) for w in caught if "the checkpoint holds" in str(w.message)]
    assert len(said) == 1 and "holds the momenta of 3 workers and this run has 1 " in said[0], said
    assert _params(model) == state["params"]
    assert [(g["lr"], g["step"]) for g in opt.param_groups] == [(LR_AFTER, K)]
    loaded = [[opt.state[p]["exp_avg"].tolist()] for p in model.parameters()]
    _check_mean(state["rows"], loaded)
    ref = ReferenceLion([p.detach().clone() for p in model.parameters()], 1, LR_AFTER, LION["betas"],
                        LION["weight_decay"], "vote")
    ref.m = [[np.asarray(rows[0], dtype=np.float32) for rows in loaded]]
    for step in range(K, K + J):
        opt.zero_grad()
        _loss(model, 0, step).backward()
        ref.step([[p.grad.numpy().copy() for p in model.parameters()]])
        opt.step()
    assert [x.tolist() for x in ref.x] == _params(model)


@pytest.mark.gpu
def test_ddp_resumes_on_fewer_ranks_on_cuda(tmp_path):
    """The same on CUDA parameters (3 ranks, then 2, on the machine's GPUs):
    the row sums on the GPU, their all-reduce on the CUDA transport."""
    import lionbit

    if not (lionbit.built_with_cuda and torch.cuda.is_available()):
        pytest.skip("no CUDA device, or lionbit built without its CUDA path")
    _ddp_resumes(str(tmp_path / "ckpt"), "get/set", (2,), device="cuda", env={"LIONBIT_CUDA_TRANSPORT": "gloo"})


def test_bfloat16_momenta_load_as_their_mean(tmp_path):
    path = str(tmp_path / "ckpt")
    state = _run(2, path, "ddp", "save", momentum_dtype="bfloat16")[0]["saved"]
    res = _run(3, path, "ddp", "load", momentum_dtype="bfloat16")
    assert res[0]["loaded"]["dtypes"] == ["torch.bfloat16"]
    _check_mean(state["rows"], res[0]["loaded"]["rows"], "bfloat16")


@pytest.mark.parametrize("how", ["get/set", "sharded", "full", "full-plain"])
def test_fsdp2_resumes_on_more_ranks_as_ddp_does(tmp_path, how):
    """FSDP2 on 2 ranks (whose steps equal DDP's, test_fsdp) saved, loaded on
    3 (FSDP pads every shard differently): the mean as DDP loads it, and the
    same steps after."""
    ddp_path, fsdp_path = str(tmp_path / "ddp"), str(tmp_path / "fsdp2")
    ddp_saved = _run(2, ddp_path, "ddp", "save")[0]["saved"]
    fsdp_saved = _run(2, fsdp_path, "fsdp2", "save", how=how)[0]["saved"]
    assert fsdp_saved == ddp_saved
    ddp = _run(3, ddp_path, "ddp", "load")
    fsdp = _run(3, fsdp_path, "fsdp2", "load", how=how)
    for r in fsdp:
        assert r["loaded"]["params"] == fsdp_saved["params"]
        assert r["loaded"]["hyper"] == [[LR_AFTER, K]]
        assert r["loaded"]["rows"] == ddp[0]["loaded"]["rows"]
        assert r["after"] == ddp[0]["after"]
    _check_mean(fsdp_saved["rows"], fsdp[0]["loaded"]["rows"])


@pytest.mark.parametrize("how", ["get/set", "sharded", "flattened", "full", "full-plain"])
def test_hsdp_resumes_on_another_mesh(tmp_path, how):
    """HSDP on 2 nodes of 2 ranks saved; loaded on one node of 4 and on 3
    nodes of 1 (the mean of the 2 nodes' momenta), on 2 nodes of 1 (each
    node's momentum resharded: exact), and as FSDP2 on a 1-D mesh of 3 ranks
    (the mean) and of 2 (exact). Then FSDP2 on a 1-D mesh of 4 saved, loaded
    as HSDP on 2 nodes of 2 (the mean of 4). ("full" skips the 1-D loads:
    torch's full_state_dict loader stops on the HSDP groups' mesh record,
    which a 1-D state dict lacks; docs/checkpoints.md.)"""
    path, flat = str(tmp_path / "hsdp"), str(tmp_path / "flat")
    state = _run(4, path, "hsdp", "save", how=how, mesh_shape=(2, 2))[0]["saved"]
    assert len(state["rows"][0]) == 2 and state["rows"][0][0] != state["rows"][0][1]
    for kind, shape in (("hsdp", (1, 4)), ("hsdp", (3, 1)), ("hsdp", (2, 1)), ("fsdp2", (3,)), ("fsdp2", (2,))):
        if how == "full" and kind == "fsdp2":  # torch's own KeyError: 'param_groups.0.lionbit_mesh' (docs)
            continue
        res = _run(int(np.prod(shape)), path, kind, "load", how=how, mesh_shape=shape)
        for r in res:
            assert r["loaded"]["params"] == state["params"], shape
            assert r["loaded"]["hyper"] == [[LR_AFTER, K]], shape
            assert r["after"] == res[0]["after"], shape
        if int(np.prod(shape[:-1] if kind == "hsdp" else shape)) == 2:
            assert res[0]["loaded"]["rows"] == state["rows"], shape
        else:
            _check_mean(state["rows"], res[0]["loaded"]["rows"])
    state = _run(4, flat, "fsdp2", "save", how=how)[0]["saved"]
    res = _run(4, flat, "hsdp", "load", how=how, mesh_shape=(2, 2))
    assert res[0]["loaded"]["params"] == state["params"]
    _check_mean(state["rows"], res[0]["loaded"]["rows"])


def test_an_hsdp_checkpoint_without_the_mesh_layout_loads_through_the_planner(tmp_path):
    """One written before the layout entry existed: on the same mesh exact, on another the mean."""
    path = str(tmp_path / "older")
    state = _run(4, path, "hsdp", "save", mesh_shape=(2, 2), older=True)[0]["saved"]
    for shape in ((2, 2), (1, 4)):
        res = _run(4, path, "hsdp", "load", mesh_shape=shape)
        assert res[0]["loaded"]["params"] == state["params"], shape
        if shape[0] == 2:
            assert res[0]["loaded"]["rows"] == state["rows"]
        else:
            _check_mean(state["rows"], res[0]["loaded"]["rows"])


def test_without_the_planner_dcp_refuses_another_number_of_ranks(tmp_path):
    """What the docs tell a user who meets it: DCP's own size check of the
    momenta, before anything is loaded."""
    path = str(tmp_path / "ckpt")
    _run(2, path, "ddp", "save")
    for r in _run(3, path, "ddp", "load", plan=False):
        assert "Size mismatch between saved torch.Size([2, 33, 12]) and current: torch.Size([3, 33, 12])" \
            in r["error"], r["error"]


def tp_elastic(rank, world_size, path, dp, tp):
    """test_fsdp_tp's model on dp x tp: the dp 2 x tp 2 checkpoint that
    test_fsdp_tp.fsdp_tp_reshard wrote, loaded with the planner; returns
    whether every parameter is as written and, from rank 0, the written and
    the read momenta (dp rows, each placed over tp as its parameter)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit
    from test_fsdp_tp import _build, _consolidated, _dp_index

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model, opt = _build(mesh, 1, lr=0.123)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(path, "ckpt"), planner=lionbit.ElasticLoadPlanner())
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    read = _consolidated(model, opt)
    written = torch.load(os.path.join(path, "written.pt"), weights_only=False)
    out = {"params": read["params"].keys() == written["params"].keys()
           and all(torch.equal(read["params"][k], v) for k, v in written["params"].items())}
    if rank == 0:
        out["written"] = {k: v.tolist() for k, v in written["momenta"].items()}
        out["read"] = {k: v.tolist() for k, v in read["momenta"].items()}
    from test_fsdp_tp import _loss as tp_loss

    tp_loss(model, _dp_index(mesh), TP_K).backward()  # and a step runs
    opt.step()
    out["steps"] = opt.steps_taken
    return out


def test_fsdp_tp_resumes_on_another_number_of_dp_ranks(tmp_path):
    """FSDP2 beside tensor parallelism (torchtitan's 2-D): dp 2 x tp 2
    saved; loaded on dp 1 x tp 2 and dp 3 x tp 1: the parameters as written,
    every dp rank's momentum the mean of the 2 saved (the rows' other dims
    placed over tp by DCP's resharding)."""
    run_ranks("test_fsdp_tp:fsdp_tp_reshard", 4, kwargs=dict(path=str(tmp_path), tp=2), timeout=240)
    for dp, tp in ((1, 2), (3, 1)):
        res = values(run_ranks("test_elastic_resume:tp_elastic", dp * tp, kwargs=dict(path=str(tmp_path), dp=dp,
                                                                                      tp=tp), timeout=240))
        assert all(r["params"] and r["steps"] == TP_K + 1 for r in res), (dp, tp)
        written, read = res[0]["written"], res[0]["read"]
        assert written.keys() == read.keys()
        for name in written:
            assert len(read[name]) == dp, (name, dp)
            _check_mean([written[name]], [read[name]])


def elastic_bad_entry(rank, world_size, path):
    """The 3-rank DDP checkpoint loaded on 2 with the planner, one momentum
    of the state dict then replaced by a tensor of the wrong shape (after
    the others, which the loader averages first): load_state_dict raises on
    every rank, naming it, and no momentum has changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import lionbit

    model, net = _wrap("ddp", 7)
    opt = lionbit.DistributedLion(net.parameters(), **LION)
    opt.attach(net)
    model_sd, optim_sd = get_state_dict(net, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path, planner=lionbit.ElasticLoadPlanner())
    before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    last = list(sd["optim"]["state"])[-1]
    sd["optim"]["state"][last] = {**sd["optim"]["state"][last], "exp_avg": torch.zeros(5)}
    try:
        opt.load_state_dict(sd["optim"])
        error = "no error"
    except ValueError as err:
        error = str(err)
    unchanged = all(torch.equal(b, opt.state[p]["exp_avg"]) for b, p in zip(before, model.parameters()))
    return {"error": error, "unchanged": unchanged}


def test_a_bad_entry_after_averaged_ones_changes_no_momentum(tmp_path):
    path = str(tmp_path / "ckpt")
    _run(3, path, "ddp", "save")
    for r in values(run_ranks("test_elastic_resume:elastic_bad_entry", 2, kwargs=dict(path=path))):
        assert "DistributedLion.load_state_dict on rank" in r["error"] and "has shape (5,)" in r["error"], r["error"]
        assert r["unchanged"]
