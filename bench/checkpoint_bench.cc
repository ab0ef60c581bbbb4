// Checkpoint save and load: time and bytes per rank for gpt2-mini's model
// and AdamW state at world 1, 2 and 4, in the format every strategy writes
// (core/checkpoint/checkpoint_format.h) and in the per-strategy layout it
// replaced (one PyTorch tensor file per rank for FSDP; rank 0 alone writing
// model.pt + optimizer.pt for single and DDP, every rank reading them back),
// written by the same tensor-file writer that layout used. Ranks are threads
// over an in-process communicator; files go to --dir (default: a directory
// under /tmp), fsynced as in training.
//
//   build/bench/checkpoint_bench [--model gpt2-mini] [--dir /tmp/x] [--repeat
//   3]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/run/train_config.h"
#include "tests/fakes/in_process_communicator.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/strategy/strategy_factory.h"
#include "worker/engine/support/tensor_file.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t DirBytes(const fs::path& dir, const std::string& prefix) {
  int64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) {
      bytes += static_cast<int64_t>(entry.file_size());
    }
  }
  return bytes;
}

struct Result {
  double save_s = 1e9, load_s = 1e9;
  std::vector<int64_t> bytes;  // per rank
};

// One layout's save (all ranks at once) and load (fresh ranks), the best of
// `repeat`.
Result Measure(const std::string& model, const std::string& strategy,
               int64_t world, bool new_format, const fs::path& root,
               int repeat) {
  Result result;
  result.bytes.assign(world, 0);
  for (int r = 0; r < repeat; ++r) {
    const fs::path dir = root / absl::StrCat(strategy, world, new_format, r);
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::vector<double> save(world), load(world);
    RunRanks(world, [&](int64_t rank, Communicator& comm) {
      torch::set_num_threads(1);
      auto make = [&] {
        TrainConfig config;
        config.strategy = strategy;
        StrategyOptions options;
        options.rank = rank;
        options.world_size = world;
        auto s = CreateStrategy(config, options, &comm);
        Gpt2 gpt(*ParseModelSpec(model), /*seed=*/1);
        (void)(*s)->Setup(gpt);
        return std::move(*s);
      };
      std::unique_ptr<Strategy> writer = make();
      writer->Barrier();
      auto start = Clock::now();
      if (new_format) {
        (void)writer->SaveCheckpoint(dir.string());
      } else {
        // What each rank of the old layout wrote: FSDP its shard, the
        // replicated strategies rank 0 everything.
        if (strategy == "fsdp" || rank == 0) {
          NamedTensors tensors;
          for (const StateSlice& slice : writer->StateSlices(false)) {
            tensors.emplace_back(absl::StrCat(slice.name, "@", slice.offset),
                                 slice.data);
          }
          (void)SaveTensorFile(
              (dir / absl::StrCat("old_rank", rank, ".pt")).string(), tensors);
        }
      }
      writer->Barrier();
      save[rank] = Since(start);
      std::unique_ptr<Strategy> reader = make();
      reader->Barrier();
      start = Clock::now();
      if (new_format) {
        (void)reader->LoadCheckpoint(dir.string());
      } else {
        const int64_t source = strategy == "fsdp" ? rank : 0;
        (void)LoadTensorFile(
            (dir / absl::StrCat("old_rank", source, ".pt")).string());
      }
      reader->Barrier();
      load[rank] = Since(start);
    });
    result.save_s = std::min(result.save_s, save[0]);
    result.load_s = std::min(result.load_s, load[0]);
    for (int64_t rank = 0; rank < world; ++rank) {
      result.bytes[rank] =
          new_format ? static_cast<int64_t>(fs::file_size(
                           dir / absl::StrFormat("rank-%05d.bin", rank)))
                     : (fs::exists(dir / absl::StrCat("old_rank", rank, ".pt"))
                            ? DirBytes(dir, absl::StrCat("old_rank", rank, "."))
                            : 0);
    }
    fs::remove_all(dir);
  }
  return result;
}

std::string Mib(int64_t bytes) {
  return absl::StrFormat("%.1f", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace
}  // namespace shardtrain

int main(int argc, char** argv) {
  using namespace shardtrain;
  std::string model = "gpt2-mini";
  std::string dir = "/tmp/shardtrain_checkpoint_bench";
  int repeat = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--model") model = argv[i + 1];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--repeat") repeat = std::atoi(argv[i + 1]);
  }
  fs::create_directories(dir);
  std::printf(
      "| strategy | world | layout | save (s) | load (s) | MiB per rank |\n"
      "|---|---|---|---|---|---|\n");
  const std::vector<std::pair<std::string, int64_t>> runs = {
      {"single", 1}, {"ddp", 2}, {"fsdp", 2}, {"ddp", 4}, {"fsdp", 4}};
  for (const auto& [strategy, world] : runs) {
    for (bool new_format : {false, true}) {
      const Result r = Measure(model, strategy, world, new_format, dir, repeat);
      std::string per_rank;
      for (int64_t b : r.bytes) {
        absl::StrAppend(&per_rank, per_rank.empty() ? "" : " / ", Mib(b));
      }
      std::printf("| %s | %ld | %s | %.3f | %.3f | %s |\n", strategy.c_str(),
                  static_cast<long>(world),
                  new_format ? "one format (checkpoint.json)" : "per-strategy",
                  r.save_s, r.load_s, per_rank.c_str());
      std::fflush(stdout);
    }
  }
  fs::remove_all(dir);
  return 0;
}
