# Unity builds for the torch-free libraries (the daemon's, the CLI's and
# core's). Their units spend most of their time parsing the same headers
# (gRPC, Protobuf's generated code, Abseil, nlohmann-json, CLI11): a
# shardtrain_server unit parses for about 4.5 s of its 5-8, a CLI unit 9 of
# 18. Compiling up to 8 of a target's sources as one unit parses them once
# per 8 (docs/contributing/testing.md has the measured cut). LibTorch
# targets have their own (cmake/TorchBuild.cmake). Each source keeps its
# file-local helpers in a namespace named after the file or with names
# that no sibling uses, so that a unit of several compiles.
#
#   shardtrain_unity(TARGET ...)   TARGETs' sources compile in units of 8
#
# On by default with GCC; clang builds (the sanitizers, the fuzzers, the
# lock analysis) compile each source alone, which keeps every source honest
# about its own #includes. -DSHARDTRAIN_UNITY=OFF turns it off.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(_shardtrain_unity_default ON)
else()
  set(_shardtrain_unity_default OFF)
endif()
option(SHARDTRAIN_UNITY "Compile the torch-free libraries' sources in units of 8"
       ${_shardtrain_unity_default})

function(shardtrain_unity)
  if(NOT SHARDTRAIN_UNITY)
    return()
  endif()
  foreach(target ${ARGN})
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  endforeach()
endfunction()
