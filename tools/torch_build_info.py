"""Print what CMake needs to build against the installed torch, one KEY=VALUE a line."""
import os

import torch
from torch.utils import cpp_extension

print(f"TORCH_VERSION={torch.__version__.split('+')[0]}")
print("TORCH_INCLUDE_DIRS=" + "|".join(cpp_extension.include_paths()))
print("TORCH_LIB_DIR=" + os.path.join(os.path.dirname(torch.__file__), "lib"))
print(f"TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
# torch built with pybind11 2.x exposes the ABI tags its pybind11 internals
# were built with; pybind11 3.x (torch >= 2.9 or so) derives them itself.
defines = []
for attr, macro in (
    ("_PYBIND11_COMPILER_TYPE", "PYBIND11_COMPILER_TYPE"),
    ("_PYBIND11_STDLIB", "PYBIND11_STDLIB"),
    ("_PYBIND11_BUILD_ABI", "PYBIND11_BUILD_ABI"),
):
    value = getattr(torch._C, attr, None)
    if value:
        defines.append(f'{macro}="{value}"')
print("TORCH_PYBIND_DEFINES=" + "|".join(defines))
# The CUDA version torch was built with (empty for a CPU-only torch): the
# extension builds its CUDA path only against a CUDA build of torch.
print(f"TORCH_CUDA_VERSION={torch.version.cuda or ''}")
