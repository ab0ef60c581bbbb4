#include "proto/job_config.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/plan/mesh_search.h"
#include "core/run/strategy_kinds.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace shardtrain {
namespace {

constexpr int kMaxWorldSize = 1024;
constexpr int kMaxRestarts = 100;
constexpr size_t kMaxNameLength = 128;
constexpr size_t kMaxLabels = 32;
constexpr size_t kMaxLabelKeyLength = 63;
constexpr size_t kMaxLabelValueLength = 256;
constexpr size_t kMaxPathLength = 4096;
constexpr size_t kMaxModelLength = 256;
constexpr int kMaxPriority = 1000;

bool IsLabelKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxLabelKeyLength) return false;
  for (char ch : key) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '_' || ch == '-' ||
                    ch == '.' || ch == '/';
    if (!ok) return false;
  }
  return true;
}

// Names and label values are free text shown in tables, logs and metrics:
// any text but control characters (a newline would forge a log line, an
// escape sequence would drive the reader's terminal), in UTF-8 as well: the
// C1 controls U+0080-U+009F (0xC2 0x80-0x9F; U+009B is a CSI on some
// terminals) and the bidirectional overrides and isolates U+202A-U+202E,
// U+2066-U+2069 (0xE2 0x80 0xAA-0xAE, 0xE2 0x81 0xA6-0xA9), which reorder
// what a reader sees. Never a path: jobs live under their generated id.
bool HasControlCharacter(const std::string& text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n; ++i) {
    const unsigned char ch = bytes[i];
    if (ch < 0x20 || ch == 0x7f) return true;
    if (ch == 0xC2 && i + 1 < n && bytes[i + 1] >= 0x80 &&
        bytes[i + 1] <= 0x9F) {
      return true;
    }
    if (ch == 0xE2 && i + 2 < n &&
        ((bytes[i + 1] == 0x80 && bytes[i + 2] >= 0xAA &&
          bytes[i + 2] <= 0xAE) ||
         (bytes[i + 1] == 0x81 && bytes[i + 2] >= 0xA6 &&
          bytes[i + 2] <= 0xA9))) {
      return true;
    }
  }
  return false;
}

// A value too long to echo back is summarised by its length.
std::string Shown(const std::string& value) {
  if (value.size() <= 64) return absl::StrCat("'", value, "'");
  return absl::StrCat("a string of ", value.size(), " characters");
}

// The JobSpec fields TrainConfig does not hold.
absl::Status ValidateJobFields(const v1::JobSpec& spec) {
  if (spec.name().size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: got ", Shown(spec.name()), "; at most ",
                     kMaxNameLength, " characters"));
  }
  if (HasControlCharacter(spec.name())) {
    return absl::InvalidArgumentError(
        "name: contains a control character (newline, tab, escape, ...); "
        "names are shown in logs and tables");
  }
  if (spec.labels_size() > static_cast<int>(kMaxLabels)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "labels: got ", spec.labels_size(), "; at most ", kMaxLabels));
  }
  for (const auto& [key, value] : spec.labels()) {
    if (!IsLabelKey(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels: key ", Shown(key), " must be 1-",
                       kMaxLabelKeyLength, " characters of [A-Za-z0-9_.-/]"));
    }
    if (HasControlCharacter(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", key,
                       "]: contains a control character (newline, tab, "
                       "escape, ...)"));
    }
    if (value.size() > kMaxLabelValueLength) {
      return absl::InvalidArgumentError(
          absl::StrCat("labels[", key, "]: got ", Shown(value), "; at most ",
                       kMaxLabelValueLength, " characters"));
    }
  }
  if (spec.priority() < -kMaxPriority || spec.priority() > kMaxPriority) {
    return absl::InvalidArgumentError(
        absl::StrCat("priority: got ", spec.priority(), "; must be in [",
                     -kMaxPriority, ", ", kMaxPriority, "]"));
  }
  if (spec.model().size() > kMaxModelLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: got ", Shown(spec.model()), "; at most ",
                     kMaxModelLength, " characters"));
  }
  if (spec.data().size() > kMaxPathLength ||
      spec.trainer().init_from().size() > kMaxPathLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.data().size() > kMaxPathLength ? "data" : "trainer.init_from",
        ": path longer than ", kMaxPathLength, " characters"));
  }
  if (spec.strategy().name().size() > kMaxModelLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy.name: got ", Shown(spec.strategy().name()),
                     "; expected one of ", StrategyNameList()));
  }
  if (spec.device_kind() != v1::DEVICE_KIND_UNSPECIFIED &&
      !v1::DeviceKind_IsValid(spec.device_kind())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_kind: got ", spec.device_kind(), "; expected CPU or GPU"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainConfig> TrainConfigFromJobSpec(const v1::JobSpec& spec,
                                                   const std::string& out_dir) {
  if (absl::Status s = ValidateJobFields(spec); !s.ok()) return s;
  TrainConfig c;
  c.out = out_dir;
  c.model = spec.model();
  c.data = spec.data();
  if (!spec.strategy().name().empty()) c.strategy = spec.strategy().name();
  const v1::StrategyOptions& s = spec.strategy();
  if (s.has_bucket_mb()) c.bucket_mb = s.bucket_mb();
  if (s.has_reshard_after_forward())
    c.reshard_after_forward = s.reshard_after_forward();
  if (s.has_prefetch()) c.prefetch = s.prefetch();
  if (s.has_fsdp_no_sync()) c.fsdp_no_sync = s.fsdp_no_sync();
  if (s.has_comm_timeout_seconds()) c.comm_timeout = s.comm_timeout_seconds();
  if (s.has_shard_group_size()) c.shard_group_size = s.shard_group_size();
  if (s.has_activation_checkpointing()) {
    c.activation_checkpointing = s.activation_checkpointing();
  }
  if (s.has_pipeline_stages()) c.pipeline_stages = s.pipeline_stages();
  if (s.has_pipeline_split()) c.pipeline_split = s.pipeline_split();
  if (s.has_micro_batches()) c.micro_batches = s.micro_batches();
  if (s.has_pipeline_schedule()) c.pipeline_schedule = s.pipeline_schedule();
  if (s.has_virtual_stages()) c.virtual_stages = s.virtual_stages();
  if (s.has_tensor_parallel()) c.tensor_parallel = s.tensor_parallel();

  const v1::TrainerOptions& t = spec.trainer();
  if (t.has_batch_size()) c.batch_size = t.batch_size();
  if (t.has_seq_len()) c.seq_len = t.seq_len();
  if (t.has_grad_accum()) c.grad_accum = t.grad_accum();
  if (t.has_max_steps()) c.max_steps = t.max_steps();
  if (t.has_epochs()) c.epochs = t.epochs();
  if (t.has_lr()) c.lr = t.lr();
  if (t.has_min_lr_ratio()) c.min_lr_ratio = t.min_lr_ratio();
  if (t.has_warmup_steps()) c.warmup_steps = t.warmup_steps();
  if (t.has_weight_decay()) c.weight_decay = t.weight_decay();
  if (t.has_beta1()) c.beta1 = t.beta1();
  if (t.has_beta2()) c.beta2 = t.beta2();
  if (t.has_eps()) c.eps = t.eps();
  if (t.has_grad_clip()) c.grad_clip = t.grad_clip();
  if (t.has_seed()) c.seed = t.seed();
  if (t.has_precision()) c.precision = t.precision();
  if (t.has_eval_every()) c.eval_every = t.eval_every();
  if (t.has_eval_steps()) c.eval_steps = t.eval_steps();
  if (t.has_checkpoint_every()) c.checkpoint_every = t.checkpoint_every();
  if (t.has_shuffle()) c.shuffle = t.shuffle();
  if (t.has_peak_flops()) c.peak_flops = t.peak_flops();
  if (t.has_init_from()) c.init_from = t.init_from();
  if (t.has_memory_cap_bytes()) c.memory_cap = t.memory_cap_bytes();
  c.device = spec.device_kind() == v1::GPU ? "cuda" : "cpu";

  if (spec.world_size() < 1 || spec.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: got ", spec.world_size(), "; must be in [1, ",
                     kMaxWorldSize, "]"));
  }
  if (spec.max_restarts() < 0 || spec.max_restarts() > kMaxRestarts) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_restarts: got ", spec.max_restarts(),
                     "; must be in [0, ", kMaxRestarts, "]"));
  }
  const int32_t min_world = spec.elastic().min_world_size();
  if (min_world < 0 || min_world > spec.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "elastic.min_world_size: got ", min_world, "; must be in [0, ",
        spec.world_size(), "] (0: not elastic; else at most world_size)"));
  }
  if (spec.trainer().threads_as_ranks() < 0 ||
      spec.trainer().threads_as_ranks() > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trainer.threads_as_ranks: got ", spec.trainer().threads_as_ranks(),
        "; must be in [0, ", kMaxWorldSize, "] (0: the job's world_size)"));
  }
  if (min_world > 0 && c.checkpoint_every <= 0) {
    return absl::InvalidArgumentError(
        "elastic.min_world_size: an elastic job continues from its latest "
        "checkpoint; set trainer.checkpoint_every (--checkpoint-every)");
  }
  if (c.strategy == kAutoStrategy) {
    // The coordinator picks the mesh when the job starts (the ranks it then
    // has, this host's measured rates): the rest must hold whatever it
    // picks. An elastic one is picked for anew at each world size (the
    // checkpoints load at any mesh).
    TrainConfig probe = c;
    probe.strategy = "single";
    if (absl::Status status = probe.Validate(); !status.ok()) return status;
    // Nothing that fits the memory cap: refused now, not at the start.
    if (c.memory_cap > 0) {
      if (absl::Status status = CheckAutoCanFit(c, spec.world_size());
          !status.ok()) {
        return status;
      }
    }
    return c;
  }
  // The world the mesh needs (one rank for a strategy that is not
  // distributed), after Validate has checked the mesh's own fields.
  if (absl::Status status = c.Validate(); !status.ok()) return status;
  if (absl::Status status = c.CheckMeshWorld(spec.world_size()); !status.ok()) {
    return status;
  }
  const StrategyKind* kind = FindStrategyKind(c.strategy);
  if (kind != nullptr && kind->layout == StateLayout::kShardedInGroups &&
      c.shard_group_size > 0 && spec.world_size() % c.shard_group_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy.shard_group_size: got ", c.shard_group_size,
                     "; must divide world_size (", spec.world_size(), ")"));
  }
  return c;
}

v1::JobSpec JobSpecFromTrainConfig(const TrainConfig& c, int world_size) {
  v1::JobSpec spec;
  spec.set_model(c.model);
  spec.set_data(c.data);
  spec.set_world_size(world_size);
  spec.set_device_kind(c.device == "cpu" ? v1::CPU : v1::GPU);
  v1::StrategyOptions* s = spec.mutable_strategy();
  s->set_name(c.strategy);
  s->set_bucket_mb(c.bucket_mb);
  s->set_reshard_after_forward(c.reshard_after_forward);
  s->set_prefetch(c.prefetch);
  s->set_fsdp_no_sync(c.fsdp_no_sync);
  s->set_comm_timeout_seconds(c.comm_timeout);
  s->set_shard_group_size(c.shard_group_size);
  s->set_activation_checkpointing(c.activation_checkpointing);
  s->set_pipeline_stages(c.pipeline_stages);
  s->set_pipeline_split(c.pipeline_split);
  s->set_micro_batches(c.micro_batches);
  s->set_pipeline_schedule(c.pipeline_schedule);
  s->set_virtual_stages(c.virtual_stages);
  s->set_tensor_parallel(c.tensor_parallel);
  v1::TrainerOptions* t = spec.mutable_trainer();
  t->set_batch_size(c.batch_size);
  t->set_seq_len(c.seq_len);
  t->set_grad_accum(c.grad_accum);
  t->set_max_steps(c.max_steps);
  t->set_epochs(c.epochs);
  t->set_lr(c.lr);
  t->set_min_lr_ratio(c.min_lr_ratio);
  t->set_warmup_steps(c.warmup_steps);
  t->set_weight_decay(c.weight_decay);
  t->set_beta1(c.beta1);
  t->set_beta2(c.beta2);
  t->set_eps(c.eps);
  t->set_grad_clip(c.grad_clip);
  t->set_seed(c.seed);
  t->set_precision(c.precision);
  t->set_eval_every(c.eval_every);
  t->set_eval_steps(c.eval_steps);
  t->set_checkpoint_every(c.checkpoint_every);
  t->set_shuffle(c.shuffle);
  t->set_peak_flops(c.peak_flops);
  if (!c.init_from.empty()) t->set_init_from(c.init_from);
  if (c.memory_cap > 0) t->set_memory_cap_bytes(c.memory_cap);
  return spec;
}

namespace {

using google::protobuf::FieldDescriptor;

// v1::StepMetrics's field for each StepField, in StepFields() order, found
// once by name; nullptr where the message has none of the same kind (an
// integer or a double). step_fields_test requires every one.
const std::vector<const FieldDescriptor*>& StepProtoFields() {
  static const std::vector<const FieldDescriptor*> fields = [] {
    std::vector<const FieldDescriptor*> found;
    for (const StepField& f : StepFields()) {
      const FieldDescriptor* field =
          v1::StepMetrics::descriptor()->FindFieldByName(f.name);
      const bool integer =
          field != nullptr &&
          (field->cpp_type() == FieldDescriptor::CPPTYPE_INT32 ||
           field->cpp_type() == FieldDescriptor::CPPTYPE_INT64);
      const bool same_kind =
          field != nullptr &&
          (f.is_integer()
               ? integer
               : field->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE);
      found.push_back(same_kind ? field : nullptr);
    }
    return found;
  }();
  return fields;
}

}  // namespace

v1::StepMetrics StepMetricsToProto(const StepMetrics& m) {
  v1::StepMetrics p;
  const google::protobuf::Reflection* r = p.GetReflection();
  const std::vector<StepField>& fields = StepFields();
  for (size_t i = 0; i < fields.size(); ++i) {
    const StepField& f = fields[i];
    const FieldDescriptor* field = StepProtoFields()[i];
    if (field == nullptr || !f.PresentIn(m)) continue;
    if (!f.is_integer()) {
      r->SetDouble(&p, field, m.*f.double_member);
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
      r->SetInt32(&p, field, static_cast<int32_t>(m.*f.int_member));
    } else {
      r->SetInt64(&p, field, m.*f.int_member);
    }
  }
  return p;
}

StepMetrics StepMetricsFromProto(const v1::StepMetrics& p) {
  StepMetrics m;
  const google::protobuf::Reflection* r = p.GetReflection();
  const std::vector<StepField>& fields = StepFields();
  for (size_t i = 0; i < fields.size(); ++i) {
    const StepField& f = fields[i];
    const FieldDescriptor* field = StepProtoFields()[i];
    // An absent optional field keeps its `initial` (below 0).
    if (field == nullptr || (field->has_presence() && !r->HasField(p, field))) {
      continue;
    }
    if (!f.is_integer()) {
      m.*f.double_member = r->GetDouble(p, field);
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
      m.*f.int_member = r->GetInt32(p, field);
    } else {
      m.*f.int_member = r->GetInt64(p, field);
    }
  }
  return m;
}

std::string JobMesh(const v1::Job& job) {
  return job.mesh().empty() ? JobMeshName(job.spec(), job.world_size())
                            : job.mesh();
}

std::string JobMeshName(const v1::JobSpec& spec, int64_t world_size) {
  if (spec.strategy().name() == kAutoStrategy) {
    const auto chosen = spec.labels().find("auto_mesh");
    return chosen == spec.labels().end()
               ? std::string(kAutoStrategy)
               : absl::StrCat(kAutoStrategy, ": ", chosen->second);
  }
  TrainConfig c;
  c.strategy = spec.strategy().name();
  c.pipeline_stages = std::max<int64_t>(1, spec.strategy().pipeline_stages());
  c.tensor_parallel = std::max<int64_t>(1, spec.strategy().tensor_parallel());
  return MeshName(c, world_size > 0 ? world_size : spec.world_size());
}

}  // namespace shardtrain
