// The comparison report's findings and recommendation (compare_report.h:
// Findings, Recommendation) and the names they use: what the runs' numbers
// say, in words.
#include "client/compare_findings.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/compare_report.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain::cli {

// "DDP", "FSDP", "single-device" (train/strategy_kinds.h); other names as
// given.
std::string DisplayName(const std::string& strategy) {
  const StrategyKind* kind = FindStrategyKind(strategy);
  return kind != nullptr ? kind->display_name : strategy;
}

std::string Capitalised(std::string text) {
  if (!text.empty()) text[0] = absl::ascii_toupper(text[0]);
  return text;
}

namespace {

// A spike ratio (max / median gradient norm) above this gets a finding.
constexpr double kGradNormSpikeThreshold = 3.0;

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

bool LossCurvesCoincide(const std::vector<StrategySummary>& rows) {
  const std::vector<const StrategySummary*> ran = RowsThatRan(rows);
  if (ran.size() < 2) return false;
  const LossAgreement agreement = CompareLosses(ran, *Baseline(ran));
  return agreement.same_batch && agreement.worst <= kSameLoss;
}

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

}  // namespace shardtrain::cli
