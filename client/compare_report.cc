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
#include "client/compare_findings.h"
#include "client/report_assets.h"  // generated: report/report.{js,css}
#include "client/step_metrics_csv.h"
#include "common/input_file.h"
#include "core/data/asset_paths.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"
#include "nlohmann/json.hpp"

namespace shardtrain::cli {
namespace {

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

std::string Cores(double cores) {
  return absl::StrFormat("%.1f %s", cores,
                         std::abs(cores - 1) < 0.05 ? "core" : "cores");
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
