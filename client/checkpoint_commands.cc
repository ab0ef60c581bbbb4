#include "client/checkpoint_commands.h"

#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/exit_code.h"
#include "client/output_format.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/checkpoint/checkpoint_export.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/dataset_preparer.h"
#include "core/model/hf_gpt2.h"
#include "core/model/hf_llama.h"
#include "core/run/step_metrics.h"
#include "nlohmann/json.hpp"

namespace shardtrain::cli {
namespace {

struct CheckpointInspectOptions {
  std::string dir;
  std::string output = "table";
  bool tensors = false;
};

struct ExportOptions {
  std::string source;
  std::string to;   // hf | llmc, or (alone) the llm.c file to write
  std::string out;  // the file (llmc) or directory (hf) to write
};

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenNamed(
    const std::string& path) {
  absl::StatusOr<std::string> dir = ResolveCheckpointDir(path);
  if (!dir.ok()) return dir.status();
  return CheckpointReader::Open(*dir);
}

int RunCheckpointInspect(const CheckpointInspectOptions& options) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      OpenNamed(options.dir);
  if (!reader.ok()) return ReportFailure(reader.status());
  const CheckpointMetadata& metadata = (*reader)->metadata();
  const nlohmann::json& training = metadata.training;
  const nlohmann::json written = training.contains("written_by")
                                     ? training["written_by"]
                                     : nlohmann::json::object();
  const std::map<std::string, int64_t> per_file = metadata.BytesPerFile();
  if (options.output != "table") {
    nlohmann::json out = {{"dir", (*reader)->dir()},
                          {"training", training},
                          {"tensor_count", metadata.tensors.size()},
                          {"bytes", metadata.TotalBytes()},
                          {"bytes_per_file", per_file}};
    if (options.tensors) {
      nlohmann::json tensors = nlohmann::json::array();
      for (const TensorEntry& t : metadata.tensors) {
        tensors.push_back({{"name", t.name},
                           {"shape", t.shape},
                           {"dtype", t.dtype},
                           {"chunks", t.chunks.size()}});
      }
      out["tensors"] = tensors;
    }
    std::cout << (options.output == "json" ? out.dump(2) + "\n"
                                           : JsonToYaml(out.dump()));
    return kExitOk;
  }
  const int64_t step = TrainingInt(training, "step");
  const int64_t global = TrainingInt(training, "global_batch");
  std::vector<std::vector<std::string>> rows = {
      {"checkpoint", (*reader)->dir()},
      {"step",
       absl::StrFormat("%d (%d sequences consumed, %d per step)", step,
                       TrainingInt(training, "samples_consumed"), global)},
      {"model", TrainingString(training, "model")},
      {"written by",
       absl::StrFormat("%s on %d rank(s) (batch %d x accum %d per replica)",
                       WrittenByMesh(written),
                       TrainingInt(written, "world_size"),
                       TrainingInt(written, "batch_size"),
                       TrainingInt(written, "grad_accum"))},
      {"optimizer", absl::StrFormat("AdamW, %d steps",
                                    TrainingInt(training, "optimizer_steps"))},
      {"tensors", absl::StrFormat("%d, %s", metadata.tensors.size(),
                                  FormatBytes(metadata.TotalBytes()))}};
  bool first_file = true;
  for (const auto& [file, bytes] : per_file) {
    rows.push_back(
        {first_file ? "files" : "", file + "  " + FormatBytes(bytes)});
    first_file = false;
  }
  for (const auto& row : rows) {
    std::cout << absl::StrFormat("%-12s%s\n", row[0], TerminalSafe(row[1]));
  }
  if (options.tensors) {
    std::vector<std::vector<std::string>> tensor_rows;
    for (const TensorEntry& t : metadata.tensors) {
      std::string shape;
      for (int64_t d : t.shape) {
        absl::StrAppend(&shape, shape.empty() ? "" : " x ", d);
      }
      tensor_rows.push_back(
          {t.name, shape, t.dtype, std::to_string(t.chunks.size())});
    }
    std::cout << "\n"
              << FormatTable({"TENSOR", "SHAPE", "DTYPE", "CHUNKS"},
                             tensor_rows);
  }
  return kExitOk;
}

// Copies `from` to `to` through the bounded reader, atomically.
absl::Status CopyFile(const std::string& from, const std::string& to) {
  absl::StatusOr<std::string> bytes =
      ReadInputFile(from, int64_t{256} << 20, "a tokenizer file");
  if (!bytes.ok()) return bytes.status();
  return WriteFileAtomically(to, *bytes);
}

// The tokenizer the run's data was prepared with, beside the exported model
// as transformers reads it: GPT-2's vocab.json and merges.txt, or the
// tokenizer.json (and its tokenizer_config.json and special_tokens_map.json)
// that data prepare --tokenizer was given. What it did, for the output; an
// error when the data folder or its tokenizer cannot be read.
absl::StatusOr<std::string> ShipTokenizer(const std::string& data,
                                          const std::string& out) {
  namespace fs = std::filesystem;
  if (data.empty()) return std::string("none (no data folder on record)");
  absl::StatusOr<std::string> tokenizer = DatasetTokenizer(data);
  if (!tokenizer.ok()) return tokenizer.status();
  const std::string& name = *tokenizer;
  std::vector<std::pair<std::string, std::string>> copies;
  if (name == "gpt2") {
    absl::StatusOr<std::string> vocab = Gpt2VocabDir();
    if (!vocab.ok()) return vocab.status();
    copies = {{*vocab + "/encoder.json", "vocab.json"},
              {*vocab + "/vocab.bpe", "merges.txt"}};
  } else {
    std::error_code ec;
    const fs::path file = fs::is_directory(name, ec)
                              ? fs::path(name) / "tokenizer.json"
                              : fs::path(name);
    copies = {{file.string(), "tokenizer.json"}};
    for (const char* extra :
         {"tokenizer_config.json", "special_tokens_map.json"}) {
      const fs::path beside = file.parent_path() / extra;
      if (fs::exists(beside, ec)) copies.emplace_back(beside.string(), extra);
    }
  }
  std::vector<std::string> written;
  for (const auto& [from, to] : copies) {
    if (absl::Status s = CopyFile(from, (fs::path(out) / to).string());
        !s.ok()) {
      return s;
    }
    written.push_back(to);
  }
  return absl::StrCat(absl::StrJoin(written, ", "), " (",
                      name == "gpt2" ? "GPT-2's" : name, ")");
}

// transformers' generate() stops at config.json's eos_token_id: the ids of
// the shipped tokenizer's bos, eos and pad tokens (tokenizer_config.json's
// names, as its tokenizer.json encodes each: one added token; the
// end-of-text token for an eos it does not name) written into the exported
// `out`/config.json. What was set, for the output ("" when nothing was).
absl::StatusOr<std::string> FillSpecialTokenIds(const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(out);
  if (!fs::exists(dir / "tokenizer.json", ec)) return std::string();
  absl::StatusOr<BpeTokenizer> tokenizer =
      BpeTokenizer::LoadHuggingFace((dir / "tokenizer.json").string());
  if (!tokenizer.ok()) return tokenizer.status();
  nlohmann::json names = nlohmann::json::object();
  if (fs::exists(dir / "tokenizer_config.json", ec)) {
    absl::StatusOr<std::string> text =
        ReadInputFile((dir / "tokenizer_config.json").string(),
                      int64_t{16} << 20, "a tokenizer config");
    if (!text.ok()) return text.status();
    names = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!names.is_object()) names = nlohmann::json::object();
  }
  // A token's id, when the tokenizer encodes its text as exactly one.
  const auto id_of = [&](const char* key) -> std::optional<int> {
    const auto it = names.find(key);
    if (it == names.end()) return std::nullopt;
    const nlohmann::json& token =
        it->is_object() && it->contains("content") ? (*it)["content"] : *it;
    if (!token.is_string()) return std::nullopt;
    absl::StatusOr<std::vector<int>> ids =
        tokenizer->Encode(token.get<std::string>());
    if (!ids.ok() || ids->size() != 1) return std::nullopt;
    return ids->front();
  };
  std::vector<std::pair<std::string, int>> set;
  if (std::optional<int> bos = id_of("bos_token")) {
    set.emplace_back("bos_token_id", *bos);
  }
  std::optional<int> eos = id_of("eos_token");
  if (!eos && tokenizer->end_of_text() >= 0) eos = tokenizer->end_of_text();
  if (eos) set.emplace_back("eos_token_id", *eos);
  if (std::optional<int> pad = id_of("pad_token")) {
    set.emplace_back("pad_token_id", *pad);
  }
  if (set.empty()) return std::string();
  const std::string config_path = (dir / kHfConfigFile).string();
  absl::StatusOr<std::string> text =
      ReadInputFile(config_path, int64_t{1} << 20, "a model config");
  if (!text.ok()) return text.status();
  nlohmann::ordered_json config =
      nlohmann::ordered_json::parse(*text, nullptr, false);
  if (!config.is_object()) {
    return absl::InternalError(
        absl::StrCat(config_path, ": not the JSON object just written"));
  }
  std::vector<std::string> said;
  for (const auto& [key, id] : set) {
    config[key] = id;
    said.push_back(absl::StrCat(key, " ", id));
  }
  if (absl::Status s = WriteFileAtomically(config_path, config.dump(2) + "\n");
      !s.ok()) {
    return s;
  }
  return absl::StrJoin(said, ", ");
}

int RunExport(ExportOptions options) {
  // `--to FILE` alone is the llm.c export's older spelling.
  if (options.out.empty() && options.to != "hf" && options.to != "llmc") {
    options.out = options.to;
    options.to = "llmc";
  }
  if (options.to != "hf" && options.to != "llmc") {
    ReportFailure(absl::StrCat("--to: got '", options.to,
                               "'; expected hf (a Hugging Face directory) or "
                               "llmc (an llm.c model file)"));
    return kExitUsage;
  }
  if (options.out.empty()) {
    ReportFailure(absl::StrCat("export --to ", options.to, " needs OUT, the ",
                               options.to == "hf" ? "directory" : "file",
                               " to write"));
    return kExitUsage;
  }
  absl::StatusOr<ModelWeights> weights = OpenModelWeights(options.source);
  if (!weights.ok()) return ReportFailure(weights.status());
  const bool llama = weights->config.is_llama();
  const absl::Status written =
      options.to != "hf" ? WriteLlmcModel(*weights, options.out)
      : llama ? WriteHfLlama(weights->config, weights->read, options.out)
              : WriteHfGpt2(weights->config, weights->read, options.out);
  if (!written.ok()) return ReportFailure(written);
  const char* architecture = !llama ? "GPT2LMHeadModel"
                             : weights->config.attention_bias
                                 ? "Qwen2ForCausalLM"
                                 : "LlamaForCausalLM";
  std::cout << "wrote " << options.out
            << (options.to == "hf"
                    ? absl::StrCat(" (Hugging Face ", architecture, ": ",
                                   kHfConfigFile, " and the weights)")
                    : std::string(" (llm.c model)"))
            << ", model " << weights->config.ToSpec() << ", from "
            << weights->description << "\n";
  if (options.to == "hf") {
    absl::StatusOr<std::string> tokenizer =
        ShipTokenizer(weights->data, options.out);
    if (tokenizer.ok()) {
      std::cout << "tokenizer: " << *tokenizer << "\n";
      absl::StatusOr<std::string> ids = FillSpecialTokenIds(options.out);
      if (!ids.ok()) {
        std::cerr << "warning: config.json names no special tokens: "
                  << ids.status().message() << "\n";
      } else if (!ids->empty()) {
        std::cout << "config.json: " << *ids << "\n";
      }
    } else {
      std::cerr << "warning: the model is written, without its tokenizer: "
                << tokenizer.status().message() << "\n";
    }
  }
  return kExitOk;
}

}  // namespace

void AddCheckpointCommands(CLI::App* app, int* exit_code) {
  CLI::App* group = app->add_subcommand(
      "checkpoint", "read a training checkpoint (any strategy and world size)");
  group->require_subcommand(1);

  auto inspect_options = std::make_shared<CheckpointInspectOptions>();
  CLI::App* inspect = group->add_subcommand(
      "inspect", "step, model, who wrote it, tensors and bytes per rank file");
  inspect
      ->add_option("dir", inspect_options->dir,
                   "a checkpoint, a run's --out or its checkpoints/ folder")
      ->required();
  inspect->add_flag("--tensors", inspect_options->tensors,
                    "list every tensor with its shape");
  AddOutputFlag(inspect, &inspect_options->output);
  inspect->callback([inspect_options, exit_code] {
    *exit_code = RunCheckpointInspect(*inspect_options);
  });

  auto export_options = std::make_shared<ExportOptions>();
  CLI::App* export_command = group->add_subcommand(
      "export",
      "write a model as a Hugging Face GPT-2 directory (--to hf OUT/) or an "
      "llm.c model file (--to llmc OUT.bin)");
  export_command
      ->add_option("source", export_options->source,
                   "a checkpoint, a run's --out or its checkpoints/ folder, an "
                   "llm.c model file or a Hugging Face directory")
      ->required();
  export_command->add_option(
      "out", export_options->out,
      "what to write: a directory (hf) or a file (llmc)");
  export_command
      ->add_option("--to", export_options->to,
                   "hf | llmc (alone, --to FILE writes llm.c's FILE)")
      ->required();
  export_command->callback(
      [export_options, exit_code] { *exit_code = RunExport(*export_options); });
}

}  // namespace shardtrain::cli
