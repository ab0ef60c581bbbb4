// The header cmake/TorchBuild.cmake precompiles: what nearly every unit that
// uses LibTorch includes, directly or through the engine's headers.
#include <torch/torch.h>
