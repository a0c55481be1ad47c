"""lionbit: communication-efficient distributed training for PyTorch.

``import lionbit`` registers the c10d backend "lionbit" for CPU and CUDA
devices. Standard collectives are forwarded to Gloo; :func:`all_reduce_sign`
runs the 1-bit two-phase sign all-reduce.
"""

import torch

from . import _C

__version__: str = _C.__version__
#: The torch version this build of lionbit was compiled against.
torch_version_built_against: str = _C.torch_version
#: Whether the CUDA kernels and the NCCL path were compiled in.
built_with_cuda: bool = bool(_C.built_with_cuda)


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


if _major_minor(torch.__version__) != _major_minor(torch_version_built_against):
    raise ImportError(
        f"lionbit was built against torch {torch_version_built_against} but torch "
        f"{torch.__version__} is installed; rebuild it with "
        f"`pip install --no-build-isolation .` (the C++ ABI must match)"
    )

from ._backend import BACKEND_NAME, all_reduce_sign, reset_stats, stats  # noqa: E402
from ._backend import register as _register  # noqa: E402
from .optim import DistributedLion  # noqa: E402
from .fsdp import reduce_scatter_sign  # noqa: E402

_register()

import atexit as _atexit  # noqa: E402

# Stop lionbit's worker threads, and join the inner Gloo backends' workers,
# while the interpreter is still whole: a thread that released a Python-owned
# tensor during finalization would be killed mid-destructor (std::terminate).
_atexit.register(_C._shutdown_workers)

__all__ = [
    "BACKEND_NAME",
    "all_reduce_sign",
    "reduce_scatter_sign",
    "stats",
    "reset_stats",
    "DistributedLion",
    "built_with_cuda",
    "torch_version_built_against",
    "__version__",
]
