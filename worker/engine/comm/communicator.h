// Communicator: the collectives the distributed strategies use, in the shape
// of c10d's Backend. Every collective is asynchronous and returns a CommWork
// handle; Wait() blocks until it completes or the communicator's timeout
// passes, so a lost or stuck rank becomes an error, never a silent hang.
//
// Tensors must be contiguous and stay alive (and unmodified, for inputs) until
// the work completes. Sums only: strategies divide by world_size themselves.
#ifndef SHARDTRAIN_WORKER_ENGINE_COMM_COMMUNICATOR_H_
#define SHARDTRAIN_WORKER_ENGINE_COMM_COMMUNICATOR_H_

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

class CommWork {
 public:
  virtual ~CommWork() = default;
  // Blocks until the collective has completed. DeadlineExceeded after the
  // communicator's timeout; Unavailable when a peer is gone. The message names
  // the collective and, where known, the rank that was lost.
  virtual absl::Status Wait() = 0;
  virtual bool IsCompleted() = 0;
};

// A work settled when it was issued (bad arguments, a world of one, a fake
// collective done at once): Wait() returns `status` without blocking.
std::unique_ptr<CommWork> CompletedWork(absl::Status status);

// Communication measured since the last TakeStats(): seconds the caller spent
// blocked in Wait()/Barrier(), and bytes this rank contributed.
struct CommStats {
  double seconds = 0;
  int64_t bytes = 0;
  // Of `bytes`, those sent in a strategy's replica group: HSDP's traffic
  // between shard groups (usually between nodes). A communicator's own
  // TakeStats() leaves it 0; the strategy that owns the groups fills it.
  int64_t inter_group_bytes = 0;
  // Of `bytes`, those sent within a tensor-parallel group (Megatron's
  // activation all-reduces), filled by the strategy that owns the group.
  int64_t tensor_parallel_bytes = 0;
  // A pipeline stage's point-to-point traffic, filled by the strategy: the
  // bytes it sent its neighbours and the seconds it waited on them.
  int64_t p2p_bytes = 0;
  double pipeline_bubble_seconds = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  // tensor = sum over ranks of tensor, in place.
  virtual std::unique_ptr<CommWork> AllReduce(torch::Tensor& tensor) = 0;
  // input has world_size * output.numel() elements; output = sum over ranks
  // of the rank()-th chunk of input.
  virtual std::unique_ptr<CommWork> ReduceScatter(
      torch::Tensor& output, const torch::Tensor& input) = 0;
  // output has world_size * input.numel() elements; chunk r of output is rank
  // r's input.
  virtual std::unique_ptr<CommWork> AllGather(torch::Tensor& output,
                                              const torch::Tensor& input) = 0;
  // tensor = root's tensor, in place.
  virtual std::unique_ptr<CommWork> Broadcast(torch::Tensor& tensor,
                                              int64_t root) = 0;
  virtual absl::Status Barrier() = 0;

  // Point-to-point, as c10d's isend/irecv: `tensor` to rank `dst`, or into
  // `tensor` from rank `src`, of this group. A send and a receive match by
  // (sender, receiver, tag), in the order each side issues them. A send may
  // complete before its receive is posted (never wait on one before the
  // receive that matches it can be issued); `tensor` must stay alive and
  // unchanged until the send's Wait returns. Shape, dtype and device must
  // match on both sides. The default: Unimplemented.
  virtual std::unique_ptr<CommWork> Send(const torch::Tensor& tensor,
                                         int64_t dst, int64_t tag);
  virtual std::unique_ptr<CommWork> Recv(torch::Tensor& tensor, int64_t src,
                                         int64_t tag);

  virtual CommStats TakeStats() = 0;

  // A communicator over a subset of this group's ranks, as c10d's new_group:
  // `members` are ranks of this group, ascending, this rank among them; in
  // the new group a rank is its position in `members`. Every member calls it
  // with the same `tag` and `members` (the tag tells groups apart, so two
  // groups with the same members are distinct); ranks outside do not call.
  // The new group has its own CommStats and must not outlive this one.
  // Collective over the members.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> NewGroup(
      const std::string& tag, const std::vector<int64_t>& members);
};

// The checks every NewGroup() makes: members ascending, in [0, world_size),
// `rank` among them. Returns rank's position in `members`.
absl::StatusOr<int64_t> PositionInGroup(const std::vector<int64_t>& members,
                                        int64_t rank, int64_t world_size);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_COMM_COMMUNICATOR_H_
