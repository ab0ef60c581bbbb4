#include "worker/engine/support/cpu_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// How capable an OpenBLAS core's kernels are: 0 pre-AVX, 1 AVX, 2 AVX2,
// 3 AVX-512.
int CoreRank(const std::string& core) {
  const std::string c = absl::AsciiStrToLower(core);
  if (c == "skylakex" || c == "cooperlake" || c == "sapphirerapids") return 3;
  if (c == "haswell" || c == "zen" || c == "excavator") return 2;
  if (c == "sandybridge" || c == "bulldozer" || c == "piledriver" ||
      c == "steamroller") {
    return 1;
  }
  return 0;
}

bool HasFlag(const std::string& cpuinfo, const char* flag) {
  const size_t line = cpuinfo.find("\nflags");
  if (line == std::string::npos) return false;
  const size_t end = cpuinfo.find('\n', line + 1);
  const std::string flags =
      " " + cpuinfo.substr(line + 1, end - line - 1) + " ";
  return absl::StrContains(flags, absl::StrCat(" ", flag, " "));
}

}  // namespace

const char* BlasCoreTypeFor(const char* cpuinfo) {
  const std::string text = std::string("\n") + cpuinfo;
  if (HasFlag(text, "avx512f") && HasFlag(text, "avx512bw") &&
      HasFlag(text, "avx512vl")) {
    return "SkylakeX";
  }
  if (HasFlag(text, "avx2") && HasFlag(text, "fma")) return "Haswell";
  return "";
}

const char* BlasCoreName() {
  using CoreName = char* (*)();
  auto get =
      reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return get == nullptr ? "" : get();
}

const char* MallocName() {
  return dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr ? "tcmalloc"
                                                     : "glibc malloc";
}

void ReexecForFasterBlasKernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string current = BlasCoreName();
  if (current.empty()) return;  // not OpenBLAS
  std::ifstream in("/proc/cpuinfo");
  std::stringstream cpuinfo;
  cpuinfo << in.rdbuf();
  const char* best = BlasCoreTypeFor(cpuinfo.str().c_str());
  if (*best == '\0' || CoreRank(best) <= CoreRank(current)) return;
  // Re-run this very program by its real path (so the process keeps its
  // name); only when argv[0] names it too, which rules out running under a
  // loader or a tool (ld.so, valgrind) whose binary /proc/self/exe would be.
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0 || argv == nullptr || argv[0] == nullptr) return;
  path[length] = '\0';
  const std::string exe(path);
  const std::string self(argv[0]);
  const auto base = [](const std::string& p) {
    return p.substr(p.find_last_of('/') + 1);
  };
  if (base(exe) != base(self)) return;
  setenv("OPENBLAS_CORETYPE", best, /*overwrite=*/1);
  execv(path, argv);
  // exec failed: carry on with the kernels we have.
}

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

int CpuComputeThreads() {
  using GetThreads = int (*)();
  static const auto openblas_threads = reinterpret_cast<GetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return openblas_threads != nullptr ? openblas_threads()
                                     : at::get_num_threads();
}

}  // namespace shardtrain
