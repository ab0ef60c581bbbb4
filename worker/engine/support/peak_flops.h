// The MFU denominator: a device's dense peak FLOP/s.
//
// GPUs come from a table of datasheet peaks keyed by device name and
// precision. CPUs have no useful datasheet figure: the fp32 GEMM rate per
// core is measured (the best of the first five runs on the machine) and
// cached under $XDG_CACHE_HOME/shardtrain (or ~/.cache/shardtrain); a rank's
// peak is its threads times that, whatever the strategy.
#ifndef SHARDTRAIN_WORKER_ENGINE_SUPPORT_PEAK_FLOPS_H_
#define SHARDTRAIN_WORKER_ENGINE_SUPPORT_PEAK_FLOPS_H_

#include <torch/types.h>

#include <string>

namespace shardtrain {

// Datasheet dense peak for a GPU name such as "NVIDIA H200"; 0 when unknown.
double GpuPeakFlops(const std::string& device_name, bool bf16);

// Measured fp32 matmul rate of this CPU with the current thread settings.
double MeasureCpuGemmFlops();

// Peak for `device` at `precision` ("fp32"/"bf16"): table on CUDA; on CPU
// `cpu_threads` (SetCpuComputeThreads) times the per-core rate, cached.
double PeakFlops(const torch::Device& device, const std::string& precision,
                 int cpu_threads);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_SUPPORT_PEAK_FLOPS_H_
