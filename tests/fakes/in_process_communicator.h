// InProcessCommunicator: a Communicator for N threads of one process, one per
// rank, so strategies can be tested without sockets. Collectives complete
// synchronously inside the call (every rank must issue the same collectives
// in the same order, as with c10d); Wait() then returns OK. A rank that does
// not arrive within `timeout` makes the others fail with DeadlineExceeded.
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

class InProcessGroup {
 public:
  explicit InProcessGroup(
      int64_t world_size,
      std::chrono::milliseconds timeout = std::chrono::seconds(60));
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

 private:
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
};

// Runs fn(rank, communicator) on world_size threads and joins them.
void RunRanks(int64_t world_size,
              const std::function<void(int64_t, Communicator&)>& fn);

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_IN_PROCESS_COMMUNICATOR_H_
