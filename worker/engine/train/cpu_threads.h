// How many cores one rank's math may use on CPU.
#ifndef SHARDTRAIN_WORKER_ENGINE_TRAIN_CPU_THREADS_H_
#define SHARDTRAIN_WORKER_ENGINE_TRAIN_CPU_THREADS_H_

namespace shardtrain {

// Gives this process `threads` cores for computation. With OpenBLAS (Debian's
// LibTorch calls the system BLAS) the matrix products get `threads` OpenBLAS
// threads and ATen's own OpenMP pool one thread: OpenBLAS's pthread pool and
// ATen's OpenMP pool otherwise spin against each other on the same cores
// (gpt2-tiny step 0.40 s vs 0.55 s on 2 cores, see bench/RESULTS.md). Any
// other BLAS: ATen gets `threads`. Returns a description for the log.
const char* SetCpuComputeThreads(int threads);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_TRAIN_CPU_THREADS_H_
