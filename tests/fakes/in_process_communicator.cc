#include "tests/fakes/in_process_communicator.h"

#include <torch/torch.h>

#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

std::vector<torch::Tensor> SumOverRanks(const std::vector<torch::Tensor>& all) {
  torch::Tensor sum = all[0].clone();
  for (size_t r = 1; r < all.size(); ++r) sum.add_(all[r]);
  return {sum};
}

// A transfer under kNcclOrder, completed when the other end matches it.
class OrderedWork final : public CommWork {
 public:
  OrderedWork(InProcessGroup* group,
              std::shared_ptr<InProcessGroup::OrderedTransfer> transfer,
              std::string what)
      : group_(group), transfer_(std::move(transfer)), what_(std::move(what)) {}
  absl::Status Wait() override {
    if (!group_->WaitOrdered(transfer_)) {
      return absl::DeadlineExceededError(
          absl::StrCat(what_,
                       " timed out: the other end never posted its match (NCCL "
                       "pairs a pair's transfers in posting order)"));
    }
    if (!transfer_->error.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": ", transfer_->error));
    }
    return absl::OkStatus();
  }
  bool IsCompleted() override { return transfer_->done; }

 private:
  InProcessGroup* const group_;
  const std::shared_ptr<InProcessGroup::OrderedTransfer> transfer_;
  const std::string what_;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup* group, int64_t rank)
      : group_(group), rank_(rank) {}

  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return group_->world_size(); }
  std::chrono::milliseconds timeout() const override {
    return group_->timeout();
  }

  std::unique_ptr<CommWork> AllReduce(torch::Tensor& tensor) override {
    stats_.bytes += tensor.nbytes();
    std::vector<torch::Tensor> out;
    if (!Exchange(tensor, SumOverRanks, &out)) {
      return Timeout("all_reduce");
    }
    tensor.copy_(out[0]);
    return Ok();
  }

  std::unique_ptr<CommWork> ReduceScatter(torch::Tensor& output,
                                          const torch::Tensor& input) override {
    stats_.bytes += input.nbytes();
    std::vector<torch::Tensor> out;
    if (!Exchange(input, SumOverRanks, &out)) {
      return Timeout("reduce_scatter");
    }
    const int64_t n = output.numel();
    output.copy_(out[0].view({-1}).narrow(0, rank_ * n, n).view_as(output));
    return Ok();
  }

  std::unique_ptr<CommWork> Send(const torch::Tensor& tensor, int64_t dst,
                                 int64_t tag) override {
    stats_.bytes += tensor.nbytes();
    if (group_->p2p() == PointToPoint::kNcclOrder) {
      // The sender's own memory, read when the receive matches it (as NCCL
      // reads it while the transfer runs): a buffer changed before then is
      // received changed, and the numbers say so.
      return std::make_unique<OrderedWork>(
          group_,
          group_->PostOrdered(rank_, dst, /*send=*/true, tensor.detach()),
          absl::StrCat("send to ", dst, " on rank ", rank_));
    }
    group_->Post(rank_, dst, tag, tensor.detach().clone());
    return Ok();
  }

  std::unique_ptr<CommWork> Recv(torch::Tensor& tensor, int64_t src,
                                 int64_t tag) override {
    if (group_->p2p() == PointToPoint::kNcclOrder) {
      return std::make_unique<OrderedWork>(
          group_, group_->PostOrdered(rank_, src, /*send=*/false, tensor),
          absl::StrCat("recv from ", src, " on rank ", rank_));
    }
    torch::Tensor received;
    if (!group_->Take(src, rank_, tag, &received)) return Timeout("recv");
    if (received.sizes() != tensor.sizes() ||
        received.dtype() != tensor.dtype()) {
      return CompletedWork(absl::InvalidArgumentError(
          "recv: the tensor sent has another shape or dtype"));
    }
    tensor.copy_(received);
    return Ok();
  }

  std::unique_ptr<CommWork> AllGather(torch::Tensor& output,
                                      const torch::Tensor& input) override {
    stats_.bytes += input.nbytes();
    std::vector<torch::Tensor> out;
    if (!Exchange(
            input,
            [](const std::vector<torch::Tensor>& all) {
              std::vector<torch::Tensor> flat;
              for (const auto& t : all) flat.push_back(t.reshape({-1}));
              return std::vector<torch::Tensor>{torch::cat(flat)};
            },
            &out)) {
      return Timeout("all_gather");
    }
    output.copy_(out[0].view_as(output));
    return Ok();
  }

  std::unique_ptr<CommWork> Broadcast(torch::Tensor& tensor,
                                      int64_t root) override {
    stats_.bytes += tensor.nbytes();
    std::vector<torch::Tensor> out;
    if (!Exchange(
            tensor,
            [root](const std::vector<torch::Tensor>& all) {
              return std::vector<torch::Tensor>{all[root].clone()};
            },
            &out)) {
      return Timeout("broadcast");
    }
    tensor.copy_(out[0]);
    return Ok();
  }

  absl::Status Barrier() override {
    std::vector<torch::Tensor> out;
    if (!Exchange(
            torch::zeros({1}),
            [](const std::vector<torch::Tensor>&) {
              return std::vector<torch::Tensor>{};
            },
            &out)) {
      return absl::DeadlineExceededError("barrier timed out");
    }
    return absl::OkStatus();
  }

  CommStats TakeStats() override {
    CommStats stats = stats_;
    stats_ = {};
    return stats;
  }

  absl::StatusOr<std::unique_ptr<Communicator>> NewGroup(
      const std::string& tag, const std::vector<int64_t>& members) override {
    absl::StatusOr<int64_t> position =
        PositionInGroup(members, rank_, world_size());
    if (!position.ok()) return position.status();
    InProcessGroup* sub =
        group_->SubGroup(absl::StrCat(tag, "/", absl::StrJoin(members, ",")),
                         static_cast<int64_t>(members.size()));
    return sub->ForRank(*position);
  }

 private:
  bool Exchange(const torch::Tensor& contribution,
                const std::function<std::vector<torch::Tensor>(
                    const std::vector<torch::Tensor>&)>& combine,
                std::vector<torch::Tensor>* results) {
    return group_->Exchange(rank_, contribution.detach().clone(), combine,
                            results);
  }
  std::unique_ptr<CommWork> Ok() { return CompletedWork(absl::OkStatus()); }
  std::unique_ptr<CommWork> Timeout(const char* op) {
    return CompletedWork(absl::DeadlineExceededError(
        absl::StrCat(op, " on rank ", rank_, " timed out waiting for peers")));
  }

  InProcessGroup* group_;
  int64_t rank_;
  CommStats stats_;
};

}  // namespace

InProcessGroup::InProcessGroup(int64_t world_size,
                               std::chrono::milliseconds timeout,
                               PointToPoint p2p)
    : world_size_(world_size),
      timeout_(timeout),
      contributions_(world_size),
      p2p_(p2p) {}

std::shared_ptr<InProcessGroup::OrderedTransfer> InProcessGroup::PostOrdered(
    int64_t rank, int64_t peer, bool send, torch::Tensor tensor) {
  auto transfer = std::make_shared<OrderedTransfer>();
  transfer->send = send;
  transfer->tensor = std::move(tensor);
  std::lock_guard<std::mutex> lock(mutex_);
  ordered_[{rank, peer}].push_back(transfer);
  ProgressPair(rank, peer);
  cv_.notify_all();
  return transfer;
}

void InProcessGroup::ProgressPair(int64_t a, int64_t b) {
  auto& mine = ordered_[{a, b}];
  auto& theirs = ordered_[{b, a}];
  while (!mine.empty() && !theirs.empty() &&
         mine.front()->send != theirs.front()->send) {
    OrderedTransfer& send =
        mine.front()->send ? *mine.front() : *theirs.front();
    OrderedTransfer& recv =
        mine.front()->send ? *theirs.front() : *mine.front();
    if (send.tensor.sizes() != recv.tensor.sizes() ||
        send.tensor.dtype() != recv.tensor.dtype()) {
      send.error = recv.error =
          "the tensors matched by order differ in shape or dtype";
    } else {
      recv.tensor.copy_(send.tensor);
    }
    send.done = recv.done = true;
    mine.pop_front();
    theirs.pop_front();
  }
}

bool InProcessGroup::WaitOrdered(
    const std::shared_ptr<OrderedTransfer>& transfer) {
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, timeout_, [&] { return transfer->done; });
}

std::unique_ptr<Communicator> InProcessGroup::ForRank(int64_t rank) {
  return std::make_unique<InProcessCommunicator>(this, rank);
}

InProcessGroup* InProcessGroup::SubGroup(const std::string& key, int64_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::unique_ptr<InProcessGroup>& sub = sub_groups_[key];
  if (sub == nullptr) {
    sub = std::make_unique<InProcessGroup>(size, timeout_, p2p_);
  }
  return sub.get();
}

void InProcessGroup::Post(int64_t src, int64_t dst, int64_t tag,
                          torch::Tensor tensor) {
  std::lock_guard<std::mutex> lock(mutex_);
  mailboxes_[{src, dst, tag}].push_back(std::move(tensor));
  cv_.notify_all();
}

bool InProcessGroup::Take(int64_t src, int64_t dst, int64_t tag,
                          torch::Tensor* tensor) {
  std::unique_lock<std::mutex> lock(mutex_);
  std::deque<torch::Tensor>& box = mailboxes_[{src, dst, tag}];
  if (!cv_.wait_for(lock, timeout_, [&] { return !box.empty(); })) {
    return false;
  }
  *tensor = std::move(box.front());
  box.pop_front();
  return true;
}

bool InProcessGroup::Exchange(int64_t rank, torch::Tensor contribution,
                              const std::function<std::vector<torch::Tensor>(
                                  const std::vector<torch::Tensor>&)>& combine,
                              std::vector<torch::Tensor>* results) {
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t generation = generation_;
  contributions_[rank] = std::move(contribution);
  if (++arrived_ == world_size_) {
    results_ = combine(contributions_);
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  } else if (!cv_.wait_for(lock, timeout_,
                           [&] { return generation_ != generation; })) {
    return false;
  }
  *results = results_;  // read under the lock, before the next generation
  return true;
}

// In a real run each rank is a process; here ranks are threads of one. The
// process-wide objects LibTorch creates on first use (the default CPU
// generator and its mutex, the pickler's type tables, autograd's engine)
// are created once here, on the thread that starts the ranks, as a process
// creates them before it trains: their lazy creation inside uninstrumented
// LibTorch is invisible to ThreadSanitizer, which otherwise reports the
// first use by one rank thread against the creation by another.
void WarmUpLibTorchGlobals() {
  static std::once_flag once;
  std::call_once(once, [] {
    torch::nn::Embedding embedding(4, 4);
    torch::nn::Linear linear(4, 4);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({4}));
    torch::Tensor x = norm(linear(embedding(torch::arange(2))));
    x.sum().backward();
    c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
    dict.insert("x", x.detach());
    (void)torch::pickle_load(torch::pickle_save(dict));
  });
}

void RunRanks(int64_t world_size,
              const std::function<void(int64_t, Communicator&)>& fn,
              PointToPoint p2p, std::chrono::milliseconds timeout) {
  WarmUpLibTorchGlobals();
  InProcessGroup group(world_size, timeout, p2p);
  std::vector<std::thread> threads;
  for (int64_t rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      std::unique_ptr<Communicator> comm = group.ForRank(rank);
      fn(rank, *comm);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace shardtrain
