#include "core/data/pretoken_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardtrain {
namespace {

// Bounds on matching a pre-tokenizer regex, which a tokenizer.json chooses:
// one that backtracks catastrophically ((\w+\s?)+$ on 101 letters tries 2^100
// ways) is refused in a fraction of a second instead of running for hours.
//  - kMatchLimit, PCRE2's default: backtracking steps from one start
//    position (about 0.05 s with JIT, 0.3 s without). GPT-2's regex takes
//    none per character of a whitespace run, Llama 3's and Qwen's a step
//    or two, so runs of three million characters still match.
//  - kDepthLimit and kHeapLimitKib bound the interpreter's (no JIT)
//    backtracking memory, kJitStackMaxBytes JIT's: those three regexes need
//    none beyond the 32 KiB a JIT stack starts with; one repeating a group,
//    (?:\p{L}|')+, needs a frame per character.
//  - The time bound, for regexes that are slow at every position rather
//    than at one ((\w)+\d on 30,000 letters: 5 s, quadratically more on
//    longer text): a text's matching may take kMatchTimeBaseNs plus
//    kMatchTimePerMiBNs for each MiB. Those three regexes match about
//    13 MB/s with JIT on a 2-core EPYC VM, over ten times faster.
constexpr uint32_t kMatchLimit = 10'000'000;
constexpr uint32_t kDepthLimit = 1'000'000;
constexpr uint32_t kHeapLimitKib = 64 << 10;
constexpr size_t kJitStackMaxBytes = 64 << 20;
constexpr int64_t kMatchTimeBaseNs = 250'000'000;
constexpr int64_t kMatchTimePerMiBNs = 1'000'000'000;

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

// Nanoseconds on CLOCK_MONOTONIC_COARSE: memory the kernel updates every
// tick (1-4 ms) whatever the clock source, so cheap enough to read at every
// pre-token, and fine-grained enough for a bound of a quarter second.
int64_t CoarseNowNs() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

// Every compiled pre-tokenizer regex starts with this callout, so PCRE2
// calls OnStartPosition at each position it tries a match from, with or
// without JIT: where a slow pattern spends its time. It costs JIT its skip
// over the rest of a run a leading \w+ failed on, so a regex that fails
// at every position of a long run ([^\d]+\d on letters) turns quadratic
// and meets the time bound; tokenizers' regexes cover every character and
// match at each position they try.
constexpr char kStartCallout[] = "(?C1)";

int OnStartPosition(pcre2_callout_block* /*block*/, void* timer) {
  return static_cast<const MatchTimer*>(timer)->Expired() ? PCRE2_ERROR_CALLOUT
                                                          : 0;
}

// The length of `pattern`'s leading (*UCP)-style settings, which must stay
// first: the callout goes after them.
size_t LeadingSettingsLength(absl::string_view pattern) {
  size_t at = 0;
  while (absl::StartsWith(pattern.substr(at), "(*")) {
    const size_t close = pattern.find(')', at);
    if (close == absl::string_view::npos ||
        !std::all_of(pattern.begin() + at + 2, pattern.begin() + close,
                     [](char c) {
                       return (c >= 'A' && c <= 'Z') ||
                              (c >= '0' && c <= '9') || c == '_' || c == '=';
                     })) {
      break;
    }
    at = close + 1;
  }
  return at;
}

// `text` cut to at most `max_bytes` (at a UTF-8 character boundary) with
// "..." after a cut.
std::string Truncated(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return absl::StrCat(text.substr(0, cut), "...");
}

// Per-thread PCRE2 matching state, shared by every tokenizer: the bounds
// above.
struct MatchState {
  MatchState() {
    context.reset(pcre2_match_context_create(nullptr));
    jit_stack.reset(
        pcre2_jit_stack_create(32 << 10, kJitStackMaxBytes, nullptr));
    pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());
    pcre2_set_match_limit(context.get(), kMatchLimit);
    pcre2_set_depth_limit(context.get(), kDepthLimit);
    pcre2_set_heap_limit(context.get(), kHeapLimitKib);
  }
  // Room for the whole match only: the patterns' groups are not read, so
  // one state serves every tokenizer's pattern.
  pcre2_match_data* MatchData() {
    if (match == nullptr) match.reset(pcre2_match_data_create(1, nullptr));
    return match.get();
  }

  std::unique_ptr<pcre2_match_data, MatchDataDeleter> match;
  std::unique_ptr<pcre2_match_context, MatchContextDeleter> context;
  std::unique_ptr<pcre2_jit_stack, JitStackDeleter> jit_stack;
};

absl::Status MatchError(int rc, const std::string& pattern,
                        const MatchTimer& timer) {
  std::string bound;
  switch (rc) {
    case PCRE2_ERROR_MATCHLIMIT:
      bound = absl::StrCat("PCRE2's match limit (", kMatchLimit,
                           " backtracking steps from one position)");
      break;
    case PCRE2_ERROR_DEPTHLIMIT:
      bound = absl::StrCat("PCRE2's depth limit (", kDepthLimit,
                           " nested backtracking points)");
      break;
    case PCRE2_ERROR_HEAPLIMIT:
      bound = absl::StrCat("PCRE2's heap limit (", kHeapLimitKib >> 10,
                           " MiB of backtracking frames)");
      break;
    case PCRE2_ERROR_JIT_STACKLIMIT:
      bound = absl::StrCat("the JIT stack limit (", kJitStackMaxBytes >> 20,
                           " MiB)");
      break;
    case PCRE2_ERROR_CALLOUT:
      bound = absl::StrFormat(
          "its time bound (%.2f s for this text: %.2f s plus %.0f s per MiB)",
          timer.limit_seconds(), kMatchTimeBaseNs * 1e-9,
          kMatchTimePerMiBNs * 1e-9);
      break;
    default: {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(rc, message.data(), message.size());
      bound = absl::StrCat("a PCRE2 error (",
                           reinterpret_cast<const char*>(message.data()), ")");
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the pre-tokenizer's regex \"", Truncated(pattern, 60), "\" exceeded ",
      bound, " on a ", timer.text_bytes(),
      "-byte text; a regex that backtracks this much is not supported"));
}

}  // namespace

MatchTimer::MatchTimer(size_t text_bytes)
    : text_bytes_(text_bytes),
      limit_ns_(kMatchTimeBaseNs +
                static_cast<int64_t>(static_cast<double>(text_bytes) *
                                     kMatchTimePerMiBNs / (1 << 20))) {}

void MatchTimer::Start() { started_ns_ = CoarseNowNs(); }
void MatchTimer::Stop() { spent_ns_ += CoarseNowNs() - started_ns_; }
bool MatchTimer::Expired() const {
  return spent_ns_ + (CoarseNowNs() - started_ns_) > limit_ns_;
}

absl::StatusOr<PretokenRegex> PretokenRegex::Compile(
    const std::string& pattern) {
  const size_t settings = LeadingSettingsLength(pattern);
  const std::string timed = absl::StrCat(
      pattern.substr(0, settings), kStartCallout, pattern.substr(settings));
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  std::unique_ptr<pcre2_code, CodeDeleter> code(
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(timed.data()), timed.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF,
                    &error_code, &error_offset, nullptr));
  if (code == nullptr) {
    // The offset in `pattern`, not `timed`.
    const size_t callout = sizeof(kStartCallout) - 1;
    error_offset = error_offset >= settings + callout
                       ? error_offset - callout
                       : std::min<PCRE2_SIZE>(error_offset, settings);
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error_code, message.data(), message.size());
    return absl::InvalidArgumentError(absl::StrCat(
        "the pre-token regex does not compile at offset ", error_offset, ": ",
        reinterpret_cast<const char*>(message.data())));
  }
  // JIT is an optimisation: without it (no JIT on this CPU) matching is
  // slower but identical.
  pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
  return PretokenRegex(pattern, std::move(code));
}

void PretokenRegex::CodeDeleter::operator()(pcre2_real_code_8* code) const {
  pcre2_code_free(code);
}

PretokenRegex::PretokenRegex(
    std::string pattern, std::unique_ptr<pcre2_real_code_8, CodeDeleter> code)
    : pattern_(std::move(pattern)), code_(std::move(code)) {}
PretokenRegex::PretokenRegex(PretokenRegex&&) noexcept = default;
PretokenRegex& PretokenRegex::operator=(PretokenRegex&&) noexcept = default;
PretokenRegex::~PretokenRegex() = default;

absl::StatusOr<bool> PretokenRegex::Find(absl::string_view text, size_t start,
                                         MatchTimer* timer, size_t* begin,
                                         size_t* end) const {
  thread_local MatchState state;
  pcre2_match_data* match = state.MatchData();
  pcre2_set_callout(state.context.get(), &OnStartPosition, timer);
  timer->Start();
  const int rc =
      pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(text.data()),
                  text.size(), start, 0, match, state.context.get());
  timer->Stop();
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) return MatchError(rc, pattern_, *timer);
  const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match);
  *begin = range[0];
  *end = range[1];
  return true;
}

bool PretokenRegex::MatchesEmpty() const {
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> match(
      pcre2_match_data_create(1, nullptr));
  return pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(""), 0, 0, 0,
                     match.get(), nullptr) >= 0;
}

}  // namespace shardtrain
