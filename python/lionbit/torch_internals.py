"""Every use lionbit makes of torch's private names, in one module.

Some of what lionbit does has no public API in torch: learning how FSDP lays out
a unit's gradients, running a callback at the end of a backward pass, asking a
process group for its backend object, reading GradScaler's per-optimizer state.
Each function below is the only place its private names are read or written,
with why. ``NAMES`` lists them all; ``tests/python/test_torch_internals.py``
checks each against the installed torch through these functions (a failure
names what torch changed and what of lionbit it breaks) and that no other
module of lionbit uses a private name of torch.

HSDP (FSDP2 on a 2-D mesh): FSDP reduce-scatters a unit's gradients over the
shard group and then all-reduces them over the replicate group, both inside
``foreach_reduce``, with no public switch for the second alone
(``set_requires_all_reduce(False)`` also keeps the result out of ``p.grad``).
lionbit's custom reduce-scatter of an HSDP unit says so
(``LayoutLearner.skips_all_reduce``) and the one wrapper of ``foreach_reduce``
passes that unit no all-reduce group: FSDP then runs its 1-D path over the
shard group (its reduce-scatter, averaging, dtype, accumulation into
``p.grad`` and post-accumulate-grad hooks all unchanged).

FSDP1 hybrid sharding (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``): FSDP1
reduce-scatters inside the node and all-reduces over ``_inter_node_pg``,
unless the instance has a comm hook, which replaces both; the public
``register_comm_hook`` refuses hybrid strategies, so lionbit sets the two
attributes it would set (:func:`fsdp1_set_comm_hook`). lionbit's hook does
the reduce-scatter inside the node itself (a node mean) and the replicas
vote at ``step()``.

Two generations of FSDP2 are known: torch >= 2.12 (a list of parameter groups
per module and a per-group hook ``_prepare_reduce_scatter_inputs`` that returns
the padded sizes) and torch 2.11 (one group per module, and the padded sizes
computed inside ``_fsdp_param_group.foreach_reduce``, which lionbit wraps).
"""

import inspect
import sys
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist


class Name(NamedTuple):
    name: str  # as torch spells it, owner first
    why: str  # what lionbit needs it for
    torch: str = "all"  # "all", or the generation that has it: "2.11" / ">=2.12"


NAMES = (
    # c10d
    Name("torch.distributed.distributed_c10d._get_default_group",
         "the default group, to find its lionbit backend (group=None)"),
    Name("ProcessGroup._get_backend", "the lionbit backend object of a group for a device"),
    Name("ProcessGroup._get_backend_name", "an error naming the backend a group has instead of lionbit"),
    Name("torch.distributed.distributed_c10d._ProcessGroupWrapper",
         "TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in it: lionbit's own calls go to the backend inside"),
    Name("_ProcessGroupWrapper.wrapped_pg", "the backend a debug wrapper checks the collectives of"),
    Name("ProcessGroupNCCL.Options._timeout", "the inner NCCL communicators get the group's timeout"),
    # autograd
    Name("Tensor._version", "whether the user changed p.grad in place between backward() and step()"),
    Name("Tensor._base", "the momentum a flat view was made of (double_buffer's record under FSDP2)"),
    Name("torch.autograd.Variable._execution_engine.queue_callback",
         "a callback at the end of the backward pass (after DDP's and FSDP1's own)"),
    Name("torch._C._current_graph_task_id", "whether a DDP comm hook runs inside a backward or a Join shadow"),
    Name("torch._C._len_torch_dispatch_stack",
         "under a TorchDispatchMode in-place ops bump no version: vote again (optional: absent means none)"),
    Name("DistributedDataParallel._get_ddp_logging_data",
         "attach names the comm hook a user registered on the DDP model (torch's own error on lionbit's would "
         "only say that one can be registered once)"),
    # composable replicate() (DDP underneath)
    Name("torch.distributed._composable.replicate.DDP",
         "whether a module is composable replicate()'s (torchtitan's and OLMo-core's DDP): attach reaches its DDP"),
    Name("torch.distributed._composable.replicate._ReplicateState._ddp",
         "the DistributedDataParallel that replicate() builds over the module's parameters: the comm hook's home"),
    Name("torch.distributed._composable.replicate._ReplicateState.lazy_init",
         "replicate() builds its DDP at the first forward; attach before that builds it then"),
    Name("torch.distributed._composable.contract._get_registry",
         "a replicate()d model with fully_shard-ed parts (which its DDP leaves out) is refused"),
    # torch.optim.Optimizer, torch.compile
    Name("Optimizer._optimizer_state_dict_pre_hooks",
         "DistributedLion's FSDP2 state_dict() runs the hooks users registered, as Optimizer's would"),
    Name("Optimizer._optimizer_state_dict_post_hooks", "the same, after"),
    Name("Optimizer._optimizer_load_state_dict_pre_hooks", "the same for load_state_dict()"),
    Name("Optimizer._optimizer_load_state_dict_post_hooks", "the same for load_state_dict(), after"),
    Name("OptimizedModule._orig_mod", "attach(torch.compile(model)) attaches to the model inside"),
    Name("torch.distributed.checkpoint.state_dict._init_optim_state",
         "get/set_optimizer_state_dict on a fresh optimizer call step() on zero gradients with lr 0 to create "
         "its state: not a step (no count, no momentum synchronization, no collective)"),
    Name("torch.distributed.checkpoint.state_dict._load_optim_state_dict",
         "set_optimizer_state_dict of a flattened state dict (torchtitan's) keeps only the optimizer's own keys: an "
         "HSDP state dict's mesh entries are then missing (dcp.load has checked them)"),
    # GradScaler
    Name("GradScaler._per_optimizer_states", "whether the user already unscaled this optimizer's gradients"),
    Name("GradScaler._found_inf_per_device", "the found-inf tensors that GradScaler.update() reads"),
    # FSDP1
    Name("torch.distributed.fsdp._traversal_utils._get_fsdp_states", "every FSDP1 instance of a model"),
    Name("FullyShardedDataParallel._handle", "an FSDP1 instance's FlatParameter"),
    Name("FullyShardedDataParallel._comm_hook",
         "checks: no other comm hook; register_comm_hook reached all; set directly on hybrid instances "
         "(register_comm_hook refuses HYBRID_SHARD, whose inter-node all-reduce the hook replaces)"),
    Name("FullyShardedDataParallel._comm_hook_state",
         "one hook state per FSDP1 instance (register_comm_hook sets one for all); a model's attachment, read "
         "where another DistributedLion attaches to it"),
    Name("FullyShardedDataParallel._inter_node_pg",
         "FSDP1 hybrid sharding: the group of a shard's replicas across nodes, over which they vote"),
    Name("FullyShardedDataParallel._fsdp_extension",
         "FSDP1 over a mesh sliced out of a larger one (tensor parallelism beside it), refused at attach"),
    Name("FlatParamHandle._use_orig_params", "where the original parameters' .grad live"),
    Name("FlatParameter._params", "the original parameters (use_orig_params=True)"),
    Name("FlatParameter._numels_with_padding", "the FlatParameter's layout: each original parameter's span"),
    Name("FlatParameter._is_padding_mask", "the FlatParameter's layout: which spans are alignment padding"),
    Name("FlatParameter._fqns", "the FlatParameter's layout: each span's parameter name"),
    Name("FlatParameter._unpadded_unsharded_size", "a check of the layout: the spans cover the FlatParameter"),
    Name("FlatParameter._saved_grad_shard",
         "the sharded gradient FSDP1 keeps between backwards (optional: absent means none)"),
    # FSDP2
    Name("FSDPModule._get_fsdp_state", "an FSDP2 module's state, to reach its parameter groups"),
    Name("FSDPState._fsdp_param_groups", "an FSDP2 module's parameter groups", ">=2.12"),
    Name("FSDPState._fsdp_param_group", "an FSDP2 module's parameter group", "2.11"),
    Name("FSDPParamGroup._prepare_reduce_scatter_inputs",
         "the padded sizes of each reduction: the reduce-scatter input's layout", ">=2.12"),
    Name("torch.distributed.fsdp._fully_shard._fsdp_param_group.foreach_reduce",
         "wrapped: on torch 2.11 the padded sizes of each reduction; on every torch, an HSDP unit of lionbit "
         "reduces without FSDP's all-reduce over the replicate group (the replicas vote at step() instead)"),
    Name("torch.distributed.fsdp._fully_shard._fsdp_common._get_dim0_padded_size",
         "the padded sizes of each reduction, as FSDP computes them", "2.11"),
    Name("FSDPParamGroup._reduce_scatter_comm",
         "checks: no other custom reduce-scatter; detach() gives FSDP its own back; a module with several "
         "parameter groups (a shard_placement_fn's per-parameter meshes) gets a reduce-scatter per group"),
    Name("FSDPParamGroup._all_reduce_hook", "a check: no all-reduce hook (the output is Lion's update)"),
    Name("FSDPParamGroup._module_fqn", "the unit's name in error messages"),
    Name("FSDPParam._orig_size", "a parameter's global shape (its momentum, its rows in the layout)"),
    Name("DTensor._local_tensor",
         "a sharded parameter's local shard, and a gradient's local tensor, at each step: to_local() makes a "
         "parameter's a new view each call (~4 us a parameter, a step's largest cost per tensor)"),
)


def generation() -> str:
    """Which of NAMES' generations the installed torch is: "2.11" or ">=2.12"."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "2.11" if (major, minor) <= (2, 11) else ">=2.12"


def unsupported(where: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: this torch {torch.__version__} does not have the internals lionbit uses ({what}); "
        f"lionbit is tested with torch 2.11 and 2.15"
    )


# -- c10d ------------------------------------------------------------------------
# A group's backend object: c10d has no public accessor (ProcessGroup.backend
# gives a name only).


def default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def backend_object(pg: dist.ProcessGroup, device: torch.device):
    """The group's backend for the device type; RuntimeError where it has
    none. Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps each backend in
    a ``_ProcessGroupWrapper``, which checks every standard collective
    against the other ranks' over a Gloo group of its own before it runs:
    the backend inside it (lionbit's sign calls check themselves, in their
    header round)."""
    backend = pg._get_backend(device)
    wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
    if wrapper is not None and isinstance(backend, wrapper):
        return backend.wrapped_pg
    return backend


def backend_name(pg: dist.ProcessGroup) -> str:
    return pg._get_backend_name()


def set_nccl_timeout(opts, timeout) -> None:
    """ProcessGroupNCCL.Options takes its timeout only through this field."""
    opts._timeout = timeout


# -- autograd --------------------------------------------------------------------


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (what autograd checks saved tensors by)."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (autograd's record of views), or t itself."""
    base = t._base
    return t if base is None else base


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Runs fn when the current backward pass ends (the engine's queue of final
    callbacks); RuntimeError outside a backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def in_dispatch_mode() -> bool:
    """Under a TorchDispatchMode (FlopCounterMode, ...), where in-place ops bump no version."""
    return getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)() > 0


# -- composable replicate() ---------------------------------------------------------
# torch.distributed._composable.replicate.replicate(module, device_mesh=..., ...)
# (torchtitan's and OLMo-core's DDP) builds a DistributedDataParallel over the
# module's parameters at the module's first forward and keeps it in its state;
# no public name reaches it. (The FSDP-based replicate of
# torch.distributed._composable.replicate_with_fsdp is an FSDP2 module instead.)


def ddp_comm_hook_name(model) -> Optional[str]:
    """The name of the comm hook registered on a DDP model (a Python hook's
    qualified name or a built-in hook's type), or None if it has none."""
    name = model._get_ddp_logging_data().get("comm_hook")
    return str(name) if name else None


def _replicate_module():
    return sys.modules.get("torch.distributed._composable.replicate")


def is_replicated(module) -> bool:
    """Whether ``module`` is composable replicate()'s (its class becomes a
    subclass of that module's ``DDP``)."""
    mod = _replicate_module()
    return mod is not None and issubclass(type(module), mod.DDP)


def replicate_ddp(module, where: str):
    """The DistributedDataParallel of a replicate()d module, built now if no
    forward has run yet (every rank attaches at the same point of its script,
    so DDP's construction, a collective, runs on all of them alike)."""
    state = _replicate_module().replicate.state(module)
    if state is None or not hasattr(state, "has_initialized"):
        raise unsupported(where, "composable replicate()'s state")
    from torch.distributed._composable.contract import _get_registry  # optional: replicate() imported it already

    for sub in module.modules():
        if "fully_shard" in (_get_registry(sub) or {}):
            raise NotImplementedError(
                f"{where}: the replicate()d model has fully_shard-ed parts, which its DDP leaves out; replicate the "
                f"whole model, or fully_shard all of it (FSDP2 and HSDP are supported)"
            )
    if not state.has_initialized:
        state.lazy_init()
    ddp = getattr(state, "_ddp", None)
    if ddp is None:
        raise unsupported(where, "_ReplicateState._ddp")
    return ddp


# -- torch.optim.Optimizer, torch.compile -----------------------------------------


_STATE_DICT_HOOKS = {
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}


def state_dict_hooks(opt, when: str) -> list:
    """The hooks registered on the optimizer for `when` (a key of _STATE_DICT_HOOKS): Optimizer
    keeps them in private dicts, and a state_dict() that replaces Optimizer's runs them itself."""
    return list(getattr(opt, _STATE_DICT_HOOKS[when], {}).values())


def torch_caller(modules: Tuple[str, ...], function: Optional[str] = None, depth: Optional[int] = None):
    """Which of torch's code is calling: the nearest frame above the caller of
    this function's caller whose code is in one of ``modules`` (a module or a
    module inside it) and, where given, in its function ``function``; among
    ``depth`` frames (every frame where None); None if there is none. Some of
    torch's callers get what they need from lionbit only so: DCP and FSDP1's
    state dicts (one value per parameter), DCP's optimizer initialization (a
    step with zero gradients), GradScaler (a step that unscales itself),
    ZeroRedundancyOptimizer (one optimizer per partition). Every frame of an
    unbounded search is read, however deep a framework nests the call."""
    frame, left = sys._getframe(2), depth
    while frame is not None and left != 0:
        name = frame.f_globals.get("__name__", "")
        if (any(name == m or name.startswith(m + ".") for m in modules)
                and (function is None or frame.f_code.co_name == function)):
            return frame
        frame, left = frame.f_back, None if left is None else left - 1
    return None


def initializing_optimizer_state() -> bool:
    """Whether the step() running now is the one torch.distributed.checkpoint's
    ``_init_optim_state`` makes (get/set_optimizer_state_dict on an optimizer
    with an empty state: zero gradients, lr 0), found among the few frames above."""
    return torch_caller(("torch.distributed.checkpoint.state_dict",), "_init_optim_state", 8) is not None


def loading_flattened_optimizer_state() -> bool:
    """Whether torch's set_optimizer_state_dict is loading a flattened
    optimizer state dict now (``flatten_optimizer_state_dict=True``, as
    torchtitan's checkpoints are): its ``_load_optim_state_dict`` got one
    without a "state" key, and unflattened it into the optimizer's own state
    and group keys only. Found among the few frames above."""
    frame = torch_caller(("torch.distributed.checkpoint.state_dict",), "_load_optim_state_dict", 16)
    given = None if frame is None else frame.f_locals.get("state_dict")
    return isinstance(given, dict) and bool(given) and "state" not in given


def compiled_inner(model):
    """The module inside torch.compile's OptimizedModule (the model itself otherwise)."""
    return getattr(model, "_orig_mod", model)


# -- GradScaler ------------------------------------------------------------------
# GradScaler's step() protocol for an optimizer with its own step (lionbit's
# voted step must unscale first and hand update() the found-inf tensors).


def scaler_stage(scaler, opt):
    """The optimizer's stage in the scaler (torch.amp.grad_scaler.OptState)."""
    return scaler._per_optimizer_states[id(opt)]["stage"]


def scaler_found_inf(scaler, opt) -> dict:
    return scaler._found_inf_per_device(opt)


# -- FSDP1 -----------------------------------------------------------------------
# FSDP1's comm hook gets only a flat gradient: how the original parameters lie
# in it, and which instance it belongs to, is in FSDP1's private state.


class FlatLayout(NamedTuple):
    flat_param: torch.Tensor  # the instance's FlatParameter
    use_orig_params: bool
    params: Optional[list]  # the original parameters (use_orig_params=True), else None
    spans: List[tuple]  # (numel, is_padding, fqn or None), in flat order
    unpadded_numel: int  # the FlatParameter's unpadded, unsharded numel


def fsdp1_states(model) -> list:
    """Every FSDP1 instance of the model, root first."""
    try:
        import torch.distributed.fsdp._traversal_utils as traversal  # optional: a torch without FSDP1
    except ImportError as err:
        raise unsupported("DistributedLion.attach (FSDP1)", str(err)) from None
    return traversal._get_fsdp_states(model)


def fsdp1_layout(state) -> Optional[FlatLayout]:
    """The instance's FlatParameter and its layout; None for an instance without parameters."""
    handle = state._handle
    if handle is None:
        return None
    fp = handle.flat_param
    use_orig = handle._use_orig_params
    fqns = iter(fp._fqns)
    spans = [(numel, padding, None if padding else next(fqns))
             for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask)]
    return FlatLayout(fp, use_orig, fp._params if use_orig else None, spans, fp._unpadded_unsharded_size.numel())


def fsdp1_saved_grad_shard(fp) -> Optional[torch.Tensor]:
    """The sharded gradient FSDP1 keeps aside during a backward and under no_sync()."""
    return getattr(fp, "_saved_grad_shard", None)


def fsdp1_comm_hook(state):
    return state._comm_hook


def fsdp1_hook_state(state):
    """The state an FSDP1 instance hands its comm hook (None without one)."""
    return state._comm_hook_state


def fsdp1_set_hook_state(state, hook_state) -> None:
    """register_comm_hook gives every instance the root's state: each gets its own."""
    state._comm_hook_state = hook_state


def fsdp1_set_comm_hook(state, hook, hook_state) -> None:
    """What register_comm_hook sets, on one instance. For HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2, which register_comm_hook refuses: FSDP1's
    _reduce_grad then calls the hook in place of its reduce-scatter and runs
    no all-reduce over the inter-node group (lionbit's replicas vote at
    step() instead)."""
    state._comm_hook = hook
    state._comm_hook_state = hook_state


def fsdp1_inter_node_group(state):
    """A hybrid instance's inter-node group (the replicas of this rank's
    shard, one rank a node); None for the other strategies."""
    return getattr(state, "_inter_node_pg", None)


def fsdp1_on_a_sliced_mesh(state) -> bool:
    """Whether an FSDP1 instance shards over a device mesh sliced out of a
    larger one (tensor parallelism beside it): FSDP1 then sets a DTensor
    extension for its state dicts."""
    return getattr(state, "_fsdp_extension", None) is not None


def fsdp1_clear_comm_hook(state) -> None:
    """FSDP1's own reduce-scatter again (FSDP1 has no unregister)."""
    state._comm_hook = state._comm_hook_state = None


# -- FSDP2 -----------------------------------------------------------------------
# FSDP2 has no public way to learn how a unit's gradients lie in its
# reduce-scatter input: lionbit reads its parameter groups and learns the layout
# of each reduction from inside FSDP.


def fsdp2_param_groups(module, where: str) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):
        raise unsupported(where, "FSDPState has neither _fsdp_param_groups nor _fsdp_param_group")
    one = state._fsdp_param_group  # torch 2.11: None for a module without parameters
    return [one] if one is not None else []


def fsdp2_reduce_scatter_comm(param_group, where: str):
    if not hasattr(param_group, "_reduce_scatter_comm"):
        raise unsupported(where, "FSDPParamGroup._reduce_scatter_comm")
    return param_group._reduce_scatter_comm


def fsdp2_restore_reduce_scatter_comm(param_group, comm) -> None:
    """FSDP2 has a setter (set_custom_reduce_scatter) but no way back to its default."""
    param_group._reduce_scatter_comm = comm


def fsdp2_set_reduce_scatter_comm(module, param_group, comm, where: str) -> None:
    """set_custom_reduce_scatter for one of a module's FSDP parameter groups.
    torch's setter refuses a module with several (a shard_placement_fn's
    per-parameter meshes: torchtitan's expert parallelism), as one comm
    would serve groups of different meshes; here each group gets its own."""
    if len(fsdp2_param_groups(module, where)) == 1:
        module.set_custom_reduce_scatter(comm)
    else:
        param_group._reduce_scatter_comm = comm


def fsdp2_all_reduce_hook(param_group):
    """set_all_reduce_hook's hook, or None (torch keeps it on the group only)."""
    return getattr(param_group, "_all_reduce_hook", None)


def root_mesh(mesh):
    """The DeviceMesh a sliced or flattened mesh was made from (itself if
    none, or where this torch does not say: torch >= 2.9 does)."""
    get = getattr(mesh, "_get_root_mesh", None)
    return mesh if get is None else get()


def fsdp2_shards(param_group) -> int:
    """The size of the unit's shard group (1 without one: FSDP2's replicate())."""
    return getattr(param_group.mesh_info, "shard_mesh_size", 1)


def fsdp2_divide_factor(param_group) -> Optional[float]:
    """The unit's set_gradient_divide_factor (None: FSDP averages)."""
    return getattr(param_group, "gradient_divide_factor", None)


def fsdp2_unit_name(param_group) -> str:
    """The unit's module name ("<root>" for the root, and for every unit before the first forward,
    when FSDP sets the names)."""
    return param_group._module_fqn or "<root>"


def fsdp2_orig_size(fsdp_param) -> torch.Size:
    """A sharded parameter's global shape."""
    return fsdp_param._orig_size


def fsdp2_shard_dim(fsdp_param) -> int:
    """The dim FSDP shards an FSDPParam's (tensor-parallel-local) tensor on
    (0 unless a shard_placement_fn said Shard(k))."""
    placement = getattr(fsdp_param, "fsdp_placement", None)
    return getattr(placement, "dim", 0) or 0


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself, as ``to_local()`` gives it without
    grad mode (the same memory; for a parameter to_local() returns a new view
    of it each call). For step(), which reads gradients and writes shards in
    place without autograd."""
    return t._local_tensor


class LayoutLearner:
    """A custom reduce-scatter that wants each reduction's layout first:
    ``learn_layout(fsdp_params, padded_sizes)`` runs before FSDP calls it.
    ``skips_all_reduce``: an HSDP unit's, whose gradients FSDP must not
    all-reduce over the replicate group after the reduce-scatter."""

    skips_all_reduce = False

    def learn_layout(self, fsdp_params, sizes) -> None:
        raise NotImplementedError


def fsdp2_learn_layouts(param_group, comm: LayoutLearner, where: str) -> Callable[[], None]:
    """Has FSDP tell comm the layout of each reduction of the group (and, for
    a comm that ``skips_all_reduce``, reduce without the all-reduce). Returns
    the function that undoes it (the process-wide wrapper of foreach_reduce
    stays: it passes every other reduction through unchanged)."""
    if comm.skips_all_reduce or generation() == "2.11":
        _wrap_foreach_reduce(where, comm.skips_all_reduce)
    default = getattr(param_group, "_prepare_reduce_scatter_inputs", None)
    if default is None:  # torch 2.11: the wrapper learns the layouts
        return lambda: None

    def prepare(fsdp_params, unsharded_grads, world_size):
        sizes = default(fsdp_params, unsharded_grads, world_size)
        comm.learn_layout(fsdp_params, sizes)
        return sizes

    param_group._prepare_reduce_scatter_inputs = prepare

    def undo():
        param_group._prepare_reduce_scatter_inputs = default

    return undo


def _chunk_cat_size(fp, size, n: int):
    """The size FSDP gives a gradient before its reduce-scatter: as it is
    for a parameter sharded Shard(0); for Shard(k), k > 0, its n blocks
    along dim k stacked on dim 0."""
    k = fsdp2_shard_dim(fp)
    if not k or n == 1:
        return size
    return torch.Size((size[0] * n, *size[1:k], size[k] // n, *size[k + 1:]))


def _wrap_foreach_reduce(where: str, skipping: bool) -> None:
    """Wraps FSDP's foreach_reduce (once per process). For lionbit's
    reduce-scatters (LayoutLearner) it (torch 2.11) tells the comm the unit's
    layout before FSDP calls it: the FSDP parameters with gradients, in
    order, and their dim-0 padded sizes (Shard(0) only, which attach
    checks); and, for a comm that ``skips_all_reduce``, passes no all-reduce
    group. Every other reduction passes through unchanged."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as module  # optional: FSDP2's, when attached

    original = getattr(module, "foreach_reduce", None)
    if original is None:
        raise unsupported(where, "_fsdp_param_group.foreach_reduce")
    if getattr(original, "lionbit_wrapper", False):
        if skipping and not original.lionbit_skips:
            raise unsupported(where, "an all_reduce_group argument of _fsdp_param_group.foreach_reduce (HSDP)")
        return
    params = list(inspect.signature(original).parameters)
    if skipping and (params[:5] != ["fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
                                    "reduce_scatter_comm"] or "all_reduce_group" not in params):
        raise unsupported(where, f"_fsdp_param_group.foreach_reduce({', '.join(params)})")
    at = params.index("all_reduce_group") if "all_reduce_group" in params else None
    learn = generation() == "2.11"
    if learn:
        from torch.distributed.fsdp._fully_shard._fsdp_common import _get_dim0_padded_size  # optional: torch 2.11 only

    def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                       reduce_scatter_comm, *args, **kwargs):
        if isinstance(reduce_scatter_comm, LayoutLearner):
            if learn:
                n = reduce_scatter_group.size() if reduce_scatter_group is not None else 1
                sizes = tuple(_get_dim0_padded_size(_chunk_cat_size(fp, g.size(), n), n)
                              for fp, g in zip(fsdp_params, unsharded_grads))
                reduce_scatter_comm.learn_layout(fsdp_params, sizes)
            if reduce_scatter_comm.skips_all_reduce and at is not None:
                if "all_reduce_group" in kwargs:
                    kwargs["all_reduce_group"] = None
                elif len(args) > at - 5:
                    args = args[: at - 5] + (None,) + args[at - 4:]
        return original(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                        reduce_scatter_comm, *args, **kwargs)

    foreach_reduce.lionbit_wrapper = True
    foreach_reduce.lionbit_skips = at is not None
    module.foreach_reduce = foreach_reduce
