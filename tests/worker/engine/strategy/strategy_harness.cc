#include "tests/worker/engine/strategy/strategy_harness.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include "core/model/model_config.h"
#include "core/model/safetensors.h"
#include "core/run/train_config.h"
#include "tests/fakes/in_process_communicator.h"
#include "worker/engine/model/create_model.h"
#include "worker/engine/model/llmc_checkpoint.h"
#include "worker/engine/strategy/strategy_factory.h"

namespace shardtrain::test {

Gpt2 MakeModel(const std::string& spec, uint64_t seed) {
  absl::StatusOr<ModelConfig> config = ParseModelSpec(spec);
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<Gpt2> model = CreateGpt2(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

CausalLm MakeCausalLm(const std::string& spec, uint64_t seed) {
  absl::StatusOr<ModelConfig> config = ParseModelSpec(spec);
  EXPECT_TRUE(config.ok()) << config.status();
  absl::StatusOr<CausalLm> model = CreateCausalLm(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

torch::Tensor MakeBatches(int64_t steps, int64_t rows, int64_t seq_len,
                          int64_t vocab) {
  torch::manual_seed(1234);
  return torch::randint(0, vocab, {steps, rows, seq_len + 1}, torch::kInt64);
}

std::pair<torch::Tensor, torch::Tensor> Slice(const torch::Tensor& batches,
                                              int64_t step, int64_t first,
                                              int64_t count) {
  const int64_t seq_len = batches.size(2) - 1;
  torch::Tensor rows = batches[step].narrow(0, first, count);
  return {rows.narrow(1, 0, seq_len).contiguous(),
          rows.narrow(1, 1, seq_len).contiguous()};
}

TrainLoop MakeLoop(int64_t first_step, int64_t last_step, int64_t micro_steps,
                   double lr, double max_norm) {
  TrainLoop loop;
  loop.first_step = first_step;
  loop.last_step = last_step;
  loop.micro_steps = micro_steps;
  loop.lr = lr;
  loop.max_norm = max_norm;
  return loop;
}

void Train(Strategy& strategy, const torch::Tensor& batches, int64_t rank,
           int64_t world, const TrainLoop& loop, TrainResult* result) {
  (void)world;
  const int64_t replica = strategy.data_parallel_rank();
  const int64_t rank_rows = batches.size(1) / strategy.data_parallel_size();
  const int64_t micro_rows = rank_rows / loop.micro_steps;
  for (int64_t step = loop.first_step; step < loop.last_step; ++step) {
    double loss = 0;
    std::vector<Batch> step_batches;
    for (int64_t micro = 0; micro < loop.micro_steps; ++micro) {
      auto [inputs, targets] = Slice(
          batches, step, replica * rank_rows + micro * micro_rows, micro_rows);
      if (loop.whole_steps) {
        step_batches.push_back({inputs, targets});
        continue;
      }
      loss += strategy
                  .ForwardBackward(inputs, targets, 1.0 / loop.micro_steps,
                                   /*sync=*/micro + 1 == loop.micro_steps)
                  .item<double>();
      const CommStats comm = strategy.TakeCommStats();
      result->micro_comm_bytes.push_back(comm.bytes);
      result->micro_inter_group_bytes.push_back(comm.inter_group_bytes);
    }
    if (loop.whole_steps) {
      loss = strategy.ForwardBackwardStep(step_batches).item<double>() *
             static_cast<double>(loop.micro_steps);
      result->step_comm.push_back(strategy.TakeCommStats());
    }
    if (loop.after_backward) loop.after_backward(step);
    if (loop.tamper) loop.tamper(step, strategy);
    if (loop.record_gradients) {
      std::vector<StateSlice> slices = strategy.GradientSlices();
      for (StateSlice& slice : slices) slice.data = slice.data.clone();
      result->gradients.push_back(std::move(slices));
    }
    result->norms.push_back(strategy.ClipGradNorm(loop.max_norm));
    result->state_bytes = strategy.ModelStateBytes();
    strategy.OptimizerStep(loop.lr);
    result->losses.push_back(strategy.AllReduceMean(loss / loop.micro_steps));
    strategy.TakeCommStats();  // the loss's and the norm's reductions
  }
  auto [inputs, targets] = Slice(batches, 0, replica * rank_rows, rank_rows);
  result->eval_loss = strategy.AllReduceMean(
      strategy.ForwardLoss(inputs, targets).item<double>());
  strategy.TakeCommStats();
}

ParamMap FullParameters(Strategy& strategy, const std::string& spec,
                        const std::string& dir) {
  const std::string path = dir + "/full-parameters.bin";
  const absl::Status exported = strategy.ExportModel(path);
  EXPECT_TRUE(exported.ok()) << exported;
  strategy.Barrier();  // rank 0 has written it
  ParamMap params;
  absl::StatusOr<ModelConfig> config = ParseModelSpec(spec);
  EXPECT_TRUE(config.ok()) << config.status();
  if (config.ok() && config->is_llama()) {
    // Hugging Face's safetensors: "model." before every name but lm_head.
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status();
    if (file.ok()) {
      for (const SafetensorsEntry& entry : file->tensors()) {
        torch::Tensor value = torch::empty(entry.shape, torch::kFloat);
        const absl::Status read =
            file->ReadAsFloat(entry, value.data_ptr<float>());
        EXPECT_TRUE(read.ok()) << read;
        std::string name = entry.name;
        if (name.rfind("model.", 0) == 0) name = name.substr(6);
        params[name] = value;
      }
    }
  } else {
    Gpt2 model = MakeModel(spec, /*seed=*/0);
    const absl::Status loaded = LoadLlmcCheckpoint(path, model);
    EXPECT_TRUE(loaded.ok()) << loaded;
    for (const auto& item : model->named_parameters()) {
      params[item.key()] = item.value().detach().clone();
    }
  }
  strategy.Barrier();  // every rank has read it before anyone writes again
  return params;
}

StrategyMaker FactoryMaker(const std::string& name) {
  TrainConfig config;
  config.strategy = name;
  return FactoryMaker(config);
}

StrategyMaker FactoryMaker(const TrainConfig& config) {
  return [config](int64_t rank, int64_t world,
                  Communicator* comm) -> std::unique_ptr<Strategy> {
    StrategyOptions options;
    options.rank = rank;
    options.world_size = world;
    absl::StatusOr<std::unique_ptr<Strategy>> strategy =
        CreateStrategy(config, options, comm);
    EXPECT_TRUE(strategy.ok()) << strategy.status();
    return strategy.ok() ? std::move(*strategy) : nullptr;
  };
}

namespace {

// A directory of its own for one run's exports.
std::string RunDir() {
  static int runs = 0;
  const std::string dir = ::testing::TempDir() + "/strategy-harness-" +
                          std::to_string(::getpid()) + "-" +
                          std::to_string(runs++);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TrainResult TrainSingle(const std::string& spec, uint64_t seed,
                        const torch::Tensor& batches, const TrainLoop& loop) {
  std::vector<TrainResult> results = TrainRanks(
      spec, seed, batches, /*world=*/1, loop, FactoryMaker("single"));
  return results.front();
}

std::vector<TrainResult> TrainRanks(const std::string& spec, uint64_t seed,
                                    const torch::Tensor& batches, int64_t world,
                                    const TrainLoop& loop,
                                    const StrategyMaker& make) {
  const std::string dir = RunDir();
  std::vector<TrainResult> results(world);
  RunRanks(
      world,
      [&](int64_t rank, Communicator& comm) {
        torch::set_num_threads(1);
        std::unique_ptr<Strategy> strategy = make(rank, world, &comm);
        ASSERT_NE(strategy, nullptr);
        CausalLm model = MakeCausalLm(spec, seed);
        model->set_activation_checkpointing(loop.activation_checkpointing);
        const absl::Status setup = strategy->Setup(model);
        ASSERT_TRUE(setup.ok()) << setup;
        strategy->TakeCommStats();
        Train(*strategy, batches, rank, world, loop, &results[rank]);
        results[rank].params = FullParameters(*strategy, spec, dir);
      },
      loop.point_to_point,
      loop.point_to_point == PointToPoint::kNcclOrder
          ? std::chrono::milliseconds(kNcclOrderTimeout)
          : std::chrono::milliseconds(std::chrono::seconds(60)));
  std::filesystem::remove_all(dir);
  return results;
}

ParamMap GlobalGradients(const std::vector<TrainResult>& ranks, size_t step) {
  ParamMap global;
  for (const TrainResult& rank : ranks) {
    if (step >= rank.gradients.size()) continue;
    for (const StateSlice& slice : rank.gradients[step]) {
      const std::string name = slice.name.substr(std::string("grad.").size());
      auto [it, added] = global.try_emplace(name);
      if (added) it->second = torch::zeros(slice.shape, torch::kDouble);
      it->second.view(-1)
          .narrow(0, slice.offset, slice.data.numel())
          .copy_(slice.data.to(torch::kDouble).view(-1));
    }
  }
  return global;
}

std::map<std::string, double> GradientDiffs(const ParamMap& reference,
                                            const ParamMap& actual) {
  std::map<std::string, double> diffs;
  for (const auto& [name, expected] : reference) {
    const auto other = actual.find(name);
    if (other == actual.end()) {
      diffs[name] = std::numeric_limits<double>::infinity();
      continue;
    }
    const double scale = std::max(expected.abs().max().item<double>(), 1e-30);
    diffs[name] = (other->second.to(torch::kDouble) - expected)
                      .abs()
                      .max()
                      .item<double>() /
                  scale;
  }
  return diffs;
}

void ExpectSameGradients(const TrainResult& single,
                         const std::vector<TrainResult>& ranks, double rel,
                         const std::string& what) {
  ASSERT_FALSE(single.gradients.empty()) << what << ": no gradients recorded";
  double worst = 0;
  std::string worst_name;
  for (size_t step = 0; step < single.gradients.size(); ++step) {
    const ParamMap reference = GlobalGradients({single}, step);
    const ParamMap actual = GlobalGradients(ranks, step);
    ASSERT_EQ(actual.size(), reference.size()) << what << " step " << step;
    for (const auto& [name, diff] : GradientDiffs(reference, actual)) {
      EXPECT_LE(diff, rel) << what << ": gradient of " << name << " at step "
                           << step;
      if (diff > worst) {
        worst = diff;
        worst_name = name;
      }
    }
  }
  std::cout << what << ": worst gradient difference " << worst << " ("
            << worst_name << ", relative to its largest element)\n";
}

std::function<void(int64_t, Strategy&)> DoubleGradientOf(
    const std::string& name) {
  return [name](int64_t, Strategy& strategy) {
    for (StateSlice& slice : strategy.GradientSlices()) {
      if (slice.name == "grad." + name) slice.data.mul_(2);
    }
  };
}

void ExpectOnlyTamperedGradientDiffers(const TrainResult& single,
                                       const std::vector<TrainResult>& ranks,
                                       const std::string& tampered,
                                       double rel) {
  const std::map<std::string, double> diffs =
      GradientDiffs(GlobalGradients({single}, 0), GlobalGradients(ranks, 0));
  ASSERT_EQ(diffs.count(tampered), 1u) << tampered;
  EXPECT_GT(diffs.at(tampered), 0.5) << "the doubled gradient went unnoticed";
  for (const auto& [name, diff] : diffs) {
    if (name != tampered) EXPECT_LE(diff, rel) << name;
  }
}

double RelDiff(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-12);
}

double MaxAbsDiff(const ParamMap& a, const ParamMap& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0;
  for (const auto& [name, tensor] : a) {
    const auto other = b.find(name);
    EXPECT_NE(other, b.end()) << name;
    if (other == b.end()) continue;
    EXPECT_EQ(tensor.sizes(), other->second.sizes()) << name;
    diff = std::max(diff, (tensor - other->second).abs().max().item<double>());
  }
  return diff;
}

void ExpectSameTraining(const TrainResult& expected, const TrainResult& actual,
                        const Tolerance& tolerance, const std::string& what) {
  ASSERT_EQ(expected.losses.size(), actual.losses.size()) << what;
  double loss_diff = 0;
  double norm_diff = 0;
  for (size_t i = 0; i < expected.losses.size(); ++i) {
    loss_diff =
        std::max(loss_diff, RelDiff(actual.losses[i], expected.losses[i]));
    norm_diff =
        std::max(norm_diff, RelDiff(actual.norms[i], expected.norms[i]));
    EXPECT_LT(RelDiff(actual.losses[i], expected.losses[i]), tolerance.rel)
        << what << ", step " << i << ": " << actual.losses[i] << " vs "
        << expected.losses[i];
    EXPECT_LT(RelDiff(actual.norms[i], expected.norms[i]), tolerance.rel)
        << what << ", step " << i << ": " << actual.norms[i] << " vs "
        << expected.norms[i];
  }
  const double eval_diff = RelDiff(actual.eval_loss, expected.eval_loss);
  EXPECT_LT(eval_diff, tolerance.rel) << what;
  const double param_diff = MaxAbsDiff(actual.params, expected.params);
  EXPECT_LE(param_diff, tolerance.param) << what;
  const bool ok = loss_diff < tolerance.rel && norm_diff < tolerance.rel &&
                  eval_diff < tolerance.rel && param_diff <= tolerance.param;
  std::printf(
      "%s: %s, maxdiff loss %.3g (rel), grad norm %.3g (rel), eval loss %.3g "
      "(rel), params %.3g (abs) over %zu steps\n",
      what.c_str(), ok ? "OK" : "NOT OK", loss_diff, norm_diff, eval_diff,
      param_diff, expected.losses.size());
}

}  // namespace shardtrain::test
