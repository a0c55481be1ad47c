"""lionbit: communication-efficient distributed training for PyTorch.

``import lionbit`` registers the c10d backend "lionbit" for CPU and CUDA
devices. Standard collectives are forwarded to Gloo; :func:`all_reduce_sign`
runs the 1-bit two-phase sign all-reduce.
"""

import sys as _sys


def _standalone_tool() -> bool:
    """Whether this process is ``python -m lionbit.estimate``. Python imports
    this package before running the module, and the estimate needs only the
    standard library: it should not wait for torch (about 2 s) or need a
    built lionbit."""
    args = list(getattr(_sys, "orig_argv", ()))[1:]
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i].startswith("-m"):
            module = args[i][2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module == "lionbit.estimate"
        i += 2 if args[i] in ("-X", "-W") else 1
    return False


if not _standalone_tool():
    from ._package import *  # noqa: F403
    from ._package import __all__ as _names, __version__  # noqa: F401

    __all__ = [*_names, "ElasticLoadPlanner"]  # noqa: F405 - lionbit.elastic's, at first use (__getattr__ below)
    del _names


def __getattr__(name: str):
    # lionbit.ElasticLoadPlanner subclasses torch.distributed.checkpoint's
    # planner: imported at first use, not at torch's import of lionbit.
    if name == "ElasticLoadPlanner":
        from .elastic import ElasticLoadPlanner  # optional: imports torch.distributed.checkpoint

        return ElasticLoadPlanner
    raise AttributeError(f"module 'lionbit' has no attribute {name!r}")
