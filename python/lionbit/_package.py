"""The package's body: ``import lionbit`` runs it (lionbit/__init__.py)."""

import torch

try:
    from . import _C
except ImportError as _err:
    # Under a torch of another version than the one lionbit was built against
    # the extension often fails to load (undefined symbols) before the check
    # below can name both versions: name them here, the built-against one from
    # the package metadata (Requires-Dist torch==X.Y.*, tools/lionbit_metadata.py).
    from importlib.metadata import PackageNotFoundError, requires

    try:
        _want = next((r for r in requires("lionbit") or [] if r.startswith("torch")), "unknown")
    except PackageNotFoundError:
        _want = "unknown"
    raise ImportError(
        f"lionbit's C++ extension lionbit._C failed to load ({_err}). torch {torch.__version__} is installed; "
        f"lionbit's metadata requires {_want} (the torch it was built against). If torch changed since "
        f"lionbit was built, rebuild lionbit against it: in the lionbit source tree run "
        f"`pip install --no-build-isolation .` (or `make build`)"
    ) from _err

__version__: str = _C.__version__
#: The torch version this build of lionbit was compiled against.
torch_version_built_against: str = _C.torch_version
#: Whether the CUDA kernels and the NCCL path were compiled in.
built_with_cuda: bool = bool(_C.built_with_cuda)


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


if _major_minor(torch.__version__) != _major_minor(torch_version_built_against):
    # The package metadata says the same: Requires-Dist torch==X.Y.* (tools/lionbit_metadata.py).
    _built = "%d.%d" % _major_minor(torch_version_built_against)
    raise ImportError(
        f"lionbit was built against torch {torch_version_built_against} but torch {torch.__version__} "
        f"is installed; lionbit runs only with the torch major.minor it was built against ({_built}.*: "
        f"its C++ extension links torch's C++ libraries). Rebuild it against the installed torch: in the "
        f"lionbit source tree run `pip install --no-build-isolation .` (or `make build`), "
        f"or install torch=={_built}.*"
    )

from ._backend import (  # noqa: E402
    BACKEND_NAME,
    all_reduce_sign,
    reduce_scatter_sign,
    register as _register,
    reset_stats,
    stats,
)
from .errors import NonFiniteInput, PeerRejected  # noqa: E402
from .hierarchy import HIERARCHIES  # noqa: E402
from .kernel_choice import kernels  # noqa: E402
from .momentum_sync import ExponentialSync  # noqa: E402
from .optim import DistributedLion  # noqa: E402
from .topology import Topology, check_topology, detect_topology  # noqa: E402

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
    "kernels",
    "DistributedLion",
    "ExponentialSync",
    "Topology",
    "detect_topology",
    "check_topology",
    "HIERARCHIES",
    "NonFiniteInput",
    "PeerRejected",
    "built_with_cuda",
    "torch_version_built_against",
    "__version__",
]
