# The installed torch, as two interface targets:
#   lionbit::torch         headers, libraries and the C++ ABI of the installed
#                          torch (what backend/ builds against);
#   lionbit::torch_python  plus torch's Python bindings and its pybind11 ABI
#                          tags (what bindings/ builds against), so that a
#                          c10d::Backend made by torch in Python passes into
#                          lionbit._C and back.
# LIONBIT_EXT_CUDA: the extension gets its CUDA path (nvcc found and torch is a
# CUDA build).
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/tools/torch_build_info.py"
  OUTPUT_VARIABLE _torch_info
  RESULT_VARIABLE _torch_rc
  ERROR_VARIABLE _torch_err)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "lionbit needs torch installed in ${Python_EXECUTABLE}: ${_torch_err}")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
foreach(_line IN LISTS _torch_info)
  if(_line MATCHES "^([A-Z0-9_]+)=(.*)$")
    set(${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
  endif()
endforeach()
string(REPLACE "|" ";" TORCH_INCLUDE_DIRS "${TORCH_INCLUDE_DIRS}")
string(REPLACE "|" ";" TORCH_PYBIND_DEFINES "${TORCH_PYBIND_DEFINES}")
message(STATUS "lionbit: torch ${TORCH_VERSION} at ${TORCH_LIB_DIR}, CXX11 ABI ${TORCH_CXX11_ABI}")

add_library(lionbit_torch INTERFACE)
add_library(lionbit::torch ALIAS lionbit_torch)
target_include_directories(lionbit_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
target_compile_definitions(lionbit_torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI}
  USE_C10D_GLOO
  USE_DISTRIBUTED)
target_link_directories(lionbit_torch INTERFACE ${TORCH_LIB_DIR})
target_link_libraries(lionbit_torch INTERFACE c10 torch torch_cpu)

add_library(lionbit_torch_python INTERFACE)
add_library(lionbit::torch_python ALIAS lionbit_torch_python)
target_compile_definitions(lionbit_torch_python INTERFACE
  TORCH_EXTENSION_NAME=_C
  TORCH_API_INCLUDE_EXTENSION_H
  ${TORCH_PYBIND_DEFINES})
target_link_libraries(lionbit_torch_python INTERFACE lionbit_torch torch_python)

set(LIONBIT_EXT_CUDA OFF)
if(LIONBIT_WITH_CUDA AND TORCH_CUDA_VERSION)
  set(LIONBIT_EXT_CUDA ON)
  message(STATUS "lionbit: CUDA path on (torch built with CUDA ${TORCH_CUDA_VERSION}, nvcc ${CMAKE_CUDA_COMPILER_VERSION})")
  target_compile_definitions(lionbit_torch INTERFACE USE_CUDA USE_C10D_NCCL)
  target_link_libraries(lionbit_torch INTERFACE torch_cuda c10_cuda CUDA::cudart)
elseif(LIONBIT_WITH_CUDA)
  message(STATUS "lionbit: torch ${TORCH_VERSION} is a CPU build: the extension has no CUDA path")
else()
  message(STATUS "lionbit: CUDA path off (no nvcc, or LIONBIT_CUDA=OFF)")
endif()
