# Version and git commit, baked into kernels/build_info at configure time.
execute_process(COMMAND git rev-parse --short=12 HEAD
  WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}
  OUTPUT_VARIABLE MESHPROOF_GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT MESHPROOF_GIT_COMMIT)
  set(MESHPROOF_GIT_COMMIT "unknown")
endif()
if(MESHPROOF_HAVE_CUDA)
  set(MESHPROOF_HAVE_CUDA_BOOL true)
  string(REPLACE ";" "," MESHPROOF_CUDA_ARCHS_STR "${CMAKE_CUDA_ARCHITECTURES}")
else()
  set(MESHPROOF_HAVE_CUDA_BOOL false)
  set(MESHPROOF_CUDA_ARCHS_STR "")
endif()
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/kernels/core/build_info.cc.in
  ${CMAKE_CURRENT_BINARY_DIR}/generated/build_info.cc @ONLY)
