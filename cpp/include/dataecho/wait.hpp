// Blocking without sleeping loops: deadlines, an event count that parks threads on
// a futex, and the spin -> yield -> park policy every blocking call uses.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

namespace dataecho {

using Clock = std::chrono::steady_clock;

// A point in time after which a blocking call gives up; `never()` waits forever.
class Deadline {
 public:
  static Deadline never() noexcept { return Deadline(Clock::time_point::max()); }
  static Deadline now() noexcept { return Deadline(Clock::now()); }
  static Deadline after_seconds(double s) noexcept {
    // Beyond about 292 years the duration overflows; treat it as forever.
    if (!(s < 1e9)) return never();
    if (s < 0) s = 0;
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(s)));
  }
  bool is_never() const noexcept { return at_ == Clock::time_point::max(); }
  bool expired() const noexcept { return !is_never() && Clock::now() >= at_; }
  Clock::time_point at() const noexcept { return at_; }
  Deadline earlier(Deadline other) const noexcept { return other.at_ < at_ ? other : *this; }

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

namespace detail {

#if defined(__linux__)
inline void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, Deadline deadline,
                       bool process_shared) noexcept {
  timespec rel{};
  timespec* timeout = nullptr;
  if (!deadline.is_never()) {
    auto left = deadline.at() - Clock::now();
    if (left <= Clock::duration::zero()) return;
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    rel.tv_sec = static_cast<time_t>(ns / 1000000000);
    rel.tv_nsec = static_cast<long>(ns % 1000000000);
    timeout = &rel;
  }
  // Private futexes skip the kernel's shared-mapping lookup; shared ones are
  // needed when the word lives in memory mapped by several processes.
  const int op = FUTEX_WAIT | (process_shared ? 0 : FUTEX_PRIVATE_FLAG);
  // std::atomic<uint32_t> has the size and representation of uint32_t, which is
  // what the kernel compares against `expected` (libstdc++'s atomic wait relies on the same).
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, expected, timeout, nullptr, 0);
}

inline void futex_wake_all(std::atomic<std::uint32_t>* word, bool process_shared) noexcept {
  const int op = FUTEX_WAKE | (process_shared ? 0 : FUTEX_PRIVATE_FLAG);
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, INT32_MAX, nullptr, nullptr, 0);
}
#else
// Portable fallback: std::atomic wait has no timeout, so timed waits poll in 1 ms naps.
inline void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, Deadline deadline,
                       bool) noexcept {
  if (deadline.is_never()) {
    word->wait(expected, std::memory_order_acquire);
    return;
  }
  if (word->load(std::memory_order_acquire) == expected && !deadline.expired())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}
inline void futex_wake_all(std::atomic<std::uint32_t>* word, bool) noexcept { word->notify_all(); }
#endif

}  // namespace detail

// An event count (as in Dekker's wait/notify or folly::EventCount): lets a thread
// sleep until some condition held elsewhere may have become true, without a mutex.
//
// Waiter:   key = prepare_wait(); if (condition()) cancel_wait(); else wait(key, deadline);
// Notifier: make the condition true with a seq_cst store or RMW; notify_all();
//
// Synchronization (why no wake-up is lost): the waiter's waiters_ increment (W1)
// precedes its seq_cst re-check of the condition (W2); the notifier's seq_cst
// store of the condition (N1) precedes its seq_cst load of waiters_ (N2). All four
// are in the single total order S. If W2 misses N1 then W2 <S N1, hence
// W1 <S W2 <S N1 <S N2, so N2 sees the waiter and bumps epoch_ (N3). The waiter
// either read the bumped epoch as its key, in which case N1 happens-before W2 via
// the seq_cst pair (N3, key load) and W2 cannot have missed it, or it read the
// old epoch, in which case the futex compares against the bumped value or is
// queued before the wake. Either way it does not sleep through N1.
//
// The object is address-free (two 32-bit atomics), so it may live in memory
// shared between processes when constructed with process_shared = true.
class EventCount {
 public:
  explicit EventCount(bool process_shared = false) noexcept : process_shared_(process_shared) {}
  EventCount(const EventCount&) = delete;
  EventCount& operator=(const EventCount&) = delete;

  [[nodiscard]] std::uint32_t prepare_wait() noexcept {
    waiters_.fetch_add(1, std::memory_order_seq_cst);  // (W1)
    return epoch_.load(std::memory_order_seq_cst);     // key; pairs with (N3)
  }

  void cancel_wait() noexcept {
    // relaxed: only a count of sleepers; a stale non-zero value costs one spare wake.
    waiters_.fetch_sub(1, std::memory_order_relaxed);
  }

  // Returns on notification, on deadline, or spuriously; callers re-check.
  void wait(std::uint32_t key, Deadline deadline) noexcept {
    detail::futex_wait(&epoch_, key, deadline, process_shared_);
    cancel_wait();
  }

  void notify_all() noexcept {
    if (waiters_.load(std::memory_order_seq_cst) == 0) return;  // (N2)
    epoch_.fetch_add(1, std::memory_order_seq_cst);             // (N3)
    detail::futex_wake_all(&epoch_, process_shared_);
  }

 private:
  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint32_t> waiters_{0};
  const bool process_shared_;
};

// Blocks until `ready()` returns true or the deadline passes; returns which.
// `ready()` is retried (it may take an item as a side effect). Policy: a short
// spin for the common case where the other side is mid-operation, a few yields
// so that on an oversubscribed machine the thread we wait for can run, then park.
// Nothing here spins without bound: the park is a futex sleep.
template <class Ready>
bool block_until(EventCount& event, Deadline deadline, Ready&& ready) {
  constexpr int kSpins = 64;
  constexpr int kYields = 4;
  if (ready()) return true;
  for (int i = 0; i < kSpins; ++i) {
    cpu_relax();
    if (ready()) return true;
  }
  for (int i = 0; i < kYields; ++i) {
    std::this_thread::yield();
    if (ready()) return true;
  }
  for (;;) {
    const std::uint32_t key = event.prepare_wait();
    if (ready()) {
      event.cancel_wait();
      return true;
    }
    if (deadline.expired()) {
      event.cancel_wait();
      return false;
    }
    event.wait(key, deadline);
  }
}

}  // namespace dataecho
