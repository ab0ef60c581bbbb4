#include "worker/engine/support/peak_flops.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#ifdef SHARDTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "nlohmann/json.hpp"
#include "worker/engine/support/cpu_threads.h"

namespace shardtrain {
namespace {

std::filesystem::path CacheFile() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::filesystem::path dir =
      xdg != nullptr && *xdg != '\0'
          ? std::filesystem::path(xdg)
          : std::filesystem::path(home ? home : "/tmp") / ".cache";
  return dir / "shardtrain" / "peak_flops.json";
}

}  // namespace

double GpuPeakFlops(const std::string& name, bool bf16) {
  // Dense (no sparsity) peaks; fp32 means plain FP32 CUDA cores.
  struct Entry {
    const char* key;
    double bf16;
    double fp32;
  };
  static constexpr Entry kTable[] = {
      {"H200", 989.4e12, 66.9e12}, {"H100", 989.4e12, 66.9e12},
      {"A100", 312e12, 19.5e12},   {"L40S", 362e12, 91.6e12},
      {"A10G", 70e12, 31.2e12},    {"RTX 4090", 165.2e12, 82.6e12},
      {"V100", 125e12, 15.7e12},
  };
  for (const Entry& entry : kTable) {
    if (absl::StrContains(name, entry.key)) {
      return bf16 ? entry.bf16 : entry.fp32;
    }
  }
  return 0;
}

double MeasureCpuGemmFlops() {
  torch::NoGradGuard no_grad;
  constexpr int64_t n = 1024;
  torch::Tensor a = torch::randn({n, n});
  torch::Tensor b = torch::randn({n, n});
  torch::Tensor c = torch::empty({n, n});
  torch::mm_out(c, a, b);  // warm-up
  double best = 1e30;
  for (int i = 0; i < 10; ++i) {  // best of 10: robust to a busy machine
    const auto start = std::chrono::steady_clock::now();
    torch::mm_out(c, a, b);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    best = std::min(best, seconds);
  }
  return 2.0 * n * n * n / best;
}

double PeakFlops(const torch::Device& device, const std::string& precision,
                 int cpu_threads) {
#ifdef SHARDTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(
            &prop, device.index() < 0 ? 0 : device.index()) == cudaSuccess) {
      return GpuPeakFlops(prop.name, precision == "bf16");
    }
    return 0;
  }
#endif
  (void)device;
  (void)precision;
  // One per-core figure for every thread count, so that MFU means the same
  // under every strategy: one rank of two threads and two ranks of one share
  // a denominator (the peak of the cores used). The best measurement kept:
  // a busy machine only measures slower, so the first measurements go on
  // until kSamples agree to take the best of them (about 0.5 s each), and a
  // figure cached from a busy moment does not stick. Keyed by OpenBLAS's
  // kernels too: the same machine runs 5x apart between its generic and its
  // AVX-512 ones (cpu_threads.h).
  constexpr int kSamples = 5;
  const std::string core = BlasCoreName();
  const std::string key =
      absl::StrCat("cpu_fp32_per_core", core.empty() ? "" : "_",
                   absl::AsciiStrToLower(core));
  const std::filesystem::path path = CacheFile();
  // Read as every file of the process's own: regular, bounded, never
  // blocking, its nesting checked before the parse. Anything else is
  // measured again.
  nlohmann::json cache = nlohmann::json::object();
  {
    absl::StatusOr<std::string> text =
        ReadOwnFile(path.string(), 1 << 20, "the peak FLOPs cache");
    if (text.ok() && CheckJsonNesting(*text, 8, path.string()).ok()) {
      cache = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (!cache.is_object()) cache = nlohmann::json::object();
    }
  }
  double per_core = 0;
  int samples = 0;
  if (cache.contains(key) && cache[key].is_object()) {
    try {
      per_core = cache[key].value("flops", 0.0);
      samples = cache[key].value("samples", 0);
    } catch (const nlohmann::json::exception&) {
      per_core = 0;  // a field of the wrong type: measured again
      samples = 0;
    }
  }
  const int threads = std::max(1, cpu_threads);
  if (per_core > 0 && samples >= kSamples) return threads * per_core;
  per_core = std::max(per_core, MeasureCpuGemmFlops() / threads);
  cache[key] = {{"flops", per_core}, {"samples", samples + 1}};
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  // Best effort: a cache only (concurrent ranks may each write theirs).
  (void)WriteFileAtomically(path.string(), cache.dump(2) + "\n");
  return threads * per_core;
}

}  // namespace shardtrain
