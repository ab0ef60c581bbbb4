#include "core/model/family_shapes.h"

namespace shardtrain {
namespace {

// GPT-2 (model/gpt2.cc), counted tensor by tensor:
//   ln_1 and ln_2: mean and rstd (2 + 2 floats); their outputs, saved by
//   c_attn and c_fc (C + C); qkv, laid out head-major (3C); the heads
//   merged back, saved by c_proj (C); the residual after attention (C);
//   c_fc's output and its GELU (4C + 4C); the block's output (C, the next
//   block's input). A tensor-parallel rank: the LayerNorms' statistics and
//   outputs, the residual after attention and the block's output are whole
//   (4 + 4C); qkv, the merged heads, c_fc's output and its GELU are 1/T
//   (12C / T).
// Parameters: ln_1, ln_2 and the two row-parallel biases whole (6C); 13C
// of vectors; the column-parallel c_attn and c_fc (3C + 4C wide); ln_f 2C.
// zb-h1: the inputs of c_attn, attention's c_proj, c_fc and the MLP's
// c_proj (C, C, C, 4C) and their output gradients (3C, C, 4C, C).
FamilyShapes Gpt2Shapes(const ModelConfig& m) {
  const int64_t c = m.n_embd;
  FamilyShapes s;
  s.kept_whole = 4 * c;
  s.kept_split = 12 * c;
  s.kept_fp32 = 4;
  s.block_whole_params = 6 * c;
  s.block_vector_params = 13 * c;
  s.final_norm_params = 2 * c;
  s.column_parallel_width = 7 * c;
  s.deferred = 16 * c;
  return s;
}

// Llama (model/llama.cc), counted tensor by tensor (and checked by walking
// the autograd graph of the same ops):
//   each RMSNorm (computed in fp32): the normalised input, kept by the
//   weight's product (C), its reciprocal root (1 float) and, on LibTorch
//   1.x, whose mean keeps its input, the squares (C; 2.x keeps the shape);
//   its output, kept by the projections that read it (C);
//   attention: the rotated queries made contiguous, the keys and values
//   repeated to every query head (C + C + C; the rotary products keep only
//   their constant tables), the heads merged back, kept by o_proj (C);
//   the residual after attention (C), kept by the second norm;
//   the MLP's gate (kept by SiLU), its SiLU and up (kept by their product)
//   and the product (kept by down_proj): 4 x I;
//   the block's output (C, the next block's input).
// A tensor-parallel rank holds 1/T of the attention's and the MLP's
// tensors; the norms' tensors, their outputs, the residual and the block's
// output are whole.
// Parameters: the two norms whole (2C); the vectors are the norms and q, k
// and v's biases when present (split with their matrices); q, k, v, gate
// and up column-parallel; the final norm C.
// zb-h1: the norms' outputs (each read by two or three projections, kept
// once), attention's output and the MLP's hidden units (C, C, C, I), and
// the gradients of q, k, v, o, gate, up and down (C, kv, kv, C, I, I, C);
// under bf16 each projection keeps its own cast of the fp32 norm output:
// three copies more.
FamilyShapes LlamaShapes(const ModelConfig& m) {
  const int64_t c = m.n_embd;
  const int64_t kv = m.kv_heads() * m.head_size();
  const int64_t mlp = m.mlp_hidden();
  FamilyShapes s;
  s.kept_whole = 4 * c;
  s.kept_split = 4 * c + 4 * mlp;
  s.kept_fp32 = 2 * c + 2;
  s.kept_fp32_torch1 = 2 * c;
  s.block_whole_params = 2 * c;
  s.block_vector_params = 2 * c + (m.attention_bias ? c + 2 * kv : 0);
  s.final_norm_params = c;
  s.column_parallel_width = c + 2 * m.n_kv_head * c / m.n_head + 2 * mlp;
  s.deferred = 6 * c + 2 * kv + 3 * mlp;
  s.deferred_low_precision = 3 * c;
  return s;
}

}  // namespace

FamilyShapes ShapesOf(const ModelConfig& model) {
  switch (model.family) {
    case ModelFamily::kLlama:
      return LlamaShapes(model);
    case ModelFamily::kGpt2:
      break;
  }
  return Gpt2Shapes(model);
}

}  // namespace shardtrain
