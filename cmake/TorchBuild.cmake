# Compiling against LibTorch, made affordable on a small machine. A unit that
# includes LibTorch's headers spends ~20 s on two cores parsing them,
# instantiating their templates and generating code for their inline
# functions; our own code is a small part of that. Two remedies, measured on
# the eight sources of shardtrain_strategy (bench/RESULTS.md, build times):
#
#  - unity builds: a target's LibTorch sources compiled as one unit, so the
#    headers are parsed and their templates instantiated once per target
#    rather than once per source (164 s -> 28 s);
#  - a precompiled <torch/torch.h> shared by all such targets (28 s -> 19 s;
#    the header costs ~30 s to make, once for libraries and once for
#    executables, because GCC uses it only under the -fPIC/-fPIE it was made
#    with. Any other difference makes GCC ignore it and parse the header as
#    usual (-Winvalid-pch, which CMake adds, says so): a mismatch costs time,
#    never correctness.)
#
#   shardtrain_torch_sources(TARGET)   TARGET's sources compile against LibTorch
#
# Both are on by default with GCC (scripts/build). Clang builds (the
# sanitizers, the fuzzers, the lock analysis) compile each source alone,
# which also keeps every source honest about its own #includes.
# -DSHARDTRAIN_TORCH_PCH=OFF / -DSHARDTRAIN_TORCH_UNITY=OFF turn them off.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(_shardtrain_fast_default ON)
else()
  set(_shardtrain_fast_default OFF)
endif()
option(SHARDTRAIN_TORCH_PCH "Precompile LibTorch's headers" ${_shardtrain_fast_default})
option(SHARDTRAIN_TORCH_UNITY "Compile each LibTorch target's sources as one unit"
       ${_shardtrain_fast_default})

set(_shardtrain_pch_dir ${CMAKE_CURRENT_LIST_DIR}/pch)

if(SHARDTRAIN_TORCH_PCH)
  add_library(shardtrain_torch_pch_lib STATIC ${_shardtrain_pch_dir}/pch_host.cc)
  target_link_libraries(shardtrain_torch_pch_lib PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(shardtrain_torch_pch_lib PRIVATE ${_shardtrain_pch_dir}/torch_pch.h)

  add_executable(shardtrain_torch_pch_exe ${_shardtrain_pch_dir}/pch_host.cc
                 ${_shardtrain_pch_dir}/pch_main.cc)
  target_link_libraries(shardtrain_torch_pch_exe PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(shardtrain_torch_pch_exe PRIVATE ${_shardtrain_pch_dir}/torch_pch.h)
  set_target_properties(shardtrain_torch_pch_exe PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/pch)
endif()

# The programs that run LibTorch on the CPU allocate with tcmalloc when it is
# installed (Debian's libtcmalloc-minimal4; scripts/setup installs it). A step
# frees and makes again the same large tensors (activations, logits, gathered
# units); glibc's malloc hands each one above its mmap threshold back to the
# kernel, which faults in and zeroes its pages anew on the next step, while
# tcmalloc keeps them: the in-process strategy tests run 28% faster, an
# 8-rank gpt2-mini gradient check 3.5x (bench/RESULTS.md §16). Not under the
# sanitizers, which bring their own allocator. -DSHARDTRAIN_TCMALLOC=OFF
# keeps glibc's.
option(SHARDTRAIN_TCMALLOC "Link LibTorch programs with tcmalloc when installed" ON)

#   shardtrain_torch_allocator(TARGET)  TARGET (a program) allocates with tcmalloc
function(shardtrain_torch_allocator target)
  if(NOT SHARDTRAIN_TCMALLOC OR SHARDTRAIN_SANITIZE)
    return()
  endif()
  # The runtime package alone is enough: its versioned file is linked by name.
  find_library(SHARDTRAIN_TCMALLOC_LIBRARY NAMES tcmalloc_minimal libtcmalloc_minimal.so.4)
  if(NOT SHARDTRAIN_TCMALLOC_LIBRARY)
    if(NOT SHARDTRAIN_TCMALLOC_WARNED)
      message(STATUS "tcmalloc not found (libtcmalloc-minimal4): LibTorch programs use glibc's malloc")
      set(SHARDTRAIN_TCMALLOC_WARNED ON CACHE INTERNAL "")
    endif()
    return()
  endif()
  # Nothing calls into it by name: linked even where the linker drops
  # libraries that no symbol needs (--as-needed). One item, so that CMake's
  # de-duplication of link items cannot take a --pop-state away.
  target_link_libraries(${target} PRIVATE
    "-Wl,--push-state,--no-as-needed,${SHARDTRAIN_TCMALLOC_LIBRARY},--pop-state")
  target_compile_definitions(${target} PRIVATE SHARDTRAIN_WITH_TCMALLOC=1)
endfunction()

function(shardtrain_torch_sources target)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "EXECUTABLE")
    shardtrain_torch_allocator(${target})
  endif()
  if(SHARDTRAIN_TORCH_UNITY)
    # Up to 16 sources a unit: on two cores fewer, larger units win; the
    # largest target has nine.
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
  endif()
  if(SHARDTRAIN_TORCH_PCH)
    if(type STREQUAL "EXECUTABLE")
      target_precompile_headers(${target} REUSE_FROM shardtrain_torch_pch_exe)
    else()
      target_precompile_headers(${target} REUSE_FROM shardtrain_torch_pch_lib)
    endif()
  endif()
endfunction()
