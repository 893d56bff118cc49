# Every third-party dependency is found here, once, as an imported target.
find_package(Threads REQUIRED)
find_package(TBB REQUIRED)                       # TBB::tbb
find_package(Boost 1.74 REQUIRED)                # Boost::headers (Asio, Beast)
find_package(Eigen3 3.3 REQUIRED NO_MODULE)      # Eigen3::Eigen
find_package(nlohmann_json 3.10 REQUIRED)        # nlohmann_json::nlohmann_json
find_package(PkgConfig REQUIRED)
pkg_check_modules(liburing REQUIRED IMPORTED_TARGET liburing>=2.1)  # PkgConfig::liburing
pkg_check_modules(xxhash REQUIRED IMPORTED_TARGET libxxhash>=0.8)   # PkgConfig::xxhash

if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)                   # GTest::gtest, GTest::gtest_main
  include(GoogleTest)
endif()
if(STRATA_BUILD_BENCH)
  find_package(benchmark REQUIRED)               # benchmark::benchmark
endif()

# CUDA is optional. AUTO turns it on when a CUDA compiler is found (Debian's toolkit lives in
# /usr/local/cuda, which is not always on PATH).
set(STRATA_CUDA_ENABLED OFF)
set(STRATA_NCCL_ENABLED OFF)
if(NOT STRATA_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)           # Hopper (H100/H200); override on the command line
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flag; .cu files include the C++20 headers.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    find_package(CUDAToolkit REQUIRED)           # CUDA::cudart, CUDA::cublas
    # NCCL: the toolkit's or the system's, or a pip wheel's (nvidia-nccl-cu13 ships
    # nvidia/nccl/{include,lib} with libnccl.so.2 alone, no libnccl.so): STRATA_NCCL_ROOT (or
    # the environment variable) names that folder, searched first for either name.
    set(STRATA_NCCL_ROOT "$ENV{STRATA_NCCL_ROOT}" CACHE PATH
        "NCCL's folder (include/, lib/), e.g. <site-packages>/nvidia/nccl of torch's wheel")
    find_library(STRATA_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
                 HINTS ${STRATA_NCCL_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib)
    find_path(STRATA_NCCL_INCLUDE_DIR nccl.h
              HINTS ${STRATA_NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS})
    if(STRATA_NCCL_LIBRARY AND STRATA_NCCL_INCLUDE_DIR)
      add_library(strata_nccl UNKNOWN IMPORTED)
      set_target_properties(strata_nccl PROPERTIES IMPORTED_LOCATION "${STRATA_NCCL_LIBRARY}"
                            INTERFACE_INCLUDE_DIRECTORIES "${STRATA_NCCL_INCLUDE_DIR}")
      add_library(strata::nccl ALIAS strata_nccl)
      set(STRATA_NCCL_ENABLED ON)
    endif()
    set(STRATA_CUDA_ENABLED ON)
  elseif(STRATA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STRATA_WITH_CUDA=ON but no CUDA compiler was found; install the CUDA "
                        "toolkit or set CUDACXX to nvcc")
  endif()
endif()
# MPI (Open MPI) is optional: the collectives of several ranks on host memory, and the tests
# that start ranks with mpirun.
set(STRATA_MPI_ENABLED OFF)
if(NOT STRATA_WITH_MPI STREQUAL "OFF")
  # The C API, used from C++: the CXX component without the deprecated C++ bindings.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX)               # MPI::MPI_CXX, MPIEXEC_EXECUTABLE
  if(MPI_CXX_FOUND)
    set(STRATA_MPI_ENABLED ON)
  elseif(STRATA_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "STRATA_WITH_MPI=ON but MPI was not found; install libopenmpi-dev")
  endif()
endif()
set(strata_nccl_found_at "")
if(STRATA_NCCL_ENABLED)
  set(strata_nccl_found_at " (${STRATA_NCCL_LIBRARY})")
endif()
message(STATUS "Strata: CUDA ${STRATA_CUDA_ENABLED}, "
               "NCCL ${STRATA_NCCL_ENABLED}${strata_nccl_found_at}, "
               "MPI ${STRATA_MPI_ENABLED}, "
               "liburing ${liburing_VERSION}, "
               "xxHash ${xxhash_VERSION}, TBB ${TBB_VERSION}, Boost ${Boost_VERSION}")

# Python (optional): the nanobind extension behind `import strata`. Found through the
# interpreter (scripts/python-env.sh's venv: -DPython_EXECUTABLE=<venv>/bin/python), which must
# have nanobind installed; torch is only needed at run time, never to build.
set(STRATA_PYTHON_ENABLED OFF)
if(NOT STRATA_WITH_PYTHON STREQUAL "OFF")
  find_package(Python 3.9 COMPONENTS Interpreter Development.Module)
  if(Python_FOUND)
    execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
                    OUTPUT_VARIABLE nanobind_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE strata_nanobind_missing ERROR_QUIET)
    if(NOT strata_nanobind_missing)
      find_package(nanobind CONFIG)
    endif()
  endif()
  if(nanobind_FOUND)
    set(STRATA_PYTHON_ENABLED ON)
  elseif(STRATA_WITH_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "STRATA_WITH_PYTHON=ON but no Python with nanobind was found; run "
                        "scripts/python-env.sh and pass -DPython_EXECUTABLE=<venv>/bin/python")
  else()
    message(STATUS "Python extension: off (no Python with nanobind; see scripts/python-env.sh)")
  endif()
endif()
