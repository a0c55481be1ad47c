"""torch's private names, fenced: every one lionbit uses is listed in
lionbit.torch_internals.NAMES and used only there; each is checked against the
installed torch through the function lionbit calls, on real ranks (FSDP1 and
FSDP2 models, GradScaler, a backward pass). A torch release that removes or
changes one fails its own test here, naming what of lionbit it breaks."""

import ast
from pathlib import Path

import pytest
import torch

from harness import run_ranks, values

PKG = Path(__file__).resolve().parents[2] / "python" / "lionbit"
FENCE = "torch_internals.py"
# Private names that are not torch's: CPython's, and lionbit's own extensions'.
NOT_TORCH = {"_getframe": "CPython's sys._getframe (user_warning.py: the caller's frame)"}
OWN_EXTENSIONS = {"_C", "_test_hooks"}


def _names():
    from lionbit.torch_internals import NAMES

    return NAMES


# -- the fence: no module but torch_internals.py uses a private name of torch ------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_by_lionbit(trees) -> set:
    """Private names lionbit defines itself: functions, classes, variables, arguments,
    attributes it assigns, its own modules."""
    out = {Path(f).stem for f in trees} | OWN_EXTENSIONS
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
    return out


def _private_imports(n) -> list:
    """The private parts of torch modules an import statement names."""
    if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "torch":
        dotted = [n.module] + [a.name for a in n.names]
    elif isinstance(n, ast.Import):
        dotted = [a.name for a in n.names if a.name.split(".")[0] == "torch"]
    else:
        return []
    return [part for d in dotted for part in d.split(".") if _private(part)]


def _private_name_used(n):
    """The private name an attribute access or a getattr / hasattr / setattr with a constant uses."""
    if isinstance(n, ast.Attribute) and _private(n.attr):
        if not (isinstance(n.value, ast.Name) and n.value.id in OWN_EXTENSIONS):  # lionbit._C's own
            return n.attr
    elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr", "setattr")
          and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
          and _private(n.args[1].value)):
        return n.args[1].value
    return None


def uses_outside_the_fence(sources: dict) -> list:
    """file name -> text, for the package's modules: every use of a private name that lionbit
    does not define itself, outside the fence, as 'file:line: name'."""
    trees = {f: ast.parse(text, f) for f, text in sources.items() if f != FENCE}
    own = _defined_by_lionbit(trees)
    found = []
    for file, tree in trees.items():
        for n in ast.walk(tree):
            found += [f"{file}:{n.lineno}: imports torch's private {part}" for part in _private_imports(n)]
            name = _private_name_used(n)
            if name is not None and name not in own and name not in NOT_TORCH:
                found.append(f"{file}:{n.lineno}: {name}")
    return found


def _package_sources() -> dict:
    return {p.name: p.read_text() for p in sorted(PKG.glob("*.py"))}


def test_no_module_but_torch_internals_uses_torchs_private_names():
    found = uses_outside_the_fence(_package_sources())
    assert not found, ("private names of torch used outside lionbit/torch_internals.py (add a function there, "
                       "with why, and an entry in NAMES):\n" + "\n".join(found))


def test_the_fence_check_finds_a_planted_use():
    """The scan is not vacuous: a module that imports a private torch module and
    reads FSDP1's _handle and _comm_hook is caught; the same code in the fence is not."""
    planted = ("import torch.distributed.fsdp._traversal_utils as t\n"
               "def f(state):\n    return state._handle, getattr(state, '_comm_hook', None)\n")
    found = uses_outside_the_fence({**_package_sources(), "planted.py": planted})
    assert sorted(found) == ["planted.py:1: imports torch's private _traversal_utils", "planted.py:3: _comm_hook",
                             "planted.py:3: _handle"], found
    assert uses_outside_the_fence({**_package_sources(), FENCE: planted}) == []


def test_every_name_says_why_and_is_used_in_the_fence():
    text = (PKG / FENCE).read_text()
    for n in _names():
        assert n.why and n.torch in ("all", "2.11", ">=2.12"), n
        attr = n.name.rsplit(".", 1)[-1]
        assert text.count(attr) >= 2, f"{n.name}: listed in NAMES but not used in {FENCE}"


# -- each name against the installed torch, through lionbit's own function ----------------------------


def probe(rank, world_size):
    """On each rank: every function of torch_internals on real objects; name -> None (works),
    'skip: why', or what went wrong."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.amp.grad_scaler import OptState
    from torch.distributed.fsdp import FSDPModule

    import lionbit
    from lionbit import fsdp1, torch_internals as ti
    from test_fsdp import _loss, _net, _shard
    from test_fsdp1 import _wrap

    gen = ti.generation()
    out = {}

    class Skip(Exception):
        pass

    def check(name, fn):
        entry = next(n for n in ti.NAMES if n.name == name)
        if entry.torch not in ("all", gen):
            out[name] = f"skip: torch {entry.torch} only (this is {torch.__version__})"
            return
        try:
            out[name] = None if fn() else "lionbit's function did not give what torch used to"
        except Skip as why:
            out[name] = f"skip: {why}"
        except Exception as err:  # noqa: BLE001 - reported per name
            out[name] = f"{type(err).__name__}: {err}"

    cpu = torch.device("cpu")
    pg = ti.default_group()
    check("torch.distributed.distributed_c10d._get_default_group", lambda: pg is dist.group.WORLD)
    check("ProcessGroup._get_backend", lambda: isinstance(ti.backend_object(pg, cpu), lionbit._C.LionBitBackend))
    gloo = dist.new_group(backend="gloo")  # (every rank, in the same order)
    check("ProcessGroup._get_backend_name", lambda: ti.backend_name(gloo) == "gloo")

    wrapped = []

    def debug_wrapped():  # a lionbit group made under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps its backend
        if not wrapped:
            level = dist.get_debug_level()
            dist.set_debug_level(dist.DebugLevel.DETAIL)
            try:
                g = dist.new_group(backend="lionbit")  # (every rank, in the same order)
            finally:
                dist.set_debug_level(level)
            raw = g._get_backend(cpu)
            wrapped.append(isinstance(raw, dist.distributed_c10d._ProcessGroupWrapper)
                           and isinstance(ti.backend_object(g, cpu), lionbit._C.LionBitBackend))
        return wrapped[0]

    check("torch.distributed.distributed_c10d._ProcessGroupWrapper", debug_wrapped)
    check("_ProcessGroupWrapper.wrapped_pg", debug_wrapped)

    def nccl_timeout():
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise Skip("this torch has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        ti.set_nccl_timeout(opts, timedelta(seconds=7))
        return opts._timeout == timedelta(seconds=7)

    check("ProcessGroupNCCL.Options._timeout", nccl_timeout)

    def version():
        t = torch.zeros(3)
        v0 = ti.version(t)
        t.add_(1)
        return ti.version(t) == v0 + 1

    check("Tensor._version", version)

    def base():
        t = torch.zeros(2, 3)
        return ti.view_base(t.view(-1)) is t and ti.view_base(t) is t

    check("Tensor._base", base)

    def backward_callbacks():
        x = torch.ones(2, requires_grad=True)
        seen = []

        def hook(g):
            seen.append(ti.in_backward())
            ti.queue_after_backward(lambda: seen.append("after"))
            return g

        x.register_hook(hook)
        (x * 2).sum().backward()
        return seen == [True, "after"] and not ti.in_backward()

    check("torch.autograd.Variable._execution_engine.queue_callback", backward_callbacks)
    check("torch._C._current_graph_task_id", backward_callbacks)

    def dispatch_mode():
        from torch.utils.flop_counter import FlopCounterMode

        outside = ti.in_dispatch_mode()
        with FlopCounterMode(display=False):
            inside = ti.in_dispatch_mode()
        return hasattr(torch._C, "_len_torch_dispatch_stack") and not outside and inside

    check("torch._C._len_torch_dispatch_stack", dispatch_mode)

    def optimizer_hooks(when):
        def run():
            opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
            register = getattr(opt, f"register_{when}_hook")
            hook = (lambda *a: None)
            register(hook)
            return ti.state_dict_hooks(opt, when) == [hook]

        return run

    check("Optimizer._optimizer_state_dict_pre_hooks", optimizer_hooks("state_dict_pre"))
    check("Optimizer._optimizer_state_dict_post_hooks", optimizer_hooks("state_dict_post"))
    check("Optimizer._optimizer_load_state_dict_pre_hooks", optimizer_hooks("load_state_dict_pre"))
    check("Optimizer._optimizer_load_state_dict_post_hooks", optimizer_hooks("load_state_dict_post"))

    def compiled():
        net = torch.nn.Linear(2, 2)
        return ti.compiled_inner(torch.compile(net)) is net and ti.compiled_inner(net) is net

    check("OptimizedModule._orig_mod", compiled)

    # composable replicate(): its DDP, built at attach before any forward; a model with fully_shard-ed parts
    def replicated():
        from torch.distributed._composable.replicate import replicate
        from torch.nn.parallel import DistributedDataParallel

        net = replicate(torch.nn.Linear(3, 2))
        ddp = ti.replicate_ddp(net, "probe")
        params = list(ddp.module.parameters())
        return (ti.is_replicated(net) and not ti.is_replicated(torch.nn.Linear(1, 1))
                and isinstance(ddp, DistributedDataParallel) and len(params) == 2
                and all(a is b for a, b in zip(params, net.parameters())) and ti.replicate_ddp(net, "probe") is ddp)

    for name in ("DDP", "_ReplicateState._ddp", "_ReplicateState.lazy_init"):
        check(f"torch.distributed._composable.replicate.{name}", replicated)

    def mixed():
        from torch.distributed._composable.replicate import replicate
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        fully_shard(net[0], mesh=init_device_mesh("cpu", (world_size,)))
        replicate(net)
        try:
            ti.replicate_ddp(net, "probe")
        except NotImplementedError as err:
            return "fully_shard-ed parts" in str(err)
        return False

    check("torch.distributed._composable.contract._get_registry", mixed)

    def comm_hook_names():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        plain, python, builtin = (DDP(torch.nn.Linear(2, 2)) for _ in range(3))
        python.register_comm_hook(None, default_hooks.bf16_compress_hook)
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        return [ti.ddp_comm_hook_name(m) for m in (plain, python, builtin)] == [
            None, "bf16_compress_hook", "BuiltinCommHookType.FP16_COMPRESS"]

    check("DistributedDataParallel._get_ddp_logging_data", comm_hook_names)

    # torch fills a fresh optimizer's state by a step() on zero gradients: lionbit must see that it is that one.
    def init_optim_state():
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        net = torch.nn.Linear(3, 2)
        opt = lionbit.DistributedLion(net.parameters(), lr=0.1)
        seen = []
        real = ti.initializing_optimizer_state
        ti.initializing_optimizer_state = lambda: seen.append(real()) or seen[-1]
        try:
            _init_optim_state(opt)
        finally:
            ti.initializing_optimizer_state = real
        return seen == [True] and opt.steps_taken == 0 and len(opt.state) == 2 and not real()

    check("torch.distributed.checkpoint.state_dict._init_optim_state", init_optim_state)

    # set_optimizer_state_dict unflattens a flattened state dict into the optimizer's own keys: lionbit must know.
    def flattened_load():
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        net = torch.nn.Linear(3, 2)
        opt = lionbit.DistributedLion(net.parameters(), lr=0.1)
        seen = []
        real = opt.load_state_dict

        def spy(state_dict):
            seen.append(ti.loading_flattened_optimizer_state())
            return real(state_dict)

        opt.load_state_dict = spy
        for flatten in (True, False):
            options = StateDictOptions(flatten_optimizer_state_dict=flatten)
            set_optimizer_state_dict(net, opt, get_optimizer_state_dict(net, opt, options=options), options=options)
        return seen == [True, False] and not ti.loading_flattened_optimizer_state()

    check("torch.distributed.checkpoint.state_dict._load_optim_state_dict", flattened_load)

    def scaler():
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.1)
        s = torch.amp.GradScaler("cpu", init_scale=8.0)
        s.scale((w * 2).sum()).backward()
        ready = ti.scaler_stage(s, opt) is OptState.READY
        s.unscale_(opt)
        found = ti.scaler_found_inf(s, opt)
        return (ready and ti.scaler_stage(s, opt) is OptState.UNSCALED and torch.equal(w.grad, torch.full((4,), 2.0))
                and all(v.item() == 0.0 for v in found.values()))

    check("GradScaler._per_optimizer_states", scaler)
    check("GradScaler._found_inf_per_device", scaler)

    # FSDP1: three instances (a, b, root), both use_orig_params.
    for use_orig in (False, True):
        model = _wrap(_net(0), "FULL_SHARD", use_orig)
        states = ti.fsdp1_states(model)
        check("torch.distributed.fsdp._traversal_utils._get_fsdp_states",
              lambda: len(states) == 3 and states[0] is model)

        def layout():
            # every parameter of the model, by name and size, in exactly one instance's spans
            spans = {}
            for state, prefix in zip(states, ("", "a.", "b.")):
                lay = ti.fsdp1_layout(state)
                if sum(numel for numel, _, _ in lay.spans) != lay.unpadded_numel or lay.use_orig_params != use_orig:
                    return False
                spans.update({prefix + fqn: numel for numel, padding, fqn in lay.spans if not padding})
            return spans == {n: p.numel() for n, p in _net(0).named_parameters()}

        for name in ("FullyShardedDataParallel._handle", "FlatParamHandle._use_orig_params",
                     "FlatParameter._numels_with_padding", "FlatParameter._is_padding_mask", "FlatParameter._fqns",
                     "FlatParameter._unpadded_unsharded_size"):
            check(name, layout)
        if use_orig:
            check("FlatParameter._params", lambda: all(isinstance(p, torch.nn.Parameter)
                                                      for s in states for p in ti.fsdp1_layout(s).params))

        def saved_grad_shard():
            _loss(model, rank, 0).backward()
            with model.no_sync():
                _loss(model, rank, 1).backward()
            fp = ti.fsdp1_layout(states[0]).flat_param
            saved = ti.fsdp1_saved_grad_shard(fp)
            return saved is not None and saved.numel() == fp.numel()

        check("FlatParameter._saved_grad_shard", saved_grad_shard)
        model.zero_grad(set_to_none=True)

        def comm_hook():
            opt = lionbit.DistributedLion(model.parameters(), lr=0.01).attach(model)
            hooked = all(ti.fsdp1_comm_hook(s) is fsdp1._fsdp1_hook for s in states)
            own = len({id(s._comm_hook_state) for s in states}) == 3
            opt.detach()
            return hooked and own and all(ti.fsdp1_comm_hook(s) is None for s in states)

        check("FullyShardedDataParallel._comm_hook", comm_hook)
        check("FullyShardedDataParallel._comm_hook_state", comm_hook)

    # FSDP1 over the dp dim sliced out of a (dp, tp) mesh: the DTensor extension it sets (the plain model: none).
    def sliced():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
        inner = FSDP(torch.nn.Linear(4, 4), device_mesh=mesh["dp"], device_id=torch.device("cpu"))
        return ti.fsdp1_on_a_sliced_mesh(inner) and not ti.fsdp1_on_a_sliced_mesh(states[0])

    check("FullyShardedDataParallel._fsdp_extension", sliced)

    # FSDP1 hybrid sharding: 2 nodes x 1 rank; the hook set without register_comm_hook.
    from test_fsdp1_hybrid import hybrid_probe

    hybrid = {}

    def hybrid_hooked():
        if not hybrid:
            hybrid["ok"] = hybrid_probe(rank, world_size)
        return hybrid["ok"]

    check("FullyShardedDataParallel._inter_node_pg", hybrid_hooked)
    if out["FullyShardedDataParallel._comm_hook"] is None:
        check("FullyShardedDataParallel._comm_hook", hybrid_hooked)

    # FSDP2: three units (a, b, root).
    model = _shard(_net(0))
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in ti.fsdp2_param_groups(m, "probe")]
    check("FSDPModule._get_fsdp_state", lambda: len(groups) == 3)
    check("FSDPState._fsdp_param_groups", lambda: len(groups) == 3)
    check("FSDPState._fsdp_param_group", lambda: len(groups) == 3)
    pg0 = groups[0]
    check("FSDPParamGroup._reduce_scatter_comm",
          lambda: type(ti.fsdp2_reduce_scatter_comm(pg0, "probe")).__name__ == "DefaultReduceScatter")
    check("FSDPParamGroup._all_reduce_hook",
          lambda: hasattr(pg0, "_all_reduce_hook") and ti.fsdp2_all_reduce_hook(pg0) is None)

    def unit_names():
        _loss(model, rank, 0)  # FSDP names its units at the first forward
        return sorted(ti.fsdp2_unit_name(g) for g in groups) == ["<root>", "a", "b"]

    check("FSDPParamGroup._module_fqn", unit_names)
    global_shapes = {n: tuple(p.shape) for n, p in _net(0).named_parameters()}
    check("FSDPParam._orig_size",
          lambda: sorted(tuple(ti.fsdp2_orig_size(fp)) for g in groups for fp in g.fsdp_params)
          == sorted(global_shapes.values()))

    def local_tensors():
        p = next(model.parameters())
        local = ti.dtensor_local(p)
        with torch.no_grad():
            same = local.data_ptr() == p.to_local().data_ptr() and local.shape == p.to_local().shape
        return same and type(local).__name__ != "DTensor"

    check("DTensor._local_tensor", local_tensors)

    def learned_layouts():
        model = _shard(_net(0))  # (a fresh one: the model above has run a forward)
        groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in ti.fsdp2_param_groups(m, "p")]
        opt = lionbit.DistributedLion(model.parameters(), lr=0.01).attach(model)
        att = opt._attachment
        _loss(model, rank, 0).backward()
        learned = len(att.order) == 3 and all(c.params for c in att.order)
        opt.step()
        opt.detach()
        restored = all(type(ti.fsdp2_reduce_scatter_comm(g, "probe")).__name__ == "DefaultReduceScatter"
                       for g in groups)
        if gen == ">=2.12":
            restored = restored and all(g._prepare_reduce_scatter_inputs.__name__ != "prepare" for g in groups)
        return learned and restored

    for name in ("FSDPParamGroup._prepare_reduce_scatter_inputs",
                 "torch.distributed.fsdp._fully_shard._fsdp_common._get_dim0_padded_size"):
        check(name, learned_layouts)

    def hsdp_reduces_without_all_reduce():
        """HSDP on a 2 x 1 mesh: after backward each replica's p.grad is its own
        gradient (FSDP ran no all-reduce over the replicate group); one step
        later both replicas hold the same parameters."""
        from test_hsdp import hsdp_probe

        return hsdp_probe(rank, world_size)

    check("torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_reduce",
          lambda: learned_layouts() and hsdp_reduces_without_all_reduce())
    return out


_RESULTS = {}


def _results():
    if not _RESULTS:
        per_rank = values(run_ranks("test_torch_internals:probe", 2))
        assert per_rank[0].keys() == per_rank[1].keys()
        _RESULTS.update({k: per_rank[0][k] or per_rank[1][k] for k in per_rank[0]})
    return _RESULTS


def test_every_name_has_a_probe():
    assert set(_results()) == {n.name for n in _names()}


@pytest.mark.parametrize("name", [n.name for n in _names()])
def test_torch_still_has(name):
    got = _results().get(name, "no probe ran")
    if got is not None and got.startswith("skip: "):
        pytest.skip(got[len("skip: "):])
    why = next(n.why for n in _names() if n.name == name)
    assert got is None, (f"torch {torch.__version__}: {name} is gone or changed ({got}); lionbit uses it for: "
                         f"{why} (python/lionbit/torch_internals.py)")
