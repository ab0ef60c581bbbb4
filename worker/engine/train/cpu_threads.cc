#include "worker/engine/train/cpu_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace shardtrain {

const char* SetCpuComputeThreads(int threads) {
  using SetThreads = void (*)(int);
  auto openblas_set_num_threads = reinterpret_cast<SetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas_set_num_threads != nullptr) {
    openblas_set_num_threads(threads);
    at::set_num_threads(1);
    return "OpenBLAS";
  }
  at::set_num_threads(threads);
  return "ATen";
}

}  // namespace shardtrain
