#include "core/data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "core/data/asset_paths.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

// GPT-2's pre-tokenisation regex in PCRE2 syntax. `\s` is spelled
// [\s\x{FEFF}] (and `\S` [^\s\x{FEFF}]) because PCRE2's Unicode `\s` lacks
// U+FEFF, which JavaScript's has; see the header for how that relates to
// encoder.py.
constexpr char kPreTokenPattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\x{FEFF}\p{L}\p{N}]+)"
    R"(|[\s\x{FEFF}]+(?![^\s\x{FEFF}])|[\s\x{FEFF}]+)";

// Beyond this many cached pre-tokens the cache starts afresh, bounding memory
// on web-scale text; a corpus like Brown has ~60k distinct pre-tokens.
constexpr size_t kMaxCachedPieces = 1 << 20;

struct CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
struct MatchContextDeleter {
  void operator()(pcre2_match_context* context) const {
    pcre2_match_context_free(context);
  }
};
struct JitStackDeleter {
  void operator()(pcre2_jit_stack* stack) const { pcre2_jit_stack_free(stack); }
};

// GPT-2's bytes_to_unicode(): the printable code point standing for each byte
// in encoder.json and vocab.bpe.
std::array<char32_t, 256> ByteToCodePoint() {
  std::array<char32_t, 256> table{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = printable[b] ? b : next++;
  return table;
}

// Reverses bytes_to_unicode() on a vocabulary string (UTF-8 holding code
// points below 512). False when `s` holds anything else.
bool VocabStringToBytes(absl::string_view s, std::string* bytes) {
  static const auto* const kCodePointToByte = [] {
    auto* table = new std::array<int, 512>;
    table->fill(-1);
    const std::array<char32_t, 256> forward = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) (*table)[forward[b]] = b;
    return table;
  }();
  bytes->clear();
  for (size_t i = 0; i < s.size();) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    char32_t cp;
    if (c0 < 0x80) {
      cp = c0;
      i += 1;
    } else if ((c0 & 0xE0) == 0xC0 && i + 1 < s.size()) {
      cp = (c0 & 0x1F) << 6 | (static_cast<unsigned char>(s[i + 1]) & 0x3F);
      i += 2;
    } else {
      return false;
    }
    if (cp >= kCodePointToByte->size() || (*kCodePointToByte)[cp] < 0) {
      return false;
    }
    bytes->push_back(static_cast<char>((*kCodePointToByte)[cp]));
  }
  return !bytes->empty();
}

uint64_t PairKey(int left, int right) {
  return static_cast<uint64_t>(left) << 32 | static_cast<uint32_t>(right);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "cannot open ", path, "; run scripts/setup to install it"));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

struct BpeTokenizer::Impl {
  struct Merge {
    int rank;
    int merged;  // id of the concatenated piece
  };

  std::vector<std::string> id_to_bytes;
  absl::flat_hash_map<std::string, int> bytes_to_id;
  std::array<int, 256> byte_to_id{};
  absl::flat_hash_map<uint64_t, Merge> merges;  // keyed by PairKey(ids)
  std::unique_ptr<pcre2_code, CodeDeleter> pre_token_regex;

  mutable absl::Mutex cache_mutex;
  mutable absl::flat_hash_map<std::string, std::vector<int>> cache
      ABSL_GUARDED_BY(cache_mutex);

  absl::Status LoadEncoder(const std::string& path);
  absl::Status LoadMerges(const std::string& path);
  absl::Status CompileRegex();

  void EncodeOrdinary(absl::string_view text, std::vector<int>* out) const;
  void AppendPiece(absl::string_view piece, std::vector<int>* out) const;
  std::vector<int> MergePiece(absl::string_view piece) const;
};

absl::Status BpeTokenizer::Impl::LoadEncoder(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  nlohmann::json encoder =
      nlohmann::json::parse(*text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (!encoder.is_object() || encoder.empty()) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a JSON object of token -> id"));
  }
  id_to_bytes.assign(encoder.size(), std::string());
  std::vector<bool> seen(encoder.size(), false);
  std::string bytes;
  for (const auto& [token, id_json] : encoder.items()) {
    if (!id_json.is_number_integer()) {
      return absl::DataLossError(
          absl::StrCat(path, ": id of \"", token, "\" is not an integer"));
    }
    const int64_t id = id_json.get<int64_t>();
    if (id < 0 || id >= static_cast<int64_t>(encoder.size()) || seen[id]) {
      return absl::DataLossError(
          absl::StrCat(path, ": ids must be distinct and in [0, ",
                       encoder.size(), "); \"", token, "\" has ", id));
    }
    if (!VocabStringToBytes(token, &bytes)) {
      return absl::DataLossError(absl::StrCat(
          path, ": \"", token, "\" is not a byte-level BPE token"));
    }
    seen[id] = true;
    id_to_bytes[id] = bytes;
    bytes_to_id.emplace(bytes, static_cast<int>(id));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end()) {
      return absl::DataLossError(absl::StrCat(path, ": no token for byte ", b));
    }
    byte_to_id[b] = it->second;
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::LoadMerges(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  int line_number = 0;
  int rank = 0;
  std::string left, right;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    // Line 1 is "#version: 0.2"; later lines may start with '#' (the merge
    // "# #" is one), so only the first is a comment.
    if (line.empty() || (line_number == 1 && absl::StartsWith(line, "#"))) {
      continue;
    }
    std::vector<absl::string_view> parts =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (parts.size() != 2 || !VocabStringToBytes(parts[0], &left) ||
        !VocabStringToBytes(parts[1], &right)) {
      return absl::DataLossError(absl::StrCat(
          path, ":", line_number, ": expected two byte-level BPE pieces"));
    }
    auto l = bytes_to_id.find(left);
    auto r = bytes_to_id.find(right);
    auto m = bytes_to_id.find(left + right);
    if (l == bytes_to_id.end() || r == bytes_to_id.end() ||
        m == bytes_to_id.end()) {
      return absl::DataLossError(
          absl::StrCat(path, ":", line_number, ": merge \"", line,
                       "\" uses or makes a piece that encoder.json lacks"));
    }
    // A repeated merge takes its later rank, as dict(zip(...)) does.
    merges.insert_or_assign(PairKey(l->second, r->second),
                            Merge{rank++, m->second});
  }
  if (merges.empty()) {
    return absl::DataLossError(absl::StrCat(path, ": no merges"));
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::CompileRegex() {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pre_token_regex.reset(pcre2_compile(
      reinterpret_cast<PCRE2_SPTR>(kPreTokenPattern), PCRE2_ZERO_TERMINATED,
      PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code,
      &error_offset, nullptr));
  if (pre_token_regex == nullptr) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error_code, message.data(), message.size());
    return absl::InternalError(absl::StrCat(
        "GPT-2 pre-token regex does not compile at offset ", error_offset, ": ",
        reinterpret_cast<const char*>(message.data())));
  }
  // JIT is an optimisation: without it (no JIT on this CPU) matching is
  // slower but identical.
  pcre2_jit_compile(pre_token_regex.get(), PCRE2_JIT_COMPLETE);
  return absl::OkStatus();
}

namespace {

// Per-thread PCRE2 matching state. It depends only on kPreTokenPattern (one
// capture group count for every tokenizer), so all instances share it.
struct MatchState {
  MatchState() {
    // A long whitespace run backtracks once per character; give JIT matching
    // room for runs of millions of characters, and lift the interpreter's
    // limits for machines without JIT.
    context.reset(pcre2_match_context_create(nullptr));
    jit_stack.reset(pcre2_jit_stack_create(32 << 10, 64 << 20, nullptr));
    pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());
    pcre2_set_match_limit(context.get(), UINT32_MAX);
    pcre2_set_depth_limit(context.get(), UINT32_MAX);
    pcre2_set_heap_limit(context.get(), UINT32_MAX);
  }
  pcre2_match_data* MatchDataFor(const pcre2_code* code) {
    if (match == nullptr) {
      match.reset(pcre2_match_data_create_from_pattern(code, nullptr));
    }
    return match.get();
  }

  std::unique_ptr<pcre2_match_data, MatchDataDeleter> match;
  std::unique_ptr<pcre2_match_context, MatchContextDeleter> context;
  std::unique_ptr<pcre2_jit_stack, JitStackDeleter> jit_stack;
};

}  // namespace

void BpeTokenizer::Impl::EncodeOrdinary(absl::string_view text,
                                        std::vector<int>* out) const {
  thread_local MatchState state;
  pcre2_match_data* match = state.MatchDataFor(pre_token_regex.get());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start < text.size()) {
    const int rc = pcre2_match(pre_token_regex.get(), subject, text.size(),
                               start, 0, match, state.context.get());
    if (rc < 0) {
      // Only bytes that are not UTF-8 fail to match (every character is
      // \s, \p{L}, \p{N} or other); they stay one piece so they round-trip.
      AppendPiece(text.substr(start), out);
      return;
    }
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match);
    if (range[0] > start) {
      AppendPiece(text.substr(start, range[0] - start), out);
    }
    AppendPiece(text.substr(range[0], range[1] - range[0]), out);
    start = range[1];
  }
}

void BpeTokenizer::Impl::AppendPiece(absl::string_view piece,
                                     std::vector<int>* out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out->push_back(byte_to_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  {
    absl::MutexLock lock(&cache_mutex);
    auto it = cache.find(piece);
    if (it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int> ids = MergePiece(piece);
  out->insert(out->end(), ids.begin(), ids.end());
  absl::MutexLock lock(&cache_mutex);
  if (cache.size() >= kMaxCachedPieces) cache.clear();
  cache.emplace(piece, std::move(ids));
}

// encoder.py's bpe(): repeatedly take the lowest-ranked adjacent pair and
// merge every occurrence of it, left to right, without overlap. A heap of
// candidate pairs (lazily invalidated) makes that O(n log n) rather than
// encoder.py's O(n^2), which matters for long runs of spaces or letters.
std::vector<int> BpeTokenizer::Impl::MergePiece(absl::string_view piece) const {
  struct Symbol {
    int id;  // -1 once merged into its left neighbour
    int prev;
    int next;
  };
  struct Candidate {
    int rank;
    int left;  // symbol index; the pair is (left, symbols[left].next)
    int left_id;
    int right_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : left > other.left;
    }
  };

  const int n = static_cast<int>(piece.size());
  std::vector<Symbol> symbols(n);
  for (int i = 0; i < n; ++i) {
    symbols[i] = {byte_to_id[static_cast<unsigned char>(piece[i])], i - 1,
                  i + 1 < n ? i + 1 : -1};
  }
  std::priority_queue<Candidate, std::vector<Candidate>,
                      std::greater<Candidate>>
      heap;
  auto push_pair_at = [&](int left) {
    if (left < 0) return;
    const int right = symbols[left].next;
    if (right < 0) return;
    auto it = merges.find(PairKey(symbols[left].id, symbols[right].id));
    if (it == merges.end()) return;
    heap.push({it->second.rank, left, symbols[left].id, symbols[right].id});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair_at(i);

  std::vector<Candidate> same_rank;
  std::vector<int> merged;
  while (!heap.empty()) {
    // A rank names one pair; its candidates come out in left-to-right order.
    const int rank = heap.top().rank;
    same_rank.clear();
    while (!heap.empty() && heap.top().rank == rank) {
      same_rank.push_back(heap.top());
      heap.pop();
    }
    merged.clear();
    for (const Candidate& c : same_rank) {
      Symbol& left = symbols[c.left];
      // Stale when an earlier merge (possibly of this same pass, as in "aaa")
      // changed either side.
      if (left.id != c.left_id || left.next < 0 ||
          symbols[left.next].id != c.right_id) {
        continue;
      }
      Symbol& right = symbols[left.next];
      left.id = merges.find(PairKey(c.left_id, c.right_id))->second.merged;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = c.left;
      right.id = -1;
      merged.push_back(c.left);
    }
    // New pairs join only after the pass, as encoder.py recomputes its pairs
    // only after merging every occurrence.
    for (int m : merged) {
      if (symbols[m].id < 0) continue;
      push_pair_at(symbols[m].prev);
      push_pair_at(m);
    }
  }

  std::vector<int> ids;
  for (int i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
  return ids;
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

absl::StatusOr<BpeTokenizer> BpeTokenizer::Load(const std::string& vocab_dir) {
  auto impl = std::make_unique<Impl>();
  if (absl::Status s = impl->LoadEncoder(vocab_dir + "/encoder.json");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = impl->LoadMerges(vocab_dir + "/vocab.bpe"); !s.ok()) {
    return s;
  }
  if (absl::Status s = impl->CompileRegex(); !s.ok()) return s;
  if (static_cast<int>(impl->id_to_bytes.size()) <= kEndOfText ||
      impl->id_to_bytes[kEndOfText] != kGpt2EndOfTextString) {
    return absl::DataLossError(
        absl::StrCat(vocab_dir, "/encoder.json: id ", kEndOfText, " is not ",
                     kGpt2EndOfTextString, "; not GPT-2's vocabulary"));
  }
  return BpeTokenizer(std::move(impl));
}

absl::StatusOr<BpeTokenizer> BpeTokenizer::LoadDefault() {
  absl::StatusOr<std::string> dir = Gpt2VocabDir();
  if (!dir.ok()) return dir.status();
  return Load(*dir);
}

std::vector<int> BpeTokenizer::Encode(absl::string_view text,
                                      SpecialTokens special) const {
  std::vector<int> ids;
  ids.reserve(text.size() / 4);
  if (special == SpecialTokens::kAsText) {
    impl_->EncodeOrdinary(text, &ids);
    return ids;
  }
  constexpr absl::string_view kMarker = kGpt2EndOfTextString;
  for (size_t pos = 0;;) {
    const size_t found = text.find(kMarker, pos);
    impl_->EncodeOrdinary(text.substr(pos, found - pos), &ids);
    if (found == absl::string_view::npos) break;
    ids.push_back(kEndOfText);
    pos = found + kMarker.size();
  }
  return ids;
}

absl::StatusOr<std::string> BpeTokenizer::Decode(
    absl::Span<const int> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", ids[i], " at position ", i,
                       " is outside the vocabulary [0, ", vocab_size(), ")"));
    }
    text += impl_->id_to_bytes[ids[i]];
  }
  return text;
}

int BpeTokenizer::vocab_size() const {
  return static_cast<int>(impl_->id_to_bytes.size());
}

}  // namespace shardtrain
