// A deterministic buffer's state before a batch, for checkpoints (captured and
// restored in checkpoint.hpp), and the desk that hands it from the assembler
// thread to the consumer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "dataecho/wait.hpp"

namespace dataecho {

struct Snapshot {
  std::uint64_t batches = 0;    // batches assembled; the next one is number `batches`
  std::uint64_t rng_state = 0;  // Rng::state()
  std::uint64_t next_seq = 0;   // every example numbered below this was taken in
  std::uint64_t available = 0;  // Reservoir::available()
  std::vector<std::uint64_t> seqs;    // resident examples, in reservoir order ...
  std::vector<std::uint32_t> echoes;  // ... and their remaining echo counts
  std::vector<std::vector<std::uint64_t>> queued;  // assembled, not yet taken: each row's number
  bool ended = false;  // the assembler has finished: only `queued` is left
};

// The hand-over of a snapshot from the assembler to the consumer. A rare control
// operation, so a mutex and a condition variable: the assembler's only cost per
// batch is one load of `wanted`.
class SnapshotDesk {
 public:
  // Consumer: asks for a snapshot (idempotent while one is pending).
  void request() noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    // seq_cst: the assembler re-checks this flag after parking in
    // ReadyQueue::wait_for_room or Assembler::next_committed; the consumer's
    // wake-ups of both, after this store, pair with those re-checks.
    wanted_.store(true, std::memory_order_seq_cst);
  }

  // Consumer: waits for the snapshot until `deadline`. True when `out` is
  // filled, or when the assembler has exited (then `exited` is set).
  bool wait(Snapshot& out, bool& exited, Deadline deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto done = [&] { return served_ || exited_; };
    if (deadline.is_never())
      served_cv_.wait(lock, done);
    else if (!served_cv_.wait_until(lock, deadline.at(), done))
      return false;
    exited = !served_ && exited_;
    if (served_) out = std::move(snapshot_);
    served_ = false;
    return true;
  }

  // Assembler: whether the consumer is waiting for a snapshot.
  bool wanted() const noexcept { return wanted_.load(std::memory_order_seq_cst); }
  const std::atomic<bool>& wanted_flag() const noexcept { return wanted_; }

  // Assembler: hands over `snapshot` to the waiting consumer.
  void serve(Snapshot snapshot) {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot_ = std::move(snapshot);
    served_ = true;
    wanted_.store(false, std::memory_order_relaxed);  // relaxed: under the mutex the consumer takes
    served_cv_.notify_all();
  }

  // Assembler: it has exited; a waiting consumer builds the snapshot itself.
  void exited() {
    std::lock_guard<std::mutex> lock(mutex_);
    exited_ = true;
    wanted_.store(false, std::memory_order_relaxed);  // relaxed: under the mutex
    served_cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable served_cv_;
  std::atomic<bool> wanted_{false};
  bool served_ = false;
  bool exited_ = false;
  Snapshot snapshot_;
};

}  // namespace dataecho
