// Assembled batches waiting for the consumer: at most `limit` (the prefetch depth).
//
// One batch passes per hand-off, thousands per second at most, so a mutex costs
// nothing measurable here and keeps the end-of-stream and error states simple.
//
// Synchronization: every state change happens under mutex_ and is followed by
// notify_all() on the matching EventCount. A waiter registers (prepare_wait, a
// seq_cst RMW) before taking the mutex to re-check; if its re-check missed a
// change, its critical section preceded the changer's, so the unlock/lock pair
// makes the registration visible to the changer's seq_cst load of the waiter count.
#pragma once

#include <cstddef>
#include <atomic>
#include <deque>
#include <vector>
#include <exception>
#include <mutex>

#include "dataecho/batch_pool.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

class ReadyQueue {
 public:
  // `on_pop` (optional) is notified after each pop too: the assembler uses it to
  // learn that the consumer has drained the queue (auto echo).
  explicit ReadyQueue(std::size_t limit, EventCount* on_pop = nullptr) : limit_(limit), on_pop_(on_pop) {}

  // Assembler: waits until a batch may be added, or `interrupt` is set (then
  // returns true as well; the caller re-checks); false once stopped.
  bool wait_for_room(const std::atomic<bool>& interrupt) {
    bool stopped = false;
    block_until(room_, Deadline::never(), [&] {
      // seq_cst: the re-check of a flag that poke() callers store seq_cst.
      if (interrupt.load(std::memory_order_seq_cst)) return true;
      std::lock_guard<std::mutex> lock(mutex_);
      stopped = stopped_;
      return stopped_ || batches_.size() < limit_;
    });
    return !stopped;
  }

  // Wakes an assembler in wait_for_room (after its interrupt flag was set).
  void poke() { room_.notify_all(); }

  // The sequence numbers of each queued batch, oldest first.
  std::vector<std::vector<std::uint64_t>> queued_seqs() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::vector<std::uint64_t>> seqs;
    for (const Batch& batch : batches_) seqs.push_back(batch.seqs);
    return seqs;
  }

  void push(Batch batch) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batches_.push_back(std::move(batch));
    }
    ready_.notify_all();
  }

  // Assembler: no more batches; `error` (if any) is raised by the consumer after
  // the batches already queued; `unheld` (owners of held values freed after the
  // last batch) goes to the consumer that first sees the end.
  void finish(std::exception_ptr error = nullptr, std::vector<std::uint64_t> unheld = {}) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = true;
      error_ = std::move(error);
      unheld_at_end_ = std::move(unheld);
    }
    ready_.notify_all();
  }

  // Anyone: abandon the stream; wakes both sides and drops queued batches.
  void stop() {
    std::deque<Batch> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
      dropped.swap(batches_);
    }
    ready_.notify_all();
    room_.notify_all();
  }

  enum class Pop { kBatch, kEnd, kTimeout };

  // Consumer: the next batch, the end of the stream (with, the first time,
  // `out.unheld`: see finish), or a timeout. Rethrows the assembler's error
  // once the batches before it are consumed. While it blocks (a deadline not
  // yet passed, nothing queued) it counts as waiting (see waiting()) and wakes
  // the assembler through `on_pop` once.
  Pop pop(Batch& out, Deadline deadline) {
    Pop result = Pop::kTimeout;
    std::exception_ptr error;
    bool counted = false;
    block_until(ready_, deadline, [&] {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!batches_.empty() && !stopped_) {
          out = std::move(batches_.front());
          batches_.pop_front();
          result = Pop::kBatch;
          // Under the lock that emptied the queue: an assembler that then sees it
          // empty (size(), under the lock) sees this consumer not waiting.
          if (counted) waiting_.fetch_sub(1, std::memory_order_seq_cst);
          counted = false;
          return true;
        }
        if (finished_ || stopped_) {
          error = stopped_ ? nullptr : error_;
          out.unheld = std::move(unheld_at_end_);
          unheld_at_end_.clear();
          result = Pop::kEnd;
          return true;
        }
      }
      if (!counted && !deadline.expired()) {
        // seq_cst: pairs with the assembler's re-check of waiting() after its
        // prepare_wait on the event count notified here (the EventCount protocol).
        waiting_.fetch_add(1, std::memory_order_seq_cst);
        counted = true;
        if (on_pop_ != nullptr) on_pop_->notify_all();
      }
      return false;
    });
    if (counted) waiting_.fetch_sub(1, std::memory_order_seq_cst);  // seq_cst: as the increment
    if (result == Pop::kBatch) {
      room_.notify_all();
      if (on_pop_ != nullptr) on_pop_->notify_all();
    }
    if (error) std::rethrow_exception(error);
    return result;
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batches_.size();
  }

  // Consumers blocked in pop() now (see pop). seq_cst: see there. Read after
  // size() found the queue empty, a consumer that has taken the last batch no
  // longer counts (it stops counting under the lock with which it took it).
  std::size_t waiting() const noexcept { return waiting_.load(std::memory_order_seq_cst); }

 private:
  const std::size_t limit_;
  EventCount* const on_pop_;
  mutable std::mutex mutex_;
  std::deque<Batch> batches_;
  bool finished_ = false;
  bool stopped_ = false;
  std::exception_ptr error_;
  std::vector<std::uint64_t> unheld_at_end_;  // see finish
  std::atomic<std::size_t> waiting_{0};       // consumers blocked in pop()
  EventCount ready_;  // batches_ non-empty, finished_ or stopped_
  EventCount room_;   // batches_.size() < limit_ or stopped_
};

}  // namespace dataecho
