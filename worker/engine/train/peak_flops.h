// The MFU denominator: a device's dense peak FLOP/s.
//
// GPUs come from a table of datasheet peaks keyed by device name and
// precision. CPUs have no useful datasheet figure, so the fp32 GEMM rate is
// measured once per thread count and cached under
// $XDG_CACHE_HOME/shardtrain (or ~/.cache/shardtrain).
#ifndef SHARDTRAIN_WORKER_ENGINE_TRAIN_PEAK_FLOPS_H_
#define SHARDTRAIN_WORKER_ENGINE_TRAIN_PEAK_FLOPS_H_

#include <torch/types.h>

#include <string>

namespace shardtrain {

// Datasheet dense peak for a GPU name such as "NVIDIA H200"; 0 when unknown.
double GpuPeakFlops(const std::string& device_name, bool bf16);

// Measured fp32 matmul rate of this CPU with the current thread settings.
double MeasureCpuGemmFlops();

// Peak for `device` at `precision` ("fp32"/"bf16"): table on CUDA; on CPU the
// measurement for `cpu_threads` compute threads (SetCpuComputeThreads), cached.
double PeakFlops(const torch::Device& device, const std::string& precision,
                 int cpu_threads);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_TRAIN_PEAK_FLOPS_H_
