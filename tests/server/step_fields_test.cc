// The per-step fields are declared once (SHARDTRAIN_STEP_FIELDS in
// core/run/step_metrics.h); what is written from that list (the
// StepMetrics members, metrics.jsonl, the proto conversion, the CSV, the
// Prometheus series) carries every field, and what is written by hand
// (job.proto's message, docs/metrics.md) is checked against it here: a
// field added in one place only fails, naming the places it is missing
// from.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/step_metrics_csv.h"
#include "core/run/step_metrics.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/job_config.h"
#include "server/metrics_exporter.h"
#include "tests/test_util.h"

namespace shardtrain {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// What `exporter`'s /metrics serves now.
std::string Scrape(const MetricsExporter& exporter) {
  const int port =
      std::stoi(exporter.address().substr(exporter.address().rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string text;
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) == 0) {
    const std::string request = "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n";
    (void)!write(fd, request.data(), request.size());
    char buffer[65536];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) text.append(buffer, n);
  }
  close(fd);
  return text;
}

// What /metrics serves once a rank has reported a step carrying every
// field (a pipeline stage and an eval included).
std::string ExpositionWithEveryField() {
  MetricsExporterOptions options;
  options.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Start(options);
  if (!exporter.ok()) return "";
  v1::Job job;
  job.set_id("job-000001");
  job.mutable_spec()->mutable_strategy()->set_name("single");
  StepMetrics m;
  m.step = 1;
  m.pipeline_stage = 0;
  m.val_loss = 1;
  (*exporter)->OnSteps(job, {StepMetricsToProto(m)});
  return Scrape(**exporter);
}

// The per-user counters follow the job's own counts, which `shardtrain get`
// shows: a re-mesh (its ranks stopped, through PREEMPTED, and started again
// on another mesh) is not a preemption.
TEST(MetricsExporterTest, CountersFollowTheJobsOwnCounts) {
  MetricsExporterOptions options;
  options.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Start(options);
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  v1::Job job;
  job.set_id("job-000001");
  job.set_owner("alice");
  job.mutable_spec()->mutable_strategy()->set_name("ddp");
  const auto to = [&](v1::JobState state) {
    job.set_state(state);
    (*exporter)->OnJobChanged(job);
  };
  to(v1::QUEUED);
  to(v1::RUNNING);
  job.set_remeshes(1);  // shrunk for an urgent job
  to(v1::PREEMPTED);
  to(v1::RUNNING);
  job.set_preemptions(1);  // then preempted
  to(v1::PREEMPTED);
  to(v1::QUEUED);
  const std::string text = Scrape(**exporter);
  EXPECT_THAT(text, testing::HasSubstr(
                        "shardtrain_job_preemptions_total{user=\"alice\"} 1"));
  EXPECT_THAT(text, testing::HasSubstr(
                        "shardtrain_job_remeshes_total{user=\"alice\"} 1"));
}

// docs/metrics.md: its per-step records section, then the rest (where the
// series are listed).
struct MetricsDocs {
  std::string records;
  std::string all;
};

MetricsDocs Docs() {
  MetricsDocs docs;
  docs.all =
      test::ReadFile(std::string(SHARDTRAIN_SOURCE_DIR) + "/docs/metrics.md");
  const size_t start = docs.all.find("## Per-step records");
  if (start != std::string::npos) {
    docs.records =
        docs.all.substr(start, docs.all.find("\n## ", start + 1) - start);
  }
  return docs;
}

// Every way `fields` and the hand-written places disagree: a field missing
// from v1::StepMetrics (or of another type there), a proto field no field
// declares, a series /metrics does not serve, a field or series
// docs/metrics.md does not name.
std::vector<std::string> Disagreements(const std::vector<StepField>& fields,
                                       const std::string& exposition,
                                       const MetricsDocs& docs) {
  std::vector<std::string> problems;
  const google::protobuf::Descriptor* proto = v1::StepMetrics::descriptor();
  std::set<std::string> declared;
  for (const StepField& f : fields) {
    declared.insert(f.name);
    const google::protobuf::FieldDescriptor* field =
        proto->FindFieldByName(f.name);
    const bool optional = f.presence == StepField::Presence::kOptional;
    if (field == nullptr) {
      problems.push_back(absl::StrCat(f.name, ": missing from v1::StepMetrics",
                                      " (proto/shardtrain/v1/job.proto)"));
    } else if (f.is_integer() !=
                   (field->cpp_type() !=
                    google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE) ||
               optional != field->has_presence()) {
      problems.push_back(absl::StrCat(
          f.name, ": v1::StepMetrics declares it as ",
          field->has_presence() ? "optional " : "", field->type_name(),
          ", the field list as ", optional ? "optional " : "",
          f.is_integer() ? "an integer" : "a double"));
    }
    if (docs.records.find(absl::StrCat("| `", f.name, "` |")) ==
        std::string::npos) {
      problems.push_back(absl::StrCat(f.name, ": missing from docs/metrics.md",
                                      "'s per-step records"));
    }
    if (f.series == StepField::Series::kNone) continue;
    if (exposition.find(absl::StrCat("# TYPE ", f.series_name, " ")) ==
        std::string::npos) {
      problems.push_back(absl::StrCat(f.name, ": its series ", f.series_name,
                                      " is not served at /metrics"));
    }
    if (docs.all.find(absl::StrCat("| `", f.series_name, "` |")) ==
        std::string::npos) {
      problems.push_back(absl::StrCat(f.name, ": its series ", f.series_name,
                                      " is missing from docs/metrics.md"));
    }
  }
  for (int i = 0; i < proto->field_count(); ++i) {
    if (declared.count(proto->field(i)->name()) == 0) {
      problems.push_back(
          absl::StrCat("v1::StepMetrics.", proto->field(i)->name(),
                       ": declared by no step field (SHARDTRAIN_STEP_FIELDS in "
                       "core/run/step_metrics.h)"));
    }
  }
  return problems;
}

TEST(StepFieldsTest, EveryHandWrittenPlaceAgreesWithTheFieldList) {
  const std::string exposition = ExpositionWithEveryField();
  ASSERT_FALSE(exposition.empty());

  EXPECT_THAT(Disagreements(StepFields(), exposition, Docs()), IsEmpty());
}

TEST(StepFieldsTest, AFieldAddedInOnePlaceOnlyIsNamedWithThePlacesItLacks) {
  const std::string exposition = ExpositionWithEveryField();
  ASSERT_FALSE(exposition.empty());
  // Added to the list alone (so not to the proto, the docs, nor, since the
  // exporter registered the real list, /metrics).
  std::vector<StepField> added = StepFields();
  StepField fake = added.front();
  fake.name = "fake_seconds";
  fake.series_name = "shardtrain_fake_seconds";
  added.push_back(fake);
  // Added to the proto alone: the list lacks p2p_bytes.
  std::vector<StepField> lacking;
  for (const StepField& f : StepFields()) {
    if (std::string(f.name) != "p2p_bytes") lacking.push_back(f);
  }

  EXPECT_THAT(
      Disagreements(added, exposition, Docs()),
      ElementsAre(
          "fake_seconds: missing from v1::StepMetrics "
          "(proto/shardtrain/v1/job.proto)",
          "fake_seconds: missing from docs/metrics.md's per-step records",
          "fake_seconds: its series shardtrain_fake_seconds is not served at "
          "/metrics",
          "fake_seconds: its series shardtrain_fake_seconds is missing from "
          "docs/metrics.md"));
  EXPECT_THAT(Disagreements(lacking, exposition, Docs()),
              ElementsAre("v1::StepMetrics.p2p_bytes: declared by no step "
                          "field (SHARDTRAIN_STEP_FIELDS in "
                          "core/run/step_metrics.h)"));
}

// A step whose every field holds its own value: field i holds i + 1 (and a
// half, for a double), so a field written into another's place shows.
StepMetrics EveryFieldDistinct() {
  StepMetrics m;
  const std::vector<StepField>& fields = StepFields();
  for (size_t i = 0; i < fields.size(); ++i) {
    fields[i].Set(
        m, static_cast<double>(i + 1) + (fields[i].is_integer() ? 0.0 : 0.5));
  }
  return m;
}

TEST(StepFieldsTest, JsonProtoAndCsvCarryEveryFieldToItsPlace) {
  const StepMetrics m = EveryFieldDistinct();
  const absl::StatusOr<StepMetrics> from_json =
      StepMetrics::FromJson(m.ToJson());
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  const StepMetrics from_proto = StepMetricsFromProto(StepMetricsToProto(m));
  const std::vector<std::string> lines =
      absl::StrSplit(cli::StepMetricsCsv({StepMetricsToProto(m)}), '\n');
  ASSERT_GE(lines.size(), 2u);
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  const std::vector<std::string> row = absl::StrSplit(lines[1], ',');
  const std::vector<StepField>& fields = StepFields();
  ASSERT_EQ(header.size(), fields.size());
  ASSERT_EQ(row.size(), fields.size());

  for (size_t i = 0; i < fields.size(); ++i) {
    const StepField& f = fields[i];
    EXPECT_EQ(f.Value(*from_json), f.Value(m)) << f.name << " in JSON";
    EXPECT_EQ(f.Value(from_proto), f.Value(m)) << f.name << " in the proto";
    EXPECT_EQ(header[i], f.name) << "CSV column " << i;
    EXPECT_EQ(std::stod(row[i]), f.Value(m)) << f.name << " in the CSV";
  }
}

TEST(StepFieldsTest, OptionalFieldsAreAbsentBelowZeroAndStageFieldsGoWithIt) {
  StepMetrics m = EveryFieldDistinct();
  m.pipeline_stage = -1;
  m.val_loss = -1;

  const std::string json = m.ToJson();
  const v1::StepMetrics proto = StepMetricsToProto(m);
  const std::string csv = cli::StepMetricsCsv({proto});

  for (const char* absent :
       {"pipeline_stage", "pipeline_bubble_seconds", "p2p_bytes", "val_loss"}) {
    EXPECT_EQ(json.find(absent), std::string::npos) << absent;
  }
  EXPECT_FALSE(proto.has_pipeline_stage());
  EXPECT_FALSE(proto.has_val_loss());
  EXPECT_EQ(proto.p2p_bytes(), 0);
  const StepMetrics back = StepMetricsFromProto(proto);
  EXPECT_EQ(back.pipeline_stage, -1);
  EXPECT_EQ(back.val_loss, -1);
  // An absent optional field is an empty cell; val_loss is the last.
  EXPECT_EQ(csv.back(), '\n');
  EXPECT_EQ(csv[csv.size() - 2], ',');
}

}  // namespace
}  // namespace shardtrain
