#include "client/compare_report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "client/report_assets.h"  // generated: report/report.{js,css}
#include "client/step_metrics_csv.h"
#include "common/input_file.h"
#include "core/data/asset_paths.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"
#include "nlohmann/json.hpp"

namespace shardtrain::cli {
namespace {

// A spike ratio (max / median gradient norm) above this gets a finding.
constexpr double kGradNormSpikeThreshold = 3.0;

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

double Mean(const std::vector<double>& values) {
  if (values.empty()) return 0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

// Population standard deviation: the spread of the steps we have, not an
// estimate for unseen ones (and defined for a single step: 0).
double StdDev(const std::vector<double>& values) {
  if (values.empty()) return 0;
  const double mean = Mean(values);
  double sum_sq = 0;
  for (double v : values) sum_sq += (v - mean) * (v - mean);
  return std::sqrt(sum_sq / static_cast<double>(values.size()));
}

// Sample standard deviation (n - 1): the estimate for the steps not seen,
// which a confidence interval needs.
double SampleStdDev(const std::vector<double>& values) {
  if (values.size() < 2) return 0;
  const double mean = Mean(values);
  double sum_sq = 0;
  for (double v : values) sum_sq += (v - mean) * (v - mean);
  return std::sqrt(sum_sq / static_cast<double>(values.size() - 1));
}

// Student's t for a two-sided 95% interval with `df` degrees of freedom.
double T95(int64_t df) {
  static constexpr double kTable[] = {
      12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
      2.201,  2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
      2.080,  2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042};
  if (df < 1) return 0;
  if (df <= 30) return kTable[df - 1];
  return df <= 60 ? 2.000 : df <= 120 ? 1.980 : 1.960;
}

// Half-width of the 95% confidence interval of the mean of `values`.
double ConfidenceHalfWidth95(const std::vector<double>& values) {
  if (values.size() < 2) return 0;
  const auto n = static_cast<int64_t>(values.size());
  return T95(n - 1) * SampleStdDev(values) / std::sqrt(static_cast<double>(n));
}

// Nearest-rank percentile: the smallest value with at least p% of the values
// at or below it, so the result is always one of the measured values. The
// median everywhere in this file is Percentile(values, 50).
double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto n = static_cast<double>(values.size());
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * n));
  rank = std::clamp<size_t>(rank, 1, values.size());
  return values[rank - 1];
}

// Every (rank, step) once, the last report winning: a rank that restarted
// from a checkpoint reports its replayed steps again, and the replay is what
// the final model came from. Sorted by step, then rank.
std::vector<v1::StepMetrics> Deduplicated(
    const std::vector<v1::StepMetrics>& steps) {
  std::map<std::pair<int64_t, int32_t>, const v1::StepMetrics*> latest;
  for (const v1::StepMetrics& m : steps) latest[{m.step(), m.rank()}] = &m;
  std::vector<v1::StepMetrics> out;
  out.reserve(latest.size());
  for (const auto& [key, m] : latest) out.push_back(*m);
  return out;
}

// ---------------------------------------------------------------------------
// Text helpers
// ---------------------------------------------------------------------------

// "DDP", "FSDP", "single-device" (train/strategy_kinds.h); other names as
// given.
std::string DisplayName(const std::string& strategy) {
  const StrategyKind* kind = FindStrategyKind(strategy);
  return kind != nullptr ? kind->display_name : strategy;
}

std::string Cores(double cores) {
  return absl::StrFormat("%.1f %s", cores,
                         std::abs(cores - 1) < 0.05 ? "core" : "cores");
}

std::string Capitalised(std::string text) {
  if (!text.empty()) text[0] = absl::ascii_toupper(text[0]);
  return text;
}

std::string EscapeHtml(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"},
                                    {"<", "&lt;"},
                                    {">", "&gt;"},
                                    {"\"", "&quot;"},
                                    {"'", "&#39;"}});
}

// Inlined script text must not close its <script> element early. The HTML
// parser ends a script at "</script" in any letter case; "<\/script" means
// the same to JavaScript inside a string, regex or comment, which is the only
// place such text can occur in valid code.
std::string EscapeScriptText(const std::string& text) {
  static constexpr char kCloser[] = "</script";
  constexpr size_t kCloserSize = sizeof(kCloser) - 1;
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '<' && i + kCloserSize <= text.size() &&
        absl::EqualsIgnoreCase(absl::string_view(text).substr(i, kCloserSize),
                               kCloser)) {
      out += "<\\/";
      ++i;  // the '/' was written above
      continue;
    }
    out.push_back(text[i]);
  }
  return out;
}

// The header's sentence on the host while the runs trained: how many runs
// each strategy had, and the most other processes used during any of them.
std::string RunConditions(const std::vector<StrategyRun>& runs) {
  size_t most_runs = 1;
  double worst = -1;
  int cores = 0;
  for (const StrategyRun& run : runs) {
    most_runs = std::max(most_runs, 1 + run.repeats.size());
    std::vector<const HostLoad*> loads = {&run.host_load};
    for (const RepeatRun& r : run.repeats) loads.push_back(&r.host_load);
    for (const HostLoad* load : loads) {
      if (!load->measured) continue;
      worst = std::max(worst, load->other_cores_mean);
      cores = load->cores;
    }
  }
  std::string out =
      most_runs > 1
          ? absl::StrFormat(
                "Each strategy ran %d times, the strategies' runs "
                "interleaved; throughput intervals are the run-to-run "
                "spread.",
                most_runs)
          : "Each strategy ran once, one after another; throughput intervals "
            "are the step-to-step spread of that run (--repeat N interleaves "
            "N runs of each for a run-to-run interval).";
  if (worst < 0) {
    absl::StrAppend(&out,
                    " Host load was not measured (the coordinator runs on "
                    "another host): only a drift of step time shows a "
                    "disturbed run.");
  } else {
    absl::StrAppend(
        &out, absl::StrFormat(" Other processes on the host used at most %s "
                              "of its %d on average during any run.",
                              Cores(worst), cores));
  }
  return out;
}

std::string ScalingExplanation(const std::string& scaling) {
  if (scaling == "weak") {
    return "Weak scaling: every rank keeps the same per-rank batch, so the "
           "global batch grows with the number of ranks and ideal throughput "
           "grows in proportion.";
  }
  if (scaling == "strong") {
    return "Strong scaling: the global batch is fixed and split across the "
           "ranks, so more ranks means less work per rank for the same "
           "training problem.";
  }
  if (scaling == "budget") {
    return "Memory budget: every rank of every strategy has the same memory "
           "cap, and each strategy runs at the largest per-rank batch its "
           "plan fits under it (the batch/replica column), so the table shows "
           "what the memory a strategy saves buys: a larger batch, more "
           "tokens per step. Losses differ with the batch; compare them at "
           "equal tokens, not equal steps.";
  }
  return absl::StrCat("Scaling mode: ", scaling, ".");
}

// ---------------------------------------------------------------------------
// The table, shared by the markdown and HTML renderings
// ---------------------------------------------------------------------------

// Eleven columns, so that the table fits a terminal and a laptop's page;
// the CSVs and report.md's per-strategy lines keep the rest.
const std::vector<std::string>& TableHeader() {
  static const auto* const kHeader =
      new std::vector<std::string>{"mesh",
                                   "world",
                                   "batch/replica",
                                   "steps",
                                   "train loss",
                                   "val loss",
                                   "tokens/s (95% CI)",
                                   "step p50",
                                   "peak mem/rank (plan)",
                                   "grad norm",
                                   "MFU"};
  return *kHeader;
}

std::vector<std::string> TableCells(const StrategySummary& row) {
  std::string memory = FormatBytes(row.peak_memory_bytes_per_rank);
  if (row.predicted_peak_bytes_per_rank > 0) {
    absl::StrAppend(&memory, " (",
                    FormatBytes(row.predicted_peak_bytes_per_rank), ")");
  }
  return {
      row.strategy,
      absl::StrCat(row.world_size),
      row.batch_size > 0 ? absl::StrCat(row.batch_size) : "-",
      absl::StrCat(row.steps),
      absl::StrFormat("%.4f", row.final_train_loss),
      row.final_val_loss < 0 ? "-"
                             : absl::StrFormat("%.4f", row.final_val_loss),
      absl::StrCat(FormatThousands(std::llround(row.tokens_per_second_mean)),
                   row.timed_steps >= 2
                       ? absl::StrCat(" ± ", FormatThousands(std::llround(
                                                 row.tokens_per_second_ci95)))
                       : ""),
      FormatDuration(row.step_seconds_p50),
      memory,
      absl::StrFormat("%.3f", row.grad_norm_mean),
      absl::StrFormat("%.1f%%", row.mfu_mean * 100),
  };
}

std::string HtmlTable(const std::vector<StrategySummary>& rows) {
  std::string out = "<div class=\"table\"><table>\n<thead><tr>";
  for (const std::string& h : TableHeader()) {
    absl::StrAppend(&out, "<th>", EscapeHtml(h), "</th>");
  }
  out += "</tr></thead>\n<tbody>\n";
  for (const StrategySummary& row : rows) {
    out += "<tr>";
    for (const std::string& cell : TableCells(row)) {
      absl::StrAppend(&out, "<td>", EscapeHtml(cell), "</td>");
    }
    out += "</tr>\n";
  }
  out += "</tbody>\n</table></div>\n";
  return out;
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

// An entry's name as a file name: letters, digits, '.', '-' and '_' kept,
// ": " (auto's "auto: tp2") a '-', any other run of characters one '_'.
std::string FileStem(const std::string& strategy) {
  std::string stem;
  bool gap = false;
  for (size_t i = 0; i < strategy.size(); ++i) {
    const char c = strategy[i];
    if (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
        c == '-' || c == '_') {
      if (gap) stem += stem.empty() || stem.back() == '-' ? "" : "_";
      gap = false;
      stem += c;
    } else if (c == ':') {
      stem += '-';
      gap = false;
    } else {
      gap = true;
    }
  }
  return stem.empty() ? "run" : stem;
}

// The CSV of an entry's run: ddp.csv, auto-tp2.csv.
std::string CsvName(const std::string& strategy) {
  return absl::StrCat(FileStem(strategy), ".csv");
}

// The CSV of repeat `i` (0: the second run): ddp.run2.csv, ...
std::string RepeatCsvName(const std::string& strategy, size_t i) {
  return absl::StrCat(FileStem(strategy), ".run", i + 2, ".csv");
}

absl::StatusOr<std::string> ReadChartJs(const std::string& path) {
  absl::StatusOr<std::string> text =
      ReadOwnFile(path, int64_t{16} << 20, "chart.js");
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(
        "chart.js not found at ", path,
        " (dist/chart.umd.js of the chart.js npm package); scripts/setup "
        "installs it"));
  }
  return text;
}

absl::Status WriteWholeFile(const std::string& path,
                            const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string ReportMarkdown(const std::vector<StrategyRun>& runs,
                           const std::vector<StrategySummary>& summaries,
                           const CompareOptions& options) {
  std::string out = absl::StrCat(
      "# ", options.title.empty() ? "Strategy comparison" : options.title,
      "\n\n", ScalingExplanation(options.scaling),
      options.conditions.empty() ? "" : absl::StrCat(" ", options.conditions),
      " ", RunConditions(runs), "\n\n## Summary\n\n",
      FormatSummaryTable(summaries), "\n## Findings\n\n");
  const std::vector<std::string> findings = Findings(summaries);
  if (findings.empty()) out += "No steps were recorded to compare.\n";
  for (const std::string& f : findings) absl::StrAppend(&out, "- ", f, "\n");
  if (const std::string r = Recommendation(summaries, options.subject);
      !r.empty()) {
    absl::StrAppend(&out, "\n**", r, "**\n");
  }
  out += "\n## Files\n\n";
  for (const StrategyRun& run : runs) {
    absl::StrAppend(&out, "- `", CsvName(run.strategy),
                    "`: every rank's steps of ", "job `", run.job_id, "`\n");
    for (size_t i = 0; i < run.repeats.size(); ++i) {
      absl::StrAppend(&out, "- `", RepeatCsvName(run.strategy, i), "`: run ",
                      i + 2, ", job `", run.repeats[i].job_id, "`\n");
    }
  }
  out += "- `report.html`: the table, findings and charts in one file\n";
  return out;
}

bool LossCurvesCoincide(const std::vector<StrategySummary>& rows);

// The charts' data: per strategy, rank 0's curves and each rank's peak memory.
nlohmann::json ChartData(const std::vector<StrategyRun>& runs) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const StrategyRun& run : runs) {
    nlohmann::json steps = nlohmann::json::array();
    std::map<int32_t, int64_t> peak_by_rank;
    double elapsed = 0;  // training time so far (rank 0's steps)
    for (const v1::StepMetrics& m : Deduplicated(run.steps)) {
      int64_t& peak = peak_by_rank[m.rank()];
      peak = std::max(peak, m.memory_peak_bytes());
      if (m.rank() != 0) continue;
      elapsed += m.step_seconds();
      nlohmann::json step = {{"step", m.step()},
                             {"elapsed", elapsed},
                             {"loss", m.loss()},
                             {"grad_norm", m.grad_norm()},
                             {"tokens_per_second", m.tokens_per_second()}};
      if (m.has_val_loss()) step["val_loss"] = m.val_loss();
      steps.push_back(std::move(step));
    }
    nlohmann::json peaks = nlohmann::json::array();
    for (const auto& [rank, bytes] : peak_by_rank) {
      peaks.push_back({{"rank", rank}, {"bytes", bytes}});
    }
    strategies.push_back({{"strategy", run.strategy},
                          {"label", DisplayName(run.strategy)},
                          {"job_id", run.job_id},
                          {"world_size", run.world_size},
                          {"steps", std::move(steps)},
                          {"peak_memory", std::move(peaks)}});
  }
  return {{"strategies", std::move(strategies)}};
}

std::string ReportHtml(const std::vector<StrategyRun>& runs,
                       const std::vector<StrategySummary>& summaries,
                       const CompareOptions& options,
                       const std::string& chart_js) {
  const std::string title =
      options.title.empty() ? "Strategy comparison" : options.title;
  // '<' occurs in JSON only inside strings, where \u003c means the same; the
  // blob then cannot end its <script> element or open a comment.
  const std::string json =
      absl::StrReplaceAll(ChartData(runs).dump(), {{"<", "\\u003c"}});

  std::string out = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
      "<title>", EscapeHtml(title), "</title>\n<style>", kStyle, "</style>\n",
      // Registered before chart.js so that its own errors are caught too.
      "<script>window.reportErrors = [];\n"
      "window.onerror = function (message) {\n"
      "  window.reportErrors.push(String(message));\n};</script>\n",
      "</head>\n<body>\n<h1>", EscapeHtml(title), "</h1>\n<p>",
      EscapeHtml(ScalingExplanation(options.scaling)),
      options.conditions.empty()
          ? ""
          : absl::StrCat(" ", EscapeHtml(options.conditions)),
      " ", EscapeHtml(RunConditions(runs)), "</p>\n", "<h2>Summary</h2>\n",
      HtmlTable(summaries), "<h2>Findings</h2>\n<ul>\n");
  for (const std::string& f : Findings(summaries)) {
    absl::StrAppend(&out, "<li>", EscapeHtml(f), "</li>\n");
  }
  out += "</ul>\n";
  if (const std::string r = Recommendation(summaries, options.subject);
      !r.empty()) {
    absl::StrAppend(&out, "<p class=\"verdict\"><strong>", EscapeHtml(r),
                    "</strong></p>\n");
  }
  out += "<h2>Charts</h2>\n";
  if (LossCurvesCoincide(summaries)) {
    out +=
        "<p class=\"note\">The loss curves coincide (the strategies trained "
        "the same): each strategy is drawn with its own dash pattern and "
        "width, the widest first and each narrower one on top of it, so that "
        "every one shows.</p>\n";
  }
  for (const char* id : {"chart-loss", "chart-loss-time", "chart-grad-norm",
                         "chart-throughput", "chart-memory"}) {
    absl::StrAppend(&out, "<div class=\"chart\"><canvas id=\"", id,
                    "\"></canvas></div>\n");
  }
  out += "<h2>Jobs</h2>\n<ul>\n";
  for (const StrategyRun& run : runs) {
    absl::StrAppend(&out, "<li>", EscapeHtml(DisplayName(run.strategy)),
                    ": job <code>", EscapeHtml(run.job_id), "</code>, ",
                    EscapeHtml(CsvName(run.strategy)));
    for (size_t i = 0; i < run.repeats.size(); ++i) {
      absl::StrAppend(&out, "; run ", i + 2, ": job <code>",
                      EscapeHtml(run.repeats[i].job_id), "</code>, ",
                      EscapeHtml(RepeatCsvName(run.strategy, i)));
    }
    out += "</li>\n";
  }
  absl::StrAppend(&out, "</ul>\n<pre id=\"render-check\"></pre>\n",
                  "<script type=\"application/json\" id=\"report-data\">", json,
                  "</script>\n<script>\n", EscapeScriptText(chart_js),
                  "\n</script>\n", "<script>", kPageScript,
                  "</script>\n</body>\n</html>\n");
  return out;
}

// Rank 0's tokens/s at each step after the first (all of one step).
std::vector<double> TimedThroughput(const std::vector<v1::StepMetrics>& steps) {
  std::vector<double> rank0;
  for (const v1::StepMetrics& m : Deduplicated(steps)) {
    if (m.rank() == 0) rank0.push_back(m.tokens_per_second());
  }
  if (rank0.size() >= 2) rank0.erase(rank0.begin());
  return rank0;
}

// Appends what disturbed run `index` of `runs` (1-based): other processes
// on the host, a drift of its step time.
void NoteDisturbances(int index, size_t runs, const HostLoad& load,
                      const std::vector<double>& timed,
                      std::vector<std::string>* out) {
  const std::string which =
      runs > 1 ? absl::StrFormat("run %d of %d", index, runs) : "its run";
  if (Disturbs(load)) {
    out->push_back(absl::StrFormat(
        "other processes used %s of the host's %d on average during %s "
        "(up to %s)",
        Cores(load.other_cores_mean), load.cores, which,
        Cores(load.other_cores_peak)));
  }
  double first = 0, second = 0;
  if (ThroughputDrifts(timed, &first, &second)) {
    out->push_back(absl::StrFormat(
        "its throughput drifted from %s to %s tokens/s between the first and "
        "second half of %s",
        FormatThousands(std::llround(first)),
        FormatThousands(std::llround(second)), which));
  }
}

}  // namespace

bool ThroughputDrifts(const std::vector<double>& values, double* first_half,
                      double* second_half) {
  // Too few steps for two halves with a spread each.
  if (values.size() < 6) return false;
  const size_t half = values.size() / 2;
  const std::vector<double> a(values.begin(), values.begin() + half);
  const std::vector<double> b(values.end() - half, values.end());
  const double mean_a = Mean(a), mean_b = Mean(b);
  const double ca = ConfidenceHalfWidth95(a), cb = ConfidenceHalfWidth95(b);
  const double gap = std::abs(mean_a - mean_b);
  const bool drifts = gap > std::sqrt(ca * ca + cb * cb) &&
                      gap > 0.2 * std::max(mean_a, mean_b);
  if (drifts) {
    *first_half = mean_a;
    *second_half = mean_b;
  }
  return drifts;
}

// Rank 0 speaks for the job on loss, time, throughput, gradient norm and MFU
// (they are global or identical on every rank); memory differs by rank under
// sharding, so its peak is taken over every rank. Throughput figures (tokens/s
// and MFU) skip the first step when there are more, since it pays for warm-up
// (allocator, kernels) rather than training.
StrategySummary Summarise(const StrategyRun& run) {
  StrategySummary summary;
  summary.strategy = run.strategy;
  summary.world_size = run.world_size;
  summary.batch_size = run.batch_size;
  summary.predicted_peak_bytes_per_rank = run.predicted_peak_bytes_per_rank;
  summary.global_batch = run.batch_size * run.grad_accum *
                         (run.replicas > 0 ? run.replicas : run.world_size);

  std::vector<v1::StepMetrics> rank0;
  for (const v1::StepMetrics& m : Deduplicated(run.steps)) {
    summary.peak_memory_bytes_per_rank =
        std::max(summary.peak_memory_bytes_per_rank, m.memory_peak_bytes());
    if (m.rank() == 0) rank0.push_back(m);
  }
  for (const RepeatRun& repeat : run.repeats) {
    for (const v1::StepMetrics& m : repeat.steps) {
      summary.peak_memory_bytes_per_rank =
          std::max(summary.peak_memory_bytes_per_rank, m.memory_peak_bytes());
    }
  }
  if (rank0.empty()) return summary;

  summary.steps = static_cast<int64_t>(rank0.size());
  summary.final_train_loss = rank0.back().loss();
  for (const v1::StepMetrics& m : rank0) summary.losses[m.step()] = m.loss();
  for (const v1::StepMetrics& m : rank0) {
    if (m.has_val_loss()) summary.final_val_loss = m.val_loss();
  }

  std::vector<double> step_seconds, grad_norms, tokens_per_second, mfu;
  for (size_t i = 0; i < rank0.size(); ++i) {
    step_seconds.push_back(rank0[i].step_seconds());
    grad_norms.push_back(rank0[i].grad_norm());
    if (i == 0 && rank0.size() >= 2) continue;
    tokens_per_second.push_back(rank0[i].tokens_per_second());
    mfu.push_back(rank0[i].mfu());
  }

  summary.step_seconds_p50 = Percentile(step_seconds, 50);
  summary.step_seconds_p95 = Percentile(step_seconds, 95);
  summary.tokens_per_second_mean = Mean(tokens_per_second);
  summary.tokens_per_second_std = StdDev(tokens_per_second);
  summary.tokens_per_second_ci95 = ConfidenceHalfWidth95(tokens_per_second);
  summary.timed_steps = static_cast<int64_t>(tokens_per_second.size());

  // Each run's throughput and what disturbed it. With repeats, the interval
  // is the run-to-run spread of the runs' means: what a rerun would give.
  std::vector<double> run_means = {summary.tokens_per_second_mean};
  NoteDisturbances(1, 1 + run.repeats.size(), run.host_load, tokens_per_second,
                   &summary.disturbances);
  for (size_t i = 0; i < run.repeats.size(); ++i) {
    const std::vector<double> timed = TimedThroughput(run.repeats[i].steps);
    if (timed.empty()) continue;
    run_means.push_back(Mean(timed));
    NoteDisturbances(static_cast<int>(i + 2), 1 + run.repeats.size(),
                     run.repeats[i].host_load, timed, &summary.disturbances);
  }
  summary.runs = static_cast<int>(run_means.size());
  if (summary.runs >= 2) {
    summary.tokens_per_second_mean = Mean(run_means);
    summary.tokens_per_second_std = StdDev(run_means);
    summary.tokens_per_second_ci95 = ConfidenceHalfWidth95(run_means);
  }
  summary.mfu_mean = Mean(mfu);
  summary.grad_norm_mean = Mean(grad_norms);
  summary.grad_norm_std = StdDev(grad_norms);
  const double grad_norm_median = Percentile(grad_norms, 50);
  if (grad_norm_median > 0) {
    summary.grad_norm_spike_ratio =
        *std::max_element(grad_norms.begin(), grad_norms.end()) /
        grad_norm_median;
  }

  return summary;
}

std::string FormatSummaryTable(const std::vector<StrategySummary>& rows) {
  auto markdown_row = [](const std::vector<std::string>& cells) {
    std::vector<std::string> escaped;
    for (const std::string& c : cells) {
      escaped.push_back(absl::StrReplaceAll(c, {{"|", "\\|"}}));
    }
    return absl::StrCat("| ", absl::StrJoin(escaped, " | "), " |\n");
  };
  std::string out = markdown_row(TableHeader());
  // Every column but the strategy's name holds a number: right-aligned.
  out += "|---|";
  for (size_t i = 1; i < TableHeader().size(); ++i) out += "---:|";
  out += "\n";
  for (const StrategySummary& row : rows) out += markdown_row(TableCells(row));
  return out;
}

namespace {

// Losses within this relative difference at every step are the same
// training: what float summation order leaves (measured: 1e-7 to 1e-5 over
// tens of AdamW steps, strategy_equivalence_test).
constexpr double kSameLoss = 1e-4;
// Beyond this the curves differ by more than reduction order explains.
constexpr double kDifferentLoss = 1e-2;

// a's throughput over b's, and the ratio's 95% uncertainty (the two means'
// relative half-widths added in quadrature).
struct Ratio {
  double value = 0;
  double uncertainty = 0;
  bool known = false;  // both have at least two timed steps
  // Beyond run-to-run noise: 1 lies outside value ± uncertainty.
  bool Significant() const {
    return known && std::abs(value - 1) > uncertainty;
  }
};

Ratio ThroughputRatio(const StrategySummary& a, const StrategySummary& b) {
  Ratio r;
  if (a.tokens_per_second_mean <= 0 || b.tokens_per_second_mean <= 0) {
    return r;
  }
  r.value = a.tokens_per_second_mean / b.tokens_per_second_mean;
  r.known = (a.runs >= 2 || a.timed_steps >= 2) &&
            (b.runs >= 2 || b.timed_steps >= 2);
  const double ea = a.tokens_per_second_ci95 / a.tokens_per_second_mean;
  const double eb = b.tokens_per_second_ci95 / b.tokens_per_second_mean;
  r.uncertainty = r.value * std::sqrt(ea * ea + eb * eb);
  return r;
}

// The largest relative difference between two loss curves at the steps
// both have; -1 when they share none.
double LargestLossDifference(const StrategySummary& a,
                             const StrategySummary& b) {
  double worst = -1;
  for (const auto& [step, loss] : a.losses) {
    auto it = b.losses.find(step);
    if (it == b.losses.end()) continue;
    const double scale = std::max(std::abs(it->second), 1e-12);
    worst = std::max(worst, std::abs(loss - it->second) / scale);
  }
  return worst;
}

std::vector<const StrategySummary*> RowsThatRan(
    const std::vector<StrategySummary>& rows) {
  std::vector<const StrategySummary*> ran;
  for (const StrategySummary& row : rows) {
    if (row.steps > 0) ran.push_back(&row);
  }
  return ran;
}

// DDP when present: it keeps a whole replica on every rank, so what
// sharding saves in memory and costs in communication shows against it.
// Without DDP, single-device; else the first.
const StrategySummary* Baseline(
    const std::vector<const StrategySummary*>& ran) {
  for (const char* name : {"ddp", "single"}) {
    for (const StrategySummary* row : ran) {
      if (row->strategy == name) return row;
    }
  }
  return ran.empty() ? nullptr : ran.front();
}

// How the loss curves of `ran` agree with the baseline's: whether they share
// one global batch, and the largest relative difference at a common step.
struct LossAgreement {
  bool same_batch = true;
  double worst = 0;
};

LossAgreement CompareLosses(const std::vector<const StrategySummary*>& ran,
                            const StrategySummary& baseline) {
  LossAgreement agreement;
  for (const StrategySummary* row : ran) {
    agreement.same_batch =
        agreement.same_batch && row->global_batch == baseline.global_batch;
    agreement.worst =
        std::max(agreement.worst, LargestLossDifference(*row, baseline));
  }
  return agreement;
}

// Two or more strategies of one global batch whose loss curves agree at
// every step: drawn on top of each other.
bool LossCurvesCoincide(const std::vector<StrategySummary>& rows) {
  const std::vector<const StrategySummary*> ran = RowsThatRan(rows);
  if (ran.size() < 2) return false;
  const LossAgreement agreement = CompareLosses(ran, *Baseline(ran));
  return agreement.same_batch && agreement.worst <= kSameLoss;
}

std::string NameList(const std::vector<const StrategySummary*>& rows) {
  std::vector<std::string> names;
  for (const StrategySummary* row : rows) {
    names.push_back(DisplayName(row->strategy));
  }
  if (names.size() <= 1) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "),
                      " and ", names.back());
}

// Whether another process or a drift disturbed any run: then no speed
// difference is called beyond noise and no strategy is named fastest.
bool SpeedDisturbed(const std::vector<const StrategySummary*>& ran) {
  for (const StrategySummary* row : ran) {
    if (!row->disturbances.empty()) return true;
  }
  return false;
}

// Where the throughput intervals come from.
std::string SpreadSource(const std::vector<const StrategySummary*>& ran) {
  int runs = 1;
  for (const StrategySummary* row : ran) runs = std::max(runs, row->runs);
  return runs >= 2 ? absl::StrFormat("the spread of %d interleaved runs", runs)
                   : "the step-to-step spread";
}

std::string RatioText(const Ratio& r) {
  return r.known ? absl::StrFormat("%.2f× ± %.2f", r.value, r.uncertainty)
                 : absl::StrFormat("%.2f×", r.value);
}

}  // namespace

std::vector<std::string> Findings(const std::vector<StrategySummary>& rows) {
  const std::vector<const StrategySummary*> ran = RowsThatRan(rows);
  std::vector<std::string> findings;
  if (ran.empty()) return findings;
  const StrategySummary* baseline = Baseline(ran);

  // Did they train the same? Step by step, among runs of one global batch.
  if (ran.size() >= 2) {
    const LossAgreement agreement = CompareLosses(ran, *baseline);
    const double worst = agreement.worst;
    if (!agreement.same_batch) {
      std::vector<std::string> finals;
      for (const StrategySummary* row : ran) {
        finals.push_back(
            absl::StrFormat("%s %.4f at batch %d", DisplayName(row->strategy),
                            row->final_train_loss, row->global_batch));
      }
      findings.push_back(absl::StrCat(
          "Losses are not comparable step for step: the strategies ran at "
          "different global batches (final train loss: ",
          absl::StrJoin(finals, "; "), ")."));
    } else if (worst <= kSameLoss) {
      findings.push_back(absl::StrFormat(
          "Same training: the loss curves of %s agree at every step (largest "
          "relative difference %.1e, float summation order); the strategies "
          "differ in memory and speed only.",
          NameList(ran), worst));
    } else if (worst <= kDifferentLoss) {
      findings.push_back(absl::StrFormat(
          "Equivalent training: the loss curves of %s agree to within %.1e "
          "relative at every step (summation order, grown over the optimizer "
          "steps); no strategy trains better.",
          NameList(ran), worst));
    } else {
      findings.push_back(absl::StrFormat(
          "The loss curves differ by up to %.1f%% relative at the same step: "
          "more than summation order explains. Check that the runs share "
          "their data, seed and global batch.",
          100 * worst));
    }
  }

  // Memory (exact: the tracking allocator) and throughput (with its
  // uncertainty) against the baseline.
  const std::string base = DisplayName(baseline->strategy);
  const bool disturbed = SpeedDisturbed(ran);
  for (const StrategySummary* row : ran) {
    if (row == baseline) continue;
    std::vector<std::string> clauses;
    if (baseline->peak_memory_bytes_per_rank > 0) {
      clauses.push_back(absl::StrFormat(
          "peak memory per rank was %.2f× %s's",
          static_cast<double>(row->peak_memory_bytes_per_rank) /
              static_cast<double>(baseline->peak_memory_bytes_per_rank),
          base));
    }
    const Ratio r = ThroughputRatio(*row, *baseline);
    if (r.value > 0) {
      clauses.push_back(absl::StrFormat(
          "%sthroughput %s %s's (%s)", clauses.empty() ? "" : "its ",
          RatioText(r), base,
          disturbed          ? "the runs were disturbed: not compared"
          : !r.known         ? "too few steps to tell from run-to-run noise"
          : !r.Significant() ? "within run-to-run noise"
          : r.value > 1      ? "faster beyond run-to-run noise"
                             : "slower beyond run-to-run noise"));
    }
    if (clauses.empty()) continue;
    findings.push_back(absl::StrCat(Capitalised(DisplayName(row->strategy)),
                                    " ", absl::StrJoin(clauses, "; "), "."));
  }

  // The fastest, when it is so beyond noise and nothing disturbed the runs.
  if (ran.size() >= 2 && disturbed) {
    std::vector<std::string> what;
    for (const StrategySummary* row : ran) {
      for (const std::string& d : row->disturbances) {
        what.push_back(absl::StrCat(DisplayName(row->strategy), ": ", d));
      }
    }
    findings.push_back(absl::StrCat(
        "Speed findings are disturbed, so no strategy is named fastest (",
        absl::StrJoin(what, "; "),
        "). Rerun on an idle host, or with --repeat 3 to interleave the "
        "strategies' runs."));
  } else if (ran.size() >= 2) {
    std::vector<const StrategySummary*> by_speed = ran;
    std::sort(by_speed.begin(), by_speed.end(),
              [](const StrategySummary* a, const StrategySummary* b) {
                return a->tokens_per_second_mean > b->tokens_per_second_mean;
              });
    std::vector<const StrategySummary*> tied = {by_speed[0]};
    bool known = true;
    for (size_t i = 1; i < by_speed.size(); ++i) {
      const Ratio r = ThroughputRatio(*by_speed[0], *by_speed[i]);
      known = known && r.known;
      if (!r.Significant()) tied.push_back(by_speed[i]);
    }
    if (!known) {
      findings.push_back(
          "Throughput: too few timed steps to tell the strategies apart from "
          "run-to-run noise; run 10 steps or more.");
    } else if (tied.size() == 1) {
      findings.push_back(absl::StrFormat(
          "%s was the fastest beyond run-to-run noise, at %s ± %s tokens/s "
          "(95%% confidence from %s).",
          Capitalised(DisplayName(by_speed[0]->strategy)),
          FormatThousands(std::llround(by_speed[0]->tokens_per_second_mean)),
          FormatThousands(std::llround(by_speed[0]->tokens_per_second_ci95)),
          SpreadSource(ran)));
    } else {
      findings.push_back(absl::StrFormat(
          "%s were equally fast within run-to-run noise (95%% confidence "
          "from %s).",
          Capitalised(NameList(tied)), SpreadSource(ran)));
    }
  }

  for (const StrategySummary* row : ran) {
    if (row->grad_norm_spike_ratio > kGradNormSpikeThreshold) {
      findings.push_back(absl::StrFormat(
          "%s's gradient norm spiked to %.1f× its median (above %.0f× is "
          "worth a look: a too-high learning rate or a bad batch).",
          Capitalised(DisplayName(row->strategy)), row->grad_norm_spike_ratio,
          kGradNormSpikeThreshold));
    }
  }
  return findings;
}

std::string Recommendation(const std::vector<StrategySummary>& rows,
                           const std::string& subject) {
  const std::vector<const StrategySummary*> ran = RowsThatRan(rows);
  if (ran.empty()) return "";
  const std::string lead =
      subject.empty() ? "Recommendation: "
                      : absl::StrCat("Recommendation for ", subject, ": ");
  if (ran.size() == 1) {
    return absl::StrCat(lead, DisplayName(ran[0]->strategy),
                        ", the only strategy that ran.");
  }
  // The fastest, and those within noise of it; among them the least memory.
  const StrategySummary* fastest = ran[0];
  for (const StrategySummary* row : ran) {
    if (row->tokens_per_second_mean > fastest->tokens_per_second_mean) {
      fastest = row;
    }
  }
  bool known = true;
  std::vector<const StrategySummary*> tied;
  for (const StrategySummary* row : ran) {
    const Ratio r = ThroughputRatio(*fastest, *row);
    known = known && (row == fastest || r.known);
    if (row == fastest || !r.Significant()) tied.push_back(row);
  }
  auto least_memory = [](const std::vector<const StrategySummary*>& among) {
    return *std::min_element(
        among.begin(), among.end(),
        [](const StrategySummary* a, const StrategySummary* b) {
          return a->peak_memory_bytes_per_rank < b->peak_memory_bytes_per_rank;
        });
  };
  const StrategySummary* leanest = least_memory(ran);
  auto memory_ratio = [](const StrategySummary* a, const StrategySummary* b) {
    return b->peak_memory_bytes_per_rank > 0
               ? static_cast<double>(a->peak_memory_bytes_per_rank) /
                     static_cast<double>(b->peak_memory_bytes_per_rank)
               : 0.0;
  };
  if (SpeedDisturbed(ran)) {
    return absl::StrFormat(
        "%sspeed not compared, the runs were disturbed (see the findings); "
        "on memory, %s needs the least per rank (%s).",
        lead, DisplayName(leanest->strategy),
        FormatBytes(leanest->peak_memory_bytes_per_rank));
  }
  if (!known) {
    return absl::StrFormat(
        "%stoo few steps to compare speed (run 10 or more); on memory, %s "
        "needs the least per rank (%s).",
        lead, DisplayName(leanest->strategy),
        FormatBytes(leanest->peak_memory_bytes_per_rank));
  }
  const StrategySummary* choice = least_memory(tied);
  std::string why;
  if (tied.size() > 1) {
    const StrategySummary* other = choice == fastest ? tied[0] : fastest;
    if (other == choice) other = tied[1];
    why = absl::StrFormat(
        "as fast as %s within run-to-run noise, at %.2f× "
        "its peak memory per rank",
        DisplayName(other->strategy), memory_ratio(choice, other));
  } else {
    const StrategySummary* runner_up = nullptr;
    for (const StrategySummary* row : ran) {
      if (row != choice &&
          (runner_up == nullptr ||
           row->tokens_per_second_mean > runner_up->tokens_per_second_mean)) {
        runner_up = row;
      }
    }
    why = absl::StrFormat("the fastest, %s %s's tokens/s",
                          RatioText(ThroughputRatio(*choice, *runner_up)),
                          DisplayName(runner_up->strategy));
    if (leanest != choice && leanest->peak_memory_bytes_per_rank <
                                 choice->peak_memory_bytes_per_rank) {
      absl::StrAppendFormat(
          &why,
          "; when memory is short, %s needs %.2f× its memory per rank "
          "at %.2f× its speed",
          DisplayName(leanest->strategy), memory_ratio(leanest, choice),
          ThroughputRatio(*leanest, *choice).value);
    }
  }
  return absl::StrCat(lead, DisplayName(choice->strategy), ": ", why, ".");
}

absl::Status WriteCompareReport(const std::vector<StrategyRun>& runs,
                                const CompareOptions& options,
                                const std::string& out_dir) {
  std::set<std::string> names;
  for (const StrategyRun& run : runs) {
    if (run.strategy.empty() ||
        run.strategy.find_first_of("/\\") != std::string::npos ||
        run.strategy == "." || run.strategy == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy name \"", run.strategy, "\" cannot name a CSV file"));
    }
    if (!names.insert(CsvName(run.strategy)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy \"", run.strategy,
                       "\" appears twice (or another's CSV file is ",
                       CsvName(run.strategy), ")"));
    }
  }

  // chart.js first: a report without its charts is not written at all.
  const std::string chart_js_path =
      options.chart_js_path.empty()
          ? AssetsDir() + "/node_modules/chart.js/dist/chart.umd.js"
          : options.chart_js_path;
  absl::StatusOr<std::string> chart_js = ReadChartJs(chart_js_path);
  if (!chart_js.ok()) return chart_js.status();

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  }

  std::vector<StrategySummary> summaries;
  summaries.reserve(runs.size());
  for (const StrategyRun& run : runs) summaries.push_back(Summarise(run));

  for (const StrategyRun& run : runs) {
    absl::Status status =
        WriteWholeFile(out_dir + "/" + CsvName(run.strategy),
                       StepMetricsCsv(Deduplicated(run.steps)));
    if (!status.ok()) return status;
    for (size_t i = 0; i < run.repeats.size(); ++i) {
      status =
          WriteWholeFile(out_dir + "/" + RepeatCsvName(run.strategy, i),
                         StepMetricsCsv(Deduplicated(run.repeats[i].steps)));
      if (!status.ok()) return status;
    }
  }
  absl::Status status = WriteWholeFile(
      out_dir + "/report.md", ReportMarkdown(runs, summaries, options));
  if (!status.ok()) return status;
  return WriteWholeFile(out_dir + "/report.html",
                        ReportHtml(runs, summaries, options, *chart_js));
}

}  // namespace shardtrain::cli
