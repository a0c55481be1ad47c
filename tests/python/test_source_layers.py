"""The C++ tree's shape, checked from the sources (no build needed):

- the layers include only downward: signbits/ (torch-free bit kernels) < optimizer/ (the
  fused Lion kernels) < backend/ (the c10d backend) < bindings/ (pybind11);
- no file depends on itself through its includes (no two files include each other, directly
  or through others);
- every torch-free header (signbits/, optimizer/) compiles on its own: it includes what it
  uses, for each instruction set it has code for (the per-ISA headers are compiled with the
  flags cmake/isa.cmake gives their copies).
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("signbits", "optimizer", "backend", "bindings")
SUFFIXES = (".h", ".hpp", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def sources():
    return sorted(p for d in LAYERS for p in (ROOT / d).rglob("*") if p.suffix in SUFFIXES)


def quoted_includes(path: Path):
    """The project files `path` includes with "...": resolved next to it first, then from the
    repository root (the two ways the tree writes them); system and torch headers are left out."""
    out = []
    for name in INCLUDE.findall(path.read_text()):
        for base in (path.parent, ROOT):
            target = (base / name).resolve()
            if target.is_file() and ROOT in target.parents:
                out.append(target)
                break
    return out


GRAPH = {p: quoted_includes(p) for p in sources()}


def test_the_layers_include_only_downward():
    upward = [f"{a.relative_to(ROOT)} includes {b.relative_to(ROOT)}"
              for a, bs in GRAPH.items() for b in bs
              if layer_of(b) not in LAYERS or LAYERS.index(layer_of(b)) > LAYERS.index(layer_of(a))]
    assert not upward, "includes from a lower layer to a higher one (or out of the layers):\n" + "\n".join(upward)


def test_no_file_depends_on_itself_through_its_includes():
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in GRAPH.get(node, ()):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                cycles.append(" -> ".join(str(p.relative_to(ROOT)) for p in cycle))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in GRAPH:
        if node not in state:
            visit(node, [node])
    assert not cycles, "include cycles:\n" + "\n".join(cycles)


def isa_flags():
    """{name: flags} from cmake/isa.cmake: the flags each x86 copy of a kernel family gets."""
    text = (ROOT / "cmake" / "isa.cmake").read_text()
    found = dict(re.findall(r"set\(LIONBIT_ISA_FLAGS_(\w+) ([^)]*)\)", text))
    assert {"AVX2", "AVX512"} <= set(found), f"cmake/isa.cmake no longer sets the ISA flags: {found}"
    return {"scalar": [], **{k.lower(): v.split() for k, v in found.items()}}


def uses_isa_code(header: Path) -> bool:
    """True when the header, or a project header it reaches, has code for some instruction set."""
    seen, todo = set(), [header]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if "__AVX" in p.read_text():
            return True
        todo += GRAPH.get(p, [])
    return False


TORCH_FREE_HEADERS = sorted(p for d in ("signbits", "optimizer") for p in (ROOT / d).glob("*.h"))


def compile_alone(header: Path, flags, tmp: Path):
    unit = tmp / f"{header.stem}_{abs(hash(tuple(flags)))}.cpp"
    unit.write_text(f'#include "{header.relative_to(ROOT)}"\n')
    # The per-ISA headers want the namespace of their copy, as their .cpp files define it.
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-unused-function", f"-I{ROOT}",
           "-DLIONBIT_KERNELS_NS=alone", "-DLIONBIT_OPTIM_NS=alone", "-DLIONBIT_OPTIM_ISA=kScalar",
           *flags, str(unit)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_every_torch_free_header_compiles_on_its_own(tmp_path):
    assert len(TORCH_FREE_HEADERS) >= 20, [str(p) for p in TORCH_FREE_HEADERS]
    flags = isa_flags()
    jobs = [(h, name, f) for h in TORCH_FREE_HEADERS
            for name, f in (flags.items() if uses_isa_code(h) else [("scalar", [])])]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda j: compile_alone(j[0], j[2], tmp_path), jobs))
    failed = [f"{h.relative_to(ROOT)} ({name}):\n{err[:1500]}"
              for (h, name, _), (rc, err) in zip(jobs, results) if rc != 0]
    assert not failed, "headers that do not compile on their own:\n" + "\n".join(failed)
