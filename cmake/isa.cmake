# One way to build a kernel family for several x86 instruction sets: the
# family's implementation header is compiled once per ISA, each copy in its
# own source file with that ISA's flags, and bits::pick_kernels (signbits/isa.h)
# chooses a copy at run time. signbits/ (pack, count, unpack) and optimizer/ (the
# fused Lion passes) both use it.
#
#   lionbit_isa_kernels(<target> SCALAR <source> AVX2 <source> AVX512 <source>)
#
# On other processors only the scalar copy is built, and at the build type's
# optimization. On x86 the scalar copy is the fallback for a processor without
# AVX2 (and LIONBIT_ISA=scalar): it is built at -O2, which compiles it in about
# half the time of -O3. No -mfma: the float kernels never fuse a multiply and
# an add (optimizer/lion.h).
set(LIONBIT_ISA_FLAGS_AVX2 -mavx2 -mf16c -mbmi -mbmi2 -mpopcnt)
set(LIONBIT_ISA_FLAGS_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mf16c -mbmi -mbmi2 -mpopcnt)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  set(LIONBIT_X86 ON)
else()
  set(LIONBIT_X86 OFF)
endif()

function(lionbit_isa_kernels target)
  cmake_parse_arguments(ARG "" "SCALAR;AVX2;AVX512" "" ${ARGN})
  target_sources(${target} PRIVATE ${ARG_SCALAR})
  if(NOT LIONBIT_X86)
    return()
  endif()
  if(CMAKE_BUILD_TYPE STREQUAL "Release")
    set_source_files_properties(${ARG_SCALAR} PROPERTIES COMPILE_OPTIONS -O2)
  endif()
  target_sources(${target} PRIVATE ${ARG_AVX2} ${ARG_AVX512})
  set_source_files_properties(${ARG_AVX2}
    PROPERTIES COMPILE_OPTIONS "${LIONBIT_ISA_FLAGS_AVX2}")
  set_source_files_properties(${ARG_AVX512}
    PROPERTIES COMPILE_OPTIONS "${LIONBIT_ISA_FLAGS_AVX512}")
  target_compile_definitions(${target} PUBLIC LIONBIT_HAVE_X86_KERNELS=1)
endfunction()
