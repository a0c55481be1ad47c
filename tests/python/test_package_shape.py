"""The shape of the Python package, checked on its source: no lionbit module
reads or writes another lionbit module's private names, DistributedLion stays
the size of torch's own optimizers, and no import hides in a function body
unless it keeps an optional dependency lazy or breaks a cycle (and says so)."""

import ast
import glob
import os

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "lionbit")


def _modules():
    for path in sorted(glob.glob(os.path.join(PACKAGE, "*.py"))):
        with open(path) as f:
            source = f.read()
        yield os.path.basename(path), source, ast.parse(source)


def _private_names_defined(tree) -> set:
    """Underscore names a module defines: functions, classes, module
    globals, methods and attributes it assigns on self."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_names():
    modules = list(_modules())
    owners = {}
    for name, _, tree in modules:
        for private in _private_names_defined(tree):
            owners.setdefault(private, set()).add(name)
    found = []
    for name, _source, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in owners:
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)} (defined in {sorted(owners[node.attr])})")
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and alias.name not in ("_C", "_backend"):
                        found.append(f"{name}:{node.lineno}: imports private {alias.name} from .{node.module}")
    assert not found, "\n".join(found)


def test_distributed_lion_is_the_size_of_torchs_optimizers():
    for _name, _, tree in _modules():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "DistributedLion":
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 200, f"DistributedLion is {lines} lines"
                return
    raise AssertionError("no DistributedLion class found")


def test_imports_in_function_bodies_say_why():
    found = []
    for name, source, tree in _modules():
        lines = source.splitlines()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        text = lines[node.lineno - 1]
                        if "# optional:" not in text and "# cycle:" not in text:
                            found.append(f"{name}:{node.lineno}: {text.strip()}")
    assert not found, "\n".join(found)


def test_import_leaves_fsdp_and_dtensor_unloaded():
    """torch imports lionbit at its own import (the "torch.backends" entry
    point), so whatever lionbit imports, every ``import torch`` pays: torch's
    FSDP and DTensor (sympy under them) cost 0.8 s of a 3.4 s import. lionbit
    imports its FSDP halves at the first attach() to an FSDP model."""
    import subprocess
    import sys

    probe = ("import sys, torch, torch.distributed, lionbit\n"
             "from torch.nn.parallel import DistributedDataParallel\n"
             "assert 'lionbit' in sys.modules\n"
             "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', 'sympy') "
             "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
