# MESHPROOF_SANITIZE / MESHPROOF_FUZZ (docs/design.md section 17): instrument every C and C++ object of
# the build (libraries, tests, CLI) with AddressSanitizer (with LeakSanitizer) and
# UndefinedBehaviorSanitizer. -fno-sanitize-recover=all turns every UBSan report into an abort, so
# a finding fails the test instead of printing and going on; -fno-omit-frame-pointer keeps the fast
# unwinder's stacks complete.
#
# MESHPROOF_FUZZ (clang) adds libFuzzer's coverage to the same build, so one sanitized build
# (build-asan: `make test-sanitize` and `make fuzz`) serves both the CTest suite and the fuzz
# targets: edge counters everywhere (cheap: one byte increment per edge), and the full
# -fsanitize=fuzzer-no-link (comparison tracing too, which costs a call per comparison and would
# slow the numeric tests) only on the fuzzed sources, see meshproof_fuzz_instrument().

if(NOT (MESHPROOF_SANITIZE OR MESHPROOF_FUZZ))
  return()
endif()
if(MESHPROOF_HAVE_CUDA)
  message(FATAL_ERROR "MESHPROOF_SANITIZE/MESHPROOF_FUZZ need -DMESHPROOF_CUDA=OFF (host code only)")
endif()
set(MESHPROOF_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
                              -fno-omit-frame-pointer)
if(MESHPROOF_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "MESHPROOF_FUZZ needs clang (libFuzzer): "
                        "-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang")
  endif()
  list(APPEND MESHPROOF_SANITIZER_FLAGS -fsanitize-coverage=inline-8bit-counters,pc-table)
endif()
add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${MESHPROOF_SANITIZER_FLAGS}>")
add_link_options(-fsanitize=address,undefined)
# mesh/mpi/mpi_comm.cc keeps Open MPI's plugins loaded in this build (their leaks stay nameable).
add_compile_definitions(MESHPROOF_SANITIZE_BUILD=1)
list(JOIN MESHPROOF_SANITIZER_FLAGS " " _flags)
message(STATUS "meshproof: sanitizers on (${_flags})")

# Full libFuzzer instrumentation for the sources the fuzz targets exercise (called from the top
# CMakeLists.txt once the library directories exist).
function(meshproof_fuzz_instrument)
  foreach(src ${ARGN})
    # A source property is scoped to the directory whose CMakeLists.txt adds the source to its
    # target: the layer folder (harness/, engine/), not the concern folder the file sits in.
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${src})
    string(REGEX REPLACE "/.*" "" layer ${rel})
    set_property(SOURCE ${src} DIRECTORY ${PROJECT_SOURCE_DIR}/${layer} APPEND PROPERTY
                 COMPILE_OPTIONS -fsanitize=fuzzer-no-link)
  endforeach()
endfunction()
