// FakeBackendKind: a third backend, registered by a test the way a real one
// is (server/backend.h): its own flag (--fake-slots), its own validation,
// slots, a FakeAttemptLauncher that starts nothing, and a cluster view with one
// node in one pool. The coordinator, JobManager, proto and CLI know nothing
// of it.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_BACKEND_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "server/backend.h"
#include "tests/fakes/fake_attempt_launcher.h"

namespace shardtrain {

class FakeBackend : public Backend {
 public:
  explicit FakeBackend(int slots) {
    for (int i = 0; i < slots; ++i) {
      devices_.push_back({i, v1::CPU, "fake slot", 0});
    }
  }
  const std::vector<DeviceInfo>& devices() const override { return devices_; }
  AttemptLauncher& launcher() override { return launcher_; }
  void DescribeCluster(v1::Cluster* cluster) override {
    cluster->set_node_group_kind("pool");
    cluster->set_backend_note("ranks run nowhere; the test says how they end");
    v1::ClusterNode* node = cluster->add_nodes();
    node->set_name("fake-node-0");
    node->set_state("UP");
    node->set_cpus(static_cast<int>(devices_.size()));
    node->add_groups("fake-pool");
    v1::NodeGroup* group = cluster->add_node_groups();
    group->set_name("fake-pool");
    group->set_total_nodes(1);
    group->set_is_default(true);
  }

  FakeAttemptLauncher& fake() { return launcher_; }

 private:
  std::vector<DeviceInfo> devices_;
  FakeAttemptLauncher launcher_;
};

class FakeBackendKind : public BackendKind {
 public:
  std::string name() const override { return "fake"; }
  std::string summary() const override { return "ranks a test drives"; }
  void AddFlags(CLI::App& app) override {
    app.add_option("--fake-slots", slots_, "slots the fake backend offers");
  }
  absl::Status Validate(const BackendContext&) const override {
    if (slots_ < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--fake-slots: must be >= 1, got ", slots_));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Backend>> Create(
      const BackendContext&) override {
    auto backend = std::make_unique<FakeBackend>(slots_);
    created_ = backend.get();
    return backend;
  }

  int slots() const { return slots_; }
  // The backend the last Create made (owned by the coordinator).
  FakeBackend* created() const { return created_; }

 private:
  int slots_ = 2;
  FakeBackend* created_ = nullptr;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_BACKEND_H_
