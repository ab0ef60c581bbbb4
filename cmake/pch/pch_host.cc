// The unit that makes cmake/TorchBuild.cmake's precompiled header; it has no
// code of its own.
