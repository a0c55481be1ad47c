# Sources of lionbit_optim (the fused Lion kernels), included by
# optimizer/CMakeLists.txt. lion_impl.h is compiled once per instruction set;
# lion.cpp picks the copy at run time (bits::isa_supported).
set(LIONBIT_OPTIM_SOURCES
  ${CMAKE_CURRENT_SOURCE_DIR}/lion.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/lion_scalar.cpp
)
set(LIONBIT_OPTIM_SOURCE_OPTIONS "")

# The same test as backend/CMakeLists.txt, which defines
# LIONBIT_HAVE_X86_KERNELS (PUBLIC on lionbit_bits) under it. No -mfma: the
# kernels never fuse a multiply and an add (see optimizer/lion.h).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  list(APPEND LIONBIT_OPTIM_SOURCES
    ${CMAKE_CURRENT_SOURCE_DIR}/lion_avx2.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/lion_avx512.cpp
  )
  list(APPEND LIONBIT_OPTIM_SOURCE_OPTIONS
    "${CMAKE_CURRENT_SOURCE_DIR}/lion_avx2.cpp=-mavx2,-mf16c,-mpopcnt"
    "${CMAKE_CURRENT_SOURCE_DIR}/lion_avx512.cpp=-mavx512f,-mavx512bw,-mavx512vl,-mpopcnt"
  )
endif()
