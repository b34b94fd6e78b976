# CUDA is optional. AUTO enables it when nvcc is found; ON requires it; OFF skips it.
# The CUDA code compiles and links without a GPU; at run time the program falls back to the
# CPU backend when no driver or device is present (see kernels/core/device.h).
include(CheckLanguage)

set(MESHPROOF_HAVE_CUDA OFF)
if(NOT MESHPROOF_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The cuBLASLt paths use the block-scaling modes of CUDA 12.9 (VEC128_32F, BLK128x128_32F) and
    # sm_100 needs nvcc >= 12.8: an older toolkit is refused here with the reason, not by a compile
    # error deep in kernels/gemm/gemm_cublaslt.cc. Under AUTO it is skipped (the CPU backend builds).
    execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --version OUTPUT_VARIABLE _mp_nvcc_out
                    ERROR_QUIET)
    string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _mp_nvcc_match "${_mp_nvcc_out}")
    set(_mp_nvcc_version "${CMAKE_MATCH_1}")
    if(_mp_nvcc_version AND _mp_nvcc_version VERSION_LESS 12.9)
      set(_mp_why "nvcc ${_mp_nvcc_version} (${CMAKE_CUDA_COMPILER}) is older than CUDA 12.9, which the CUDA backend needs (cuBLASLt block-scaling modes)")
      if(MESHPROOF_CUDA STREQUAL "ON")
        message(FATAL_ERROR "MESHPROOF_CUDA=ON but ${_mp_why}")
      endif()
      message(WARNING "meshproof: CUDA backend skipped: ${_mp_why}")
      unset(CMAKE_CUDA_COMPILER)
      unset(CMAKE_CUDA_COMPILER CACHE)
    endif()
  endif()
  if(CMAKE_CUDA_COMPILER)
    # Hopper (sm_90) and Blackwell (sm_100) by default; override with -DCMAKE_CUDA_ARCHITECTURES.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90 100)
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flag (CUDA_STANDARD 20, or no CUDA_STANDARD, which
    # falls back to CXX_STANDARD 20, fails at generate time). .cu files are compiled as C++17: they
    # hold kernels and launchers only and include the C++17-clean headers they need.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    # Where cuBLASLt is opened from when the loader's search does not find it (it is not linked:
    # kernels/gemm/cublaslt_api.h); cached so tools/gpu-bundle --with-cuda-libs can copy it from there.
    set(MESHPROOF_CUDA_LIBRARY_DIR "${CUDAToolkit_LIBRARY_DIR}" CACHE INTERNAL
      "the CUDA toolkit's library folder")
    # Line tables for device code (no change to the generated code): compute-sanitizer's reports
    # and a kernel fault's location then name the .cu file and line (tools/device-check runs
    # compute-sanitizer on the GPU test binaries; docs/design.md section 39).
    add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
    set(MESHPROOF_HAVE_CUDA ON)
  elseif(MESHPROOF_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MESHPROOF_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  endif()
endif()

if(MESHPROOF_HAVE_CUDA)
  # NCCL ships with the toolkit's standard install here; find it beside cuBLASLt.
  find_library(MESHPROOF_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
  find_path(MESHPROOF_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  if(NOT MESHPROOF_NCCL_LIBRARY OR NOT MESHPROOF_NCCL_INCLUDE)
    message(FATAL_ERROR "CUDA found but NCCL is missing (libnccl.so / nccl.h)")
  endif()
  add_library(meshproof_nccl INTERFACE)
  target_link_libraries(meshproof_nccl INTERFACE ${MESHPROOF_NCCL_LIBRARY})
  target_include_directories(meshproof_nccl INTERFACE ${MESHPROOF_NCCL_INCLUDE})
  message(STATUS "meshproof: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
else()
  message(STATUS "meshproof: CUDA backend OFF (MESHPROOF_CUDA=${MESHPROOF_CUDA})")
endif()
