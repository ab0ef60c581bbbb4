// How many cores one rank's math may use on CPU.
#ifndef SHARDTRAIN_WORKER_ENGINE_SUPPORT_CPU_THREADS_H_
#define SHARDTRAIN_WORKER_ENGINE_SUPPORT_CPU_THREADS_H_

namespace shardtrain {

// Gives this process `threads` cores for computation. With OpenBLAS (Debian's
// LibTorch calls the system BLAS) the matrix products get `threads` OpenBLAS
// threads and ATen's own OpenMP pool one thread: OpenBLAS's pthread pool and
// ATen's OpenMP pool otherwise spin against each other on the same cores
// (gpt2-tiny step 0.40 s vs 0.55 s on 2 cores, see bench/RESULTS.md). Any
// other BLAS: ATen gets `threads`. Returns a description for the log.
const char* SetCpuComputeThreads(int threads);

// The threads this process computes with on CPU (SetCpuComputeThreads's
// `threads`): OpenBLAS's when it does the matrix products, else ATen's.
int CpuComputeThreads();

// The OpenBLAS core type this CPU's flags support ("SkylakeX" with AVX-512,
// "Haswell" with AVX2 and FMA), or "" for none of them; `cpuinfo` is the text
// of /proc/cpuinfo.
const char* BlasCoreTypeFor(const char* cpuinfo);

// OpenBLAS picks its kernels from the CPU's family and model; on virtual
// machines that report a generic model ("Intel(R) Xeon(R) Processor") it
// falls back to Prescott (SSE3) kernels, 5x slower on an AVX-512 machine
// (46 vs 227 GFLOP/s for a 1024^3 product here). It reads OPENBLAS_CORETYPE
// only when it loads, before main(): so when OpenBLAS is in use, the variable
// is unset and the CPU's flags support a better core than OpenBLAS chose,
// this sets it and re-executes the program with the same arguments (once;
// not when argv[0] names another program than /proc/self/exe, as under
// ld.so or valgrind). Otherwise it returns. Call first thing in main();
// children inherit the variable.
void ReexecForFasterBlasKernels(char** argv);

// The core OpenBLAS runs (e.g. "SkylakeX"), or "" without OpenBLAS.
const char* BlasCoreName();

// The allocator behind malloc in this process: "tcmalloc" when the program
// was linked with it (cmake/TorchBuild.cmake: LibTorch's CPU tensors of a
// step are freed and made again every step, and glibc returns each one above
// its mmap threshold to the kernel, which zeroes its pages anew), else
// "glibc malloc".
const char* MallocName();

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_SUPPORT_CPU_THREADS_H_
