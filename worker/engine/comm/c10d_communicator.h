// C10dCommunicator: the Communicator over PyTorch's c10d.
//
// Rendezvous goes through a c10d TCPStore hosted by rank 0 at
// MASTER_ADDR:MASTER_PORT. CPU tensors travel over ProcessGroupGloo; CUDA
// tensors over ProcessGroupNCCL (builds with SHARDTRAIN_WITH_CUDA only).
// Gloo in LibTorch 1.13 has no reduce_scatter and no flat all_gather, so the
// Gloo path emulates them: reduce_scatter as a ring of sends and receives,
// all_gather as the list form writing into views of the flat output.
//
// Every rank also runs a HeartbeatMonitor on its own store connection, so a
// failed collective names the rank(s) that were lost:
//   "all_reduce failed on rank 0: rank 1 lost (no heartbeat for 3.1 s): ..."
// The c10d headers stay inside the .cc; includers need only LibTorch.
#ifndef SHARDTRAIN_WORKER_ENGINE_COMM_C10D_COMMUNICATOR_H_
#define SHARDTRAIN_WORKER_ENGINE_COMM_C10D_COMMUNICATOR_H_

#include <torch/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dist_env.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/comm/heartbeat_monitor.h"

namespace shardtrain {
namespace c10d_internal {
struct Shared;     // what works need after the call: stats, diagnosis
class Groups;      // the c10d store and process groups
class SideThread;  // runs the Gloo reduce_scatter rings in issue order
}  // namespace c10d_internal

struct C10dOptions {
  // How long Create() waits for all ranks to arrive; 0: the collective
  // timeout.
  std::chrono::milliseconds rendezvous_timeout{0};
  HeartbeatOptions heartbeat;
};

class C10dCommunicator final : public Communicator {
 public:
  // Joins the group described by `env`: rank 0 hosts the store and every
  // rank waits for all world_size ranks to arrive (DeadlineExceeded naming
  // the address and how many arrived otherwise). `timeout` bounds every
  // collective. `device` is where this rank's tensors live: a CUDA device
  // adds an NCCL group for CUDA tensors; CPU tensors always use Gloo.
  //
  // Ignores SIGPIPE for the whole process (as Python does for PyTorch):
  // Gloo writes to sockets whose peer may be gone and handles the error.
  static absl::StatusOr<std::unique_ptr<C10dCommunicator>> Create(
      const DistEnv& env, std::chrono::milliseconds timeout,
      torch::Device device, C10dOptions options = {});

  // Finishes queued emulated collectives, then leaves the group. Rank 0,
  // which hosts the store, waits (at most `timeout`) until the other ranks
  // have left or stopped heartbeating before closing it. Works returned by
  // this communicator must not be waited on afterwards.
  ~C10dCommunicator() override;
  C10dCommunicator(const C10dCommunicator&) = delete;
  C10dCommunicator& operator=(const C10dCommunicator&) = delete;

  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_size_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  std::unique_ptr<CommWork> AllReduce(torch::Tensor& tensor) override;
  // `output` may be the rank()-th chunk of `input` (in place).
  std::unique_ptr<CommWork> ReduceScatter(torch::Tensor& output,
                                          const torch::Tensor& input) override;
  std::unique_ptr<CommWork> AllGather(torch::Tensor& output,
                                      const torch::Tensor& input) override;
  std::unique_ptr<CommWork> Broadcast(torch::Tensor& tensor,
                                      int64_t root) override;
  absl::Status Barrier() override;
  // Gloo (CPU) or NCCL (CUDA) send/recv; the tensor must be dense.
  std::unique_ptr<CommWork> Send(const torch::Tensor& tensor, int64_t dst,
                                 int64_t tag) override;
  std::unique_ptr<CommWork> Recv(torch::Tensor& tensor, int64_t src,
                                 int64_t tag) override;

  CommStats TakeStats() override;

  // A Gloo group (and an NCCL group when this one has one) over `members`,
  // rendezvousing through this group's store; failures in it are diagnosed
  // with this group's heartbeat (naming ranks of this group).
  absl::StatusOr<std::unique_ptr<Communicator>> NewGroup(
      const std::string& tag, const std::vector<int64_t>& members) override;

 private:
  // `root_rank`: this process's rank in the group Create() joined, which
  // error messages name.
  C10dCommunicator(int64_t rank, int64_t world_size,
                   std::chrono::milliseconds timeout,
                   HeartbeatOptions heartbeat, int64_t root_rank,
                   bool sub_group);

  // Rank r sets this store key when it has closed everything but its main
  // store connection.
  static std::string DepartureKey(int64_t rank);
  // Rank 0, before closing the store: waits until every other rank has left
  // or stopped heartbeating, at most `timeout`.
  void AwaitDepartures();

  const int64_t rank_;
  const int64_t world_size_;
  const std::chrono::milliseconds timeout_;
  const HeartbeatOptions heartbeat_;
  const bool sub_group_;  // made by NewGroup(): owns no store, no heartbeat
  // Members in dependency order; destruction runs bottom-up.
  std::shared_ptr<c10d_internal::Shared> shared_;
  std::unique_ptr<c10d_internal::Groups> groups_;
  std::unique_ptr<c10d_internal::SideThread> side_thread_;
  std::atomic<int64_t> ring_count_{0};  // tags the rings' sends and receives
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_COMM_C10D_COMMUNICATOR_H_
