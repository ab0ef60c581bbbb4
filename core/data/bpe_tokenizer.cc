#include "core/data/bpe_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "core/data/asset_paths.h"
#include "core/data/pretoken_regex.h"
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

// How deep tokenizer.json and encoder.json may nest before they are parsed:
// real ones nest five levels (Llama 3's post-processor); the bound keeps a
// hostile file (100,000 levels) from anything that recurses on its values.
constexpr int kMaxTokenizerNesting = 64;

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
  std::optional<PretokenRegex> pre_token_regex;
  // For errors: the tokenizer's file (or vocabulary directory).
  std::string source;

  // Hugging Face tokenizers (LoadHuggingFace).
  bool hugging_face = false;
  bool ignore_merges = false;  // a pre-token in the vocabulary is that token
  bool nfc = false;            // the normalizer: Unicode NFC
  // Added tokens, the longest content first: matched in the text as is.
  std::vector<std::pair<std::string, int>> added;
  std::array<bool, 256> added_starts{};  // the first bytes of `added`
  int end_of_text = -1;

  mutable absl::Mutex cache_mutex;
  mutable absl::flat_hash_map<std::string, std::vector<int>> cache
      ABSL_GUARDED_BY(cache_mutex);

  absl::Status LoadEncoder(const std::string& path);
  absl::Status LoadMerges(const std::string& path);
  absl::Status CompileRegex(const std::string& pattern = kPreTokenPattern);
  // Hugging Face's parts of tokenizer.json (`path` names the file in errors).
  absl::Status LoadHfVocab(const nlohmann::json& vocab,
                           const std::string& path);
  absl::Status LoadHfMerges(const nlohmann::json& merges,
                            const std::string& path);
  absl::Status AddMerge(const std::string& left, const std::string& right,
                        int rank, const std::string& where);

  // Both InvalidArgument naming `source` when the regex exceeds a bound on
  // `text`; `timer` times the whole text Encode was given.
  absl::Status EncodeHuggingFace(absl::string_view text, MatchTimer* timer,
                                 std::vector<int>* out) const;
  absl::Status EncodeOrdinary(absl::string_view text, MatchTimer* timer,
                              std::vector<int>* out) const;
  void AppendPiece(absl::string_view piece, std::vector<int>* out) const;
  std::vector<int> MergePiece(absl::string_view piece) const;
};

absl::Status BpeTokenizer::Impl::LoadEncoder(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  if (absl::Status s = CheckJsonNesting(*text, kMaxTokenizerNesting, path);
      !s.ok()) {
    return absl::DataLossError(s.message());
  }
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
    if (absl::Status s =
            AddMerge(left, right, rank++, absl::StrCat(path, ":", line_number));
        !s.ok()) {
      return s;
    }
  }
  if (merges.empty()) {
    return absl::DataLossError(absl::StrCat(path, ": no merges"));
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::AddMerge(const std::string& left,
                                          const std::string& right, int rank,
                                          const std::string& where) {
  auto l = bytes_to_id.find(left);
  auto r = bytes_to_id.find(right);
  auto m = bytes_to_id.find(left + right);
  if (l == bytes_to_id.end() || r == bytes_to_id.end() ||
      m == bytes_to_id.end()) {
    return absl::DataLossError(absl::StrCat(
        where, ": a merge uses or makes a piece the vocabulary lacks"));
  }
  // A repeated merge takes its later rank, as dict(zip(...)) does.
  merges.insert_or_assign(PairKey(l->second, r->second),
                          Merge{rank, m->second});
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::LoadHfVocab(const nlohmann::json& vocab,
                                             const std::string& path) {
  constexpr int64_t kMaxId = int64_t{1} << 24;
  if (!vocab.is_object() || vocab.empty()) {
    return absl::DataLossError(
        absl::StrCat(path, ": model.vocab is not an object of token -> id"));
  }
  std::string bytes;
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() >= kMaxId) {
      return absl::DataLossError(absl::StrCat(path, ": the id of \"", token,
                                              "\" is not an integer in [0, ",
                                              kMaxId, ")"));
    }
    const size_t id = id_json.get<size_t>();
    if (!VocabStringToBytes(token, &bytes)) {
      return absl::DataLossError(absl::StrCat(
          path, ": \"", token, "\" is not a byte-level BPE token"));
    }
    if (id >= id_to_bytes.size()) id_to_bytes.resize(id + 1);
    if (!id_to_bytes[id].empty()) {
      return absl::DataLossError(
          absl::StrCat(path, ": id ", id, " is given twice in model.vocab"));
    }
    id_to_bytes[id] = bytes;
    bytes_to_id.emplace(bytes, static_cast<int>(id));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end()) {
      return absl::DataLossError(
          absl::StrCat(path, ": model.vocab has no token for byte ", b));
    }
    byte_to_id[b] = it->second;
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::LoadHfMerges(const nlohmann::json& list,
                                              const std::string& path) {
  if (!list.is_array()) {
    return absl::DataLossError(
        absl::StrCat(path, ": model.merges is not a list"));
  }
  std::string left, right;
  int rank = 0;
  for (const nlohmann::json& merge : list) {
    // "a b" (older files) or ["a", "b"] (tokenizers 0.20 and later).
    std::string a, b;
    if (merge.is_string()) {
      const std::string text = merge.get<std::string>();
      const size_t space = text.find(' ');
      if (space != std::string::npos &&
          text.find(' ', space + 1) == std::string::npos) {
        a = text.substr(0, space);
        b = text.substr(space + 1);
      }
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    }
    const std::string where = absl::StrCat(path, ": merge ", rank);
    if (!VocabStringToBytes(a, &left) || !VocabStringToBytes(b, &right)) {
      return absl::DataLossError(
          absl::StrCat(where, " (", JsonExcerpt(merge),
                       ") is not two byte-level BPE pieces"));
    }
    if (absl::Status s = AddMerge(left, right, rank++, where); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::CompileRegex(const std::string& pattern) {
  absl::StatusOr<PretokenRegex> regex = PretokenRegex::Compile(pattern);
  if (!regex.ok()) return regex.status();
  pre_token_regex = std::move(*regex);
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::EncodeOrdinary(absl::string_view text,
                                                MatchTimer* timer,
                                                std::vector<int>* out) const {
  size_t start = 0;
  while (start < text.size()) {
    size_t begin = 0, end = 0;
    absl::StatusOr<bool> found =
        pre_token_regex->Find(text, start, timer, &begin, &end);
    if (!found.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", found.status().message()));
    }
    if (!*found) {
      // With GPT-2's regex only bytes that are not UTF-8 fail to match
      // (every character is \s, \p{L}, \p{N} or other); they stay one
      // piece so they round-trip.
      AppendPiece(text.substr(start), out);
      return absl::OkStatus();
    }
    if (begin > start) AppendPiece(text.substr(start, begin - start), out);
    AppendPiece(text.substr(begin, end - begin), out);
    start = end;
  }
  return absl::OkStatus();
}

void BpeTokenizer::Impl::AppendPiece(absl::string_view piece,
                                     std::vector<int>* out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out->push_back(byte_to_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (ignore_merges) {
    auto it = bytes_to_id.find(piece);
    if (it != bytes_to_id.end()) {
      out->push_back(it->second);
      return;
    }
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
  impl->source = vocab_dir;
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

absl::Status BpeTokenizer::Impl::EncodeHuggingFace(
    absl::string_view text, MatchTimer* timer, std::vector<int>* out) const {
  auto encode_text = [&](absl::string_view segment) {
    if (segment.empty()) return absl::OkStatus();
    if (!nfc) return EncodeOrdinary(segment, timer, out);
    // NFC; text that is not UTF-8 goes through as it is.
    utf8proc_uint8_t* normalized = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(
        reinterpret_cast<const utf8proc_uint8_t*>(segment.data()),
        static_cast<utf8proc_ssize_t>(segment.size()), &normalized,
        static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    const absl::Status encoded =
        n < 0 ? EncodeOrdinary(segment, timer, out)
              : EncodeOrdinary(
                    absl::string_view(reinterpret_cast<char*>(normalized),
                                      static_cast<size_t>(n)),
                    timer, out);
    std::free(normalized);
    return encoded;
  };
  // The added tokens first, the longest at each position.
  size_t done = 0;
  for (size_t pos = 0; pos < text.size();) {
    const std::pair<std::string, int>* hit = nullptr;
    if (!added_starts[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    for (const auto& token : added) {
      if (text.compare(pos, token.first.size(), token.first) == 0) {
        hit = &token;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    if (absl::Status s = encode_text(text.substr(done, pos - done)); !s.ok()) {
      return s;
    }
    out->push_back(hit->second);
    pos += hit->first.size();
    done = pos;
  }
  return encode_text(text.substr(done));
}

absl::StatusOr<std::vector<int>> BpeTokenizer::Encode(
    absl::string_view text, SpecialTokens special) const {
  std::vector<int> ids;
  ids.reserve(text.size() / 4);
  MatchTimer timer(text.size());
  if (impl_->hugging_face) {
    if (absl::Status s = impl_->EncodeHuggingFace(text, &timer, &ids);
        !s.ok()) {
      return s;
    }
    return ids;
  }
  if (special == SpecialTokens::kAsText) {
    if (absl::Status s = impl_->EncodeOrdinary(text, &timer, &ids); !s.ok()) {
      return s;
    }
    return ids;
  }
  constexpr absl::string_view kMarker = kGpt2EndOfTextString;
  for (size_t pos = 0;;) {
    const size_t found = text.find(kMarker, pos);
    if (absl::Status s =
            impl_->EncodeOrdinary(text.substr(pos, found - pos), &timer, &ids);
        !s.ok()) {
      return s;
    }
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
    if (ids[i] < 0 || ids[i] >= vocab_size() ||
        (impl_->hugging_face && impl_->id_to_bytes[ids[i]].empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", ids[i], " at position ", i,
                       " is not in the vocabulary [0, ", vocab_size(), ")"));
    }
    text += impl_->id_to_bytes[ids[i]];
  }
  return text;
}

int BpeTokenizer::vocab_size() const {
  return static_cast<int>(impl_->id_to_bytes.size());
}

int BpeTokenizer::end_of_text() const {
  return impl_->hugging_face ? impl_->end_of_text : kEndOfText;
}

namespace {

// tokenizer.json's `type` of a component, or "null".
std::string TypeOf(const nlohmann::json& component) {
  if (component.is_null()) return "null";
  if (!component.is_object() || !component.contains("type") ||
      !component["type"].is_string()) {
    return JsonExcerpt(component);
  }
  return component["type"].get<std::string>();
}

bool FlagOf(const nlohmann::json& component, const char* name) {
  return component.contains(name) && component[name].is_boolean() &&
         component[name].get<bool>();
}

}  // namespace

absl::StatusOr<BpeTokenizer> BpeTokenizer::LoadHuggingFace(
    const std::string& given) {
  std::error_code ec;
  const std::string path = std::filesystem::is_directory(given, ec)
                               ? given + "/tokenizer.json"
                               : given;
  // Llama 3's and Qwen's files are 9-11 MB.
  absl::StatusOr<std::string> text =
      ReadInputFile(path, int64_t{256} << 20, "a tokenizer");
  if (!text.ok()) return text.status();
  if (absl::Status s = CheckJsonNesting(*text, kMaxTokenizerNesting, path);
      !s.ok()) {
    return s;
  }
  const nlohmann::json json =
      nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object() || !json.contains("model") ||
      !json["model"].is_object()) {
    return absl::DataLossError(absl::StrCat(
        path, ": not a tokenizer.json (a JSON object with a \"model\")"));
  }
  auto unsupported = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  const nlohmann::json& model = json["model"];
  if (const std::string type = TypeOf(model); type != "BPE") {
    return unsupported(absl::StrCat(
        "the tokenizer's model is ", type,
        "; only byte-level BPE tokenizers (model.type BPE) are read"));
  }
  if (FlagOf(model, "byte_fallback")) {
    return unsupported(
        "model.byte_fallback is true (SentencePiece-style BPE); "
        "only byte-level BPE tokenizers are read");
  }
  for (const char* affix :
       {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(affix) && !model[affix].is_null() &&
        model[affix] != "") {
      return unsupported(absl::StrCat("model.", affix, " is ",
                                      JsonExcerpt(model[affix]),
                                      "; not supported"));
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->hugging_face = true;
  impl->source = path;
  impl->ignore_merges = FlagOf(model, "ignore_merges");
  // The normalizer: none or NFC (alone or the one step of a sequence).
  const nlohmann::json& normalizer =
      json.contains("normalizer") ? json["normalizer"] : nlohmann::json();
  const std::string normalizer_type = TypeOf(normalizer);
  if (normalizer_type == "NFC") {
    impl->nfc = true;
  } else if (normalizer_type != "null") {
    return unsupported(absl::StrCat("the normalizer is ", normalizer_type,
                                    "; only none or NFC is supported"));
  }
  // The pre-tokenizer: ByteLevel with GPT-2's regex, or Split by a regex
  // then ByteLevel without one.
  const nlohmann::json& pre =
      json.contains("pre_tokenizer") ? json["pre_tokenizer"] : nlohmann::json();
  std::string pattern;
  const std::string pre_type = TypeOf(pre);
  if (pre_type == "ByteLevel" && FlagOf(pre, "use_regex") &&
      !FlagOf(pre, "add_prefix_space")) {
    pattern = kPreTokenPattern;
  } else if (pre_type == "Sequence" && pre.contains("pretokenizers") &&
             pre["pretokenizers"].is_array() &&
             pre["pretokenizers"].size() == 2) {
    const nlohmann::json& split = pre["pretokenizers"][0];
    const nlohmann::json& bytes = pre["pretokenizers"][1];
    const bool split_ok =
        TypeOf(split) == "Split" && split.contains("pattern") &&
        split["pattern"].is_object() && split["pattern"].contains("Regex") &&
        split["pattern"]["Regex"].is_string() &&
        split.value("behavior", "") == "Isolated" && !FlagOf(split, "invert");
    const bool bytes_ok = TypeOf(bytes) == "ByteLevel" &&
                          !FlagOf(bytes, "use_regex") &&
                          !FlagOf(bytes, "add_prefix_space");
    if (!split_ok || !bytes_ok) {
      return unsupported(absl::StrCat(
          "the pre-tokenizer is ", TypeOf(split), " then ", TypeOf(bytes),
          "; supported: Split by a regex (Isolated) then ByteLevel"));
    }
    pattern = split["pattern"]["Regex"].get<std::string>();
  } else {
    return unsupported(absl::StrCat(
        "the pre-tokenizer is ", pre_type,
        "; supported: ByteLevel (GPT-2's regex), or Split by a regex then "
        "ByteLevel"));
  }
  if (json.contains("decoder")) {
    const std::string decoder = TypeOf(json["decoder"]);
    if (decoder != "ByteLevel" && decoder != "null") {
      return unsupported(absl::StrCat("the decoder is ", decoder,
                                      "; byte-level BPE decodes by ByteLevel"));
    }
  }
  if (absl::Status s =
          impl->LoadHfVocab(model.value("vocab", nlohmann::json()), path);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          impl->LoadHfMerges(model.value("merges", nlohmann::json()), path);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = impl->CompileRegex(pattern); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  // A pattern that matches nothing at all would never move on.
  if (impl->pre_token_regex->MatchesEmpty()) {
    return unsupported("the pre-tokenizer's regex matches the empty text");
  }
  // Added tokens: their text as is, matched before anything else.
  if (json.contains("added_tokens") && json["added_tokens"].is_array()) {
    for (const nlohmann::json& token : json["added_tokens"]) {
      if (!token.is_object() || !token.contains("id") ||
          !token["id"].is_number_integer() || !token.contains("content") ||
          !token["content"].is_string() || token["content"] == "" ||
          token["id"].get<int64_t>() < 0 ||
          token["id"].get<int64_t>() >= (int64_t{1} << 24)) {
        return absl::DataLossError(absl::StrCat(path, ": added token ",
                                                JsonExcerpt(token),
                                                " needs an id and content"));
      }
      const size_t id = token["id"].get<size_t>();
      const std::string content = token["content"].get<std::string>();
      if (id >= impl->id_to_bytes.size()) impl->id_to_bytes.resize(id + 1);
      impl->id_to_bytes[id] = content;
      impl->added.emplace_back(content, static_cast<int>(id));
      impl->added_starts[static_cast<unsigned char>(content[0])] = true;
    }
  }
  std::stable_sort(impl->added.begin(), impl->added.end(),
                   [](const auto& a, const auto& b) {
                     return a.first.size() > b.first.size();
                   });
  for (const char* eot :
       {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    if (impl->end_of_text >= 0) break;
    for (const auto& [content, id] : impl->added) {
      if (content == eot) impl->end_of_text = id;
    }
    if (impl->end_of_text < 0) {
      auto it = impl->bytes_to_id.find(eot);
      if (it != impl->bytes_to_id.end()) impl->end_of_text = it->second;
    }
  }
  return BpeTokenizer(std::move(impl));
}

}  // namespace shardtrain
