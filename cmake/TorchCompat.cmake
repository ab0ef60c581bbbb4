# What the LibTorch found by find_package(Torch) requires of us, checked once
# here: its C++ standard, its libstdc++ ABI, and, for a CUDA build, where
# NCCL's header is. Supported: Debian's LibTorch 1.13 (CPU) and the LibTorch
# of a PyTorch 2.x install (pip wheel, CUDA), 2.7 or newer.
#
# Sets SHARDTRAIN_WITH_CUDA (ON for a CUDA LibTorch), SHARDTRAIN_NCCL_INCLUDE_DIR
# (its nccl.h) and SHARDTRAIN_SYSTEM_TORCH (ON for a LibTorch under /usr, which
# links Gloo as a shared library of its own).

message(STATUS "shardtrain: LibTorch ${Torch_VERSION} (${Torch_DIR})")
if(Torch_VERSION VERSION_LESS 1.13)
  message(FATAL_ERROR
    "shardtrain needs LibTorch 1.13 or newer; ${Torch_DIR} is ${Torch_VERSION}")
endif()

# LibTorch dictates the libstdc++ string ABI. PyTorch's pip wheels before 2.7
# used the old one (_GLIBCXX_USE_CXX11_ABI=0), which Debian's Abseil, yaml-cpp
# and gRPC cannot link with: refuse them here rather than at link time.
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(FATAL_ERROR
    "LibTorch ${Torch_VERSION} at ${Torch_DIR} was built with the pre-C++11 "
    "libstdc++ ABI (_GLIBCXX_USE_CXX11_ABI=0), as PyTorch's pip wheels before "
    "2.7 are. The system libraries shardtrain links (Abseil, yaml-cpp, gRPC) "
    "use the C++11 ABI, so they cannot be mixed. Use PyTorch 2.7 or newer, or "
    "the cxx11-ABI LibTorch archive from pytorch.org.")
endif()
# Newer TorchConfig.cmake files leave TORCH_CXX_FLAGS empty (C++11 ABI only).
add_compile_options(${TORCH_CXX_FLAGS})

# PyTorch's headers refuse C++17 from 2.14 on (ATen.h: "C++20 or later
# compatible compiler is required").
if(Torch_VERSION VERSION_GREATER_EQUAL 2.14)
  set(CMAKE_CXX_STANDARD 20)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND
     CMAKE_CXX_COMPILER_VERSION VERSION_LESS 11)
    message(FATAL_ERROR "LibTorch ${Torch_VERSION} needs C++20: GCC 11 or newer "
      "(this is GCC ${CMAKE_CXX_COMPILER_VERSION})")
  endif()
endif()
message(STATUS "shardtrain: C++${CMAKE_CXX_STANDARD}")

string(FIND "${Torch_DIR}" "/usr/" system_prefix)
if(system_prefix EQUAL 0 AND NOT Torch_DIR MATCHES "site-packages|dist-packages")
  set(SHARDTRAIN_SYSTEM_TORCH ON)
else()
  set(SHARDTRAIN_SYSTEM_TORCH OFF)
endif()

# A LibTorch built with CUDA enables the CUDA paths: caching-allocator memory
# stats, GPU peak FLOPs, NCCL.
set(SHARDTRAIN_WITH_CUDA OFF)
if(TARGET torch_cuda)
  set(SHARDTRAIN_WITH_CUDA ON)
  # ProcessGroupNCCL.hpp includes <nccl.h>, which LibTorch does not ship. Its
  # Options struct embeds ncclConfig_t, so the header must be the version
  # LibTorch was built with: a pip install's own nvidia-nccl package first.
  get_filename_component(site_packages "${Torch_DIR}/../../../.." ABSOLUTE)
  find_path(SHARDTRAIN_NCCL_INCLUDE_DIR nccl.h
    HINTS "$ENV{NCCL_INCLUDE_DIR}" "$ENV{NCCL_HOME}/include"
          "${site_packages}/nvidia/nccl/include"
          ${CUDAToolkit_INCLUDE_DIRS} "$ENV{CUDA_HOME}/include"
          /usr/local/cuda/include
    NO_CMAKE_FIND_ROOT_PATH)
  if(NOT SHARDTRAIN_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR
      "LibTorch ${Torch_VERSION} has CUDA but nccl.h was not found (looked in "
      "$NCCL_INCLUDE_DIR, ${site_packages}/nvidia/nccl/include and the CUDA "
      "toolkit). Install the nvidia-nccl package of this PyTorch or set "
      "NCCL_INCLUDE_DIR.")
  endif()
  message(STATUS "shardtrain: LibTorch has CUDA; nccl.h from ${SHARDTRAIN_NCCL_INCLUDE_DIR}")
endif()
