# Precompiled headers for the targets that include torch. Every translation
# unit of backend/ and bindings/ starts by parsing ATen/ATen.h (all of ATen's
# operators), c10d's Backend.hpp and, in bindings/, pybind11 and torch's
# Python glue: hundreds of thousands of lines, about 90 % of each file's
# compile time. Each target below parses them once, into a header that its
# files load instead.
#
#   lionbit_torch_pch(<target> BACKEND|BINDINGS)
#
# Only angle-bracket names of installed headers go in: the generated
# cmake_pch.hxx then holds no path of the clone, so a fresh clone elsewhere
# hashes the same for ccache (CMakeLists.txt gives ccache the sloppiness a
# precompiled header needs). Each source still includes what it uses; the
# precompiled header only makes that fast, and LIONBIT_PCH=OFF builds without.
option(LIONBIT_PCH "Precompile torch's headers for backend/ and bindings/" ON)

set(_lionbit_pch_std
  <algorithm> <array> <atomic> <chrono> <condition_variable> <cstdint> <cstdlib> <cstring>
  <functional> <map> <memory> <mutex> <optional> <string> <unordered_set> <utility> <vector>)
set(_lionbit_pch_torch
  <ATen/ATen.h> <ATen/core/ivalue.h> <ATen/record_function.h> <ATen/ThreadLocalState.h>
  <c10/util/Exception.h> <c10/util/StringUtil.h>
  <torch/csrc/distributed/c10d/Backend.hpp> <torch/csrc/distributed/c10d/Work.hpp>)
# torch's pybind.h includes Python.h first, as Python requires.
set(_lionbit_pch_python
  <torch/csrc/utils/pybind.h> <pybind11/pybind11.h> <pybind11/stl.h> <pybind11/chrono.h>)

function(lionbit_torch_pch target kind)
  if(NOT LIONBIT_PCH)
    return()
  endif()
  if(kind STREQUAL "BACKEND")
    set(headers ${_lionbit_pch_torch} ${_lionbit_pch_std})
  elseif(kind STREQUAL "BINDINGS")
    set(headers ${_lionbit_pch_python} ${_lionbit_pch_torch} ${_lionbit_pch_std})
  else()
    message(FATAL_ERROR "lionbit_torch_pch(${target} ${kind}): kind must be BACKEND or BINDINGS")
  endif()
  # These targets have C++ sources only (nvcc compiles none of their files).
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
