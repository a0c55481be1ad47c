"""Entry point for torch's backend autoloading (group "torch.backends").

This is a separate top-level package on purpose: torch imports the entry
point's module outside any error handling, and importing a module inside
``lionbit`` would run ``lionbit/__init__`` (and load the C++ extension) there.

torch >= 2.5 calls :func:`autoload` at the end of ``import torch``. It
registers the "lionbit" c10d backend. A failure here must never break
``import torch``: it becomes a warning, and ``import lionbit`` raises the real
error later.
"""


def autoload() -> None:
    try:
        import lionbit  # noqa: F401  (registers the backend)
    except Exception as err:  # noqa: BLE001 - anything, but never break torch
        import warnings

        warnings.warn(
            f"lionbit: the 'lionbit' backend was not registered at torch import "
            f"({type(err).__name__}: {err}); `import lionbit` shows the full error",
            RuntimeWarning,
            stacklevel=2,
        )
