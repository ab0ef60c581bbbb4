// InProcessCommunicator: a Communicator for N threads of one process, one per
// rank, so strategies can be tested without sockets. Collectives complete
// synchronously inside the call (every rank must issue the same collectives
// in the same order, as with c10d); Wait() then returns OK. A rank that does
// not arrive within `timeout` makes the others fail with DeadlineExceeded.
//
// Point-to-point has two behaviours:
//   - kBuffered (Gloo's, in effect): a send never waits (its tensor goes to
//     a mailbox per source, destination and tag); a receive takes the
//     oldest one there with its tag.
//   - kNcclOrder (NCCL's): tags are ignored; each pair of ranks runs its
//     transfers in the order each end posted them, one at a time, and a
//     send completes only when the other end's matching receive is posted
//     (no buffering), reading the send's tensor then, not when it was
//     posted: a sender that changes its buffer before the transfer is
//     matched sends what it changed. Two ends whose next transfers are both
//     sends (or both receives) never complete: Wait() times out, as NCCL
//     hangs. Both buffers must stay alive until they are waited for.
#ifndef SHARDTRAIN_TESTS_FAKES_IN_PROCESS_COMMUNICATOR_H_
#define SHARDTRAIN_TESTS_FAKES_IN_PROCESS_COMMUNICATOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "worker/engine/comm/communicator.h"

namespace shardtrain {

enum class PointToPoint { kBuffered, kNcclOrder };

class InProcessGroup {
 public:
  explicit InProcessGroup(
      int64_t world_size,
      std::chrono::milliseconds timeout = std::chrono::seconds(60),
      PointToPoint p2p = PointToPoint::kBuffered);
  // The communicator of `rank`; the group must outlive it.
  std::unique_ptr<Communicator> ForRank(int64_t rank);

  // The group named `key` of `size` ranks, created on first use; for
  // NewGroup(). Owned by this group.
  InProcessGroup* SubGroup(const std::string& key, int64_t size);

  int64_t world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Every rank deposits `contribution`; once all have, `combine` runs once on
  // the last arriving rank with all contributions (index = rank), and every
  // rank then reads the combined results. Returns false on timeout.
  bool Exchange(int64_t rank, torch::Tensor contribution,
                const std::function<std::vector<torch::Tensor>(
                    const std::vector<torch::Tensor>&)>& combine,
                std::vector<torch::Tensor>* results);

  // Point-to-point: Post leaves a copy of `tensor` for (src -> dst, tag) at
  // once (a send never waits); Take waits for the oldest one posted there.
  // Returns false on timeout.
  void Post(int64_t src, int64_t dst, int64_t tag, torch::Tensor tensor);
  bool Take(int64_t src, int64_t dst, int64_t tag, torch::Tensor* tensor);

  PointToPoint p2p() const { return p2p_; }
  // kNcclOrder: a transfer posted by `rank` toward `peer` (a send carries
  // the caller's tensor, read on matching; a receive the caller's buffer,
  // filled on matching).
  struct OrderedTransfer {
    bool send = false;
    torch::Tensor tensor;
    bool done = false;
    std::string error;
  };
  std::shared_ptr<OrderedTransfer> PostOrdered(int64_t rank, int64_t peer,
                                               bool send, torch::Tensor tensor);
  // Waits until `transfer` completed; false on timeout.
  bool WaitOrdered(const std::shared_ptr<OrderedTransfer>& transfer);

 private:
  // Matches the heads of the pair's two queues while they face each other
  // as a send and a receive. Under mutex_.
  void ProgressPair(int64_t a, int64_t b);

  const int64_t world_size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t generation_ = 0;
  int64_t arrived_ = 0;
  std::vector<torch::Tensor> contributions_;
  std::vector<torch::Tensor> results_;
  std::map<std::string, std::unique_ptr<InProcessGroup>> sub_groups_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::deque<torch::Tensor>>
      mailboxes_;
  const PointToPoint p2p_;
  // kNcclOrder: (rank, peer) -> what rank posted toward peer, not yet done.
  std::map<std::pair<int64_t, int64_t>,
           std::deque<std::shared_ptr<OrderedTransfer>>>
      ordered_;
};

// Runs fn(rank, communicator) on world_size threads and joins them.
void RunRanks(int64_t world_size,
              const std::function<void(int64_t, Communicator&)>& fn,
              PointToPoint p2p = PointToPoint::kBuffered,
              std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_IN_PROCESS_COMMUNICATOR_H_
