# Third-party dependencies, all from Debian packages (tools/setup-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C CXX)
# libzip reads the torch.save archives inside PyTorch DCP checkpoints (engine/dcp). Through
# pkg-config: Debian's libzip CMake package also imports its command-line tools, which live in
# another package.
find_package(PkgConfig REQUIRED)
pkg_check_modules(MESHPROOF_LIBZIP REQUIRED IMPORTED_TARGET libzip)
# OpenBLAS single-threaded is our deterministic CPU BLAS (fixed summation order per call).
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(MESHPROOF_CBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas-pthread openblas x86_64-linux-gnu/openblas-pthread)
find_path(MESHPROOF_XXHASH_INCLUDE xxhash.h REQUIRED)
find_library(MESHPROOF_XXHASH_LIBRARY xxhash REQUIRED)

add_library(meshproof_hdf5 INTERFACE)
target_include_directories(meshproof_hdf5 INTERFACE ${HDF5_INCLUDE_DIRS})
target_link_libraries(meshproof_hdf5 INTERFACE ${HDF5_CXX_LIBRARIES} ${HDF5_LIBRARIES})
target_compile_definitions(meshproof_hdf5 INTERFACE ${HDF5_DEFINITIONS})

add_library(meshproof_blas INTERFACE)
target_link_libraries(meshproof_blas INTERFACE ${BLAS_LIBRARIES})
if(MESHPROOF_CBLAS_INCLUDE)
  target_include_directories(meshproof_blas INTERFACE ${MESHPROOF_CBLAS_INCLUDE})
endif()

add_library(meshproof_xxhash INTERFACE)
target_include_directories(meshproof_xxhash INTERFACE ${MESHPROOF_XXHASH_INCLUDE})
target_link_libraries(meshproof_xxhash INTERFACE ${MESHPROOF_XXHASH_LIBRARY})

set(MESHPROOF_HAVE_MPI OFF)
if(MESHPROOF_MPI)
  find_package(MPI COMPONENTS C)
  if(MPI_C_FOUND)
    set(MESHPROOF_HAVE_MPI ON)
  endif()
endif()
message(STATUS "meshproof: MPI ${MESHPROOF_HAVE_MPI}")

if(MESHPROOF_BUILD_TESTS)
  find_package(GTest REQUIRED)
  find_package(benchmark REQUIRED)
  # Test-side reference scripts need Debian's python3 with numpy, h5py and torch.
  find_program(MESHPROOF_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
endif()
