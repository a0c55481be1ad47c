"""The torch requirement in lionbit's package metadata (a scikit-build-core
``[[tool.dynamic-metadata]]`` provider, wired up in pyproject.toml).

lionbit's extension links torch's C++ libraries, and ``import lionbit``
refuses a torch of another major.minor version than the one it was built
against (python/lionbit/_package.py). A wheel's ``Requires-Dist`` says the
same: ``torch==X.Y.*``, X.Y being the torch installed where it is built
(lionbit builds with ``pip install --no-build-isolation .``). An sdist has no
torch to build against yet: it carries the lowest torch lionbit builds
against (the ``minimum`` setting) and marks ``Requires-Dist`` dynamic, so the
wheel built from it may narrow it.

Standard library and ``packaging`` (a dependency of scikit-build-core) only;
torch is not imported, its installed version is read from its metadata.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version


class TorchRequirement:
    def __init__(self) -> None:
        self.state = "metadata_wheel"

    def build_state(self, build_state: str) -> None:
        self.state = build_state

    def dynamic_wheel(self, settings) -> dict:
        return {"dependencies": True}

    def dynamic_metadata(self, settings, project) -> dict:
        unknown = set(settings) - {"minimum"}
        if unknown or not isinstance(settings.get("minimum"), str):
            raise RuntimeError(
                f"lionbit_metadata: the only setting is 'minimum' (a torch version string), got {dict(settings)}"
            )
        minimum = Version(settings["minimum"])
        if self.state == "sdist":
            return {"dependencies": [f"torch>={minimum}"]}
        try:
            installed = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(
                "lionbit builds against the torch installed in the build environment, and there is none: "
                f"install torch >= {minimum} first, then build without build isolation: "
                "`pip install --no-build-isolation .` (or `make build`)"
            ) from None
        v = Version(installed)
        if v.release[:2] < minimum.release[:2]:
            raise RuntimeError(
                f"lionbit needs torch >= {minimum} to build; the build environment has torch {installed}"
            )
        return {"dependencies": [f"torch=={v.major}.{v.minor}.*"]}
