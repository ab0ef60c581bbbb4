// The planners' description of each family (core/model/family_shapes.h)
// against the family's model and tensor-parallel plan: what the plan keeps
// whole in a block, the final norm, the column-parallel matrices' width and
// the block's vectors, counted from the model's own parameters.
#include "core/model/family_shapes.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "worker/engine/model/create_model.h"

namespace shardtrain {
namespace family_shapes_test {

struct Counted {
  int64_t block_whole = 0, block_vectors = 0, column_width = 0;
  int64_t final_norm = 0;
};

// Block 0's parameters as the model's tensor-parallel plan holds them over
// two ranks, and the output side's norm.
Counted CountFromTheModel(const ModelConfig& config) {
  absl::StatusOr<CausalLm> made = CreateCausalLm(config, /*seed=*/1);
  EXPECT_TRUE(made.ok()) << made.status();
  Counted counted;
  if (!made.ok()) return counted;
  CausalLm& model = *made;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const torch::Tensor& p = item.value();
    const ParamPlace place = model->PlaceOf(name);
    if (place.role == ParamRole::kOutput && name != model->head_weight_name()) {
      counted.final_norm += p.numel();
    }
    if (place.role != ParamRole::kBlock || place.block != 0) continue;
    const std::vector<int64_t> global = p.sizes().vec();
    const std::vector<FlatRun> runs =
        model->TensorParallelRuns(name, global, /*rank=*/0, /*size=*/2);
    const bool whole = runs.size() == 1 && runs[0].length == p.numel();
    if (whole) counted.block_whole += p.numel();
    if (p.dim() == 1) counted.block_vectors += p.numel();
    // A column-parallel matrix: a rank holds whole rows (output features)
    // of it; a row-parallel one pieces of every row.
    bool rows = p.dim() == 2 && !whole;
    for (const FlatRun& run : runs) {
      if (p.dim() != 2 || run.offset % global[1] != 0 ||
          run.length % global[1] != 0) {
        rows = false;
      }
    }
    if (rows) counted.column_width += global[0];
  }
  return counted;
}

TEST(FamilyShapesTest, EachFamilyDescribesItsModelAndTensorParallelPlan) {
  for (const std::string spec :
       {"gpt2-tiny", "llama-tiny",
        "custom-llama:n_layer=2,n_head=8,n_kv_head=2,n_embd=128,"
        "intermediate_size=352,vocab_size=512,tie_embeddings=0",
        "custom-llama:n_layer=2,n_head=4,n_kv_head=2,n_embd=64,"
        "intermediate_size=160,vocab_size=512,attention_bias=1"}) {
    SCOPED_TRACE(spec);
    absl::StatusOr<ModelConfig> config = ParseModelSpec(spec);
    ASSERT_TRUE(config.ok()) << config.status();
    const FamilyShapes shapes = ShapesOf(*config);
    const Counted counted = CountFromTheModel(*config);
    EXPECT_EQ(shapes.block_whole_params, counted.block_whole);
    EXPECT_EQ(shapes.block_vector_params, counted.block_vectors);
    EXPECT_EQ(shapes.column_parallel_width, counted.column_width);
    EXPECT_EQ(shapes.final_norm_params, counted.final_norm);
    EXPECT_GT(shapes.kept_whole + shapes.kept_split, 0);
    EXPECT_GT(shapes.deferred, 0);
  }
}

}  // namespace family_shapes_test
}  // namespace shardtrain
