// A bounded multi-producer multi-consumer ring of 32-bit values (slot indices).
//
// Algorithm: D. Vyukov's bounded MPMC queue. Each cell carries a sequence number
// that says whose turn it is: seq == pos means "free for the push at pos",
// seq == pos + 1 means "holds the value pushed at pos, ready for the pop at pos".
// head_/tail_ only hand out positions; the cell's sequence number carries the data.
//
// Synchronization:
//   (P2) push's store of seq = pos + 1 happens-before (C1) pop's load that sees it,
//        so the pop reads the value the push wrote.
//   (C2) pop's store of seq = pos + capacity happens-before (P1) the load by the push
//        one lap later, so that push's write of the value cannot race with the read.
//   P2 and C2 are seq_cst, and so are P1 and C1, because they are also the
//   "condition" stores and re-check loads of the not_empty/not_full EventCounts
//   (see wait.hpp); on x86 and aarch64 a seq_cst load costs the same as acquire.
//
// Progress: a push or pop that has claimed a position but not yet published its
// cell holds up the pop or push that comes one lap later at that cell (it sees
// "empty"/"full"), as in every sequence-numbered ring; nothing is ever lost.
//
// Layout: a Ring is a header followed by its cells in one block of bytes(capacity)
// bytes, so it can be placed in any memory, including memory shared between
// processes: it holds no pointers, only positions and 32-bit futex words.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <new>

#include "dataecho/config.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

class Ring {
 public:
  static constexpr std::size_t kMinCapacity = 2;
  static constexpr std::size_t kMaxCapacity = std::size_t{1} << 31;

  // Bytes needed for a ring of `capacity` cells (a power of two), rounded up to a
  // cache line so that rings placed back to back stay aligned.
  static constexpr std::size_t bytes(std::size_t capacity) noexcept {
    return round_up(sizeof(Ring) + capacity * sizeof(Cell), kCacheLine);
  }

  // Constructs a ring in `memory`, which must be kCacheLine-aligned and hold bytes(capacity).
  // At least 2 cells: with one, "full at pos" and "free for pos + 1" are the same
  // sequence number and a push would overwrite an unread value.
  static Ring* create(void* memory, std::size_t capacity, bool process_shared = false) {
    DATAECHO_CHECK(capacity >= kMinCapacity && capacity <= kMaxCapacity && std::has_single_bit(capacity));
    DATAECHO_CHECK(reinterpret_cast<std::uintptr_t>(memory) % kCacheLine == 0);
    return new (memory) Ring(capacity, process_shared);
  }

  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  std::size_t capacity() const noexcept { return mask_ + 1; }

  // Pushes and wakes sleeping poppers.
  [[nodiscard]] bool try_push(std::uint32_t value) noexcept {
    if (!try_push_quiet(value)) return false;
    not_empty_.notify_all();
    return true;
  }

  // Pushes without waking anyone: for a caller that pushes several values and
  // then calls not_empty().notify_all() once (one wake-up instead of one each).
  [[nodiscard]] bool try_push_quiet(std::uint32_t value) noexcept {
    // relaxed: head_ only arbitrates which pusher owns a position; the data
    // hand-off is ordered by the cell's sequence number.
    std::uint64_t pos = head_.load(std::memory_order_relaxed);
    Cell* cell;
    for (;;) {
      cell = &cells()[pos & mask_];
      const std::uint64_t seq = cell->seq.load(std::memory_order_seq_cst);  // (P1) pairs with (C2)
      const auto diff = static_cast<std::int64_t>(seq - pos);
      if (diff == 0) {
        // relaxed: see head_ above; a failed CAS reloads pos.
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (diff < 0) {
        return false;  // the cell a lap ahead is not yet consumed: full
      } else {
        pos = head_.load(std::memory_order_relaxed);  // another pusher took pos
      }
    }
    cell->value = value;
    cell->seq.store(pos + 1, std::memory_order_seq_cst);  // (P2) publishes; pairs with (C1)
    return true;
  }

  [[nodiscard]] bool try_pop(std::uint32_t& value) noexcept {
    // relaxed: as for head_ in try_push.
    std::uint64_t pos = tail_.load(std::memory_order_relaxed);
    Cell* cell;
    for (;;) {
      cell = &cells()[pos & mask_];
      const std::uint64_t seq = cell->seq.load(std::memory_order_seq_cst);  // (C1) pairs with (P2)
      const auto diff = static_cast<std::int64_t>(seq - (pos + 1));
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (diff < 0) {
        return false;  // not yet published: empty
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
    value = cell->value;
    cell->seq.store(pos + mask_ + 1, std::memory_order_seq_cst);  // (C2) frees the cell; pairs with (P1)
    not_full_.notify_all();
    return true;
  }

  // A snapshot that may be stale by the time it returns; exact when quiescent.
  std::size_t size_approx() const noexcept {
    // relaxed: an estimate; no data is read on its strength.
    const std::uint64_t tail = tail_.load(std::memory_order_relaxed);
    const std::uint64_t head = head_.load(std::memory_order_relaxed);
    return head > tail ? static_cast<std::size_t>(head - tail) : 0;
  }

  EventCount& not_empty() noexcept { return not_empty_; }
  EventCount& not_full() noexcept { return not_full_; }

 private:
  struct Cell {
    std::atomic<std::uint64_t> seq;
    std::uint32_t value;  // plain: ordered by seq (P2 -> C1, C2 -> P1)
  };

  Ring(std::size_t capacity, bool process_shared)
      : not_empty_(process_shared), not_full_(process_shared), mask_(capacity - 1) {
    for (std::size_t i = 0; i < capacity; ++i) {
      auto* cell = new (&cells()[i]) Cell;
      cell->seq.store(i, std::memory_order_relaxed);  // relaxed: not yet shared
      cell->value = 0;
    }
  }

  Cell* cells() noexcept { return reinterpret_cast<Cell*>(this + 1); }

  // Pushers hammer head_, poppers tail_: keep them on separate lines, and the
  // read-mostly event counts and mask off both.
  alignas(kCacheLine) std::atomic<std::uint64_t> head_{0};
  alignas(kCacheLine) std::atomic<std::uint64_t> tail_{0};
  alignas(kCacheLine) EventCount not_empty_;
  EventCount not_full_;
  std::uint64_t mask_;

  friend struct RingLayoutCheck;
};

struct RingLayoutCheck {
  static_assert(offsetof(Ring, tail_) - offsetof(Ring, head_) >= kCacheLine,
                "head_ and tail_ must be on separate cache lines");
  static_assert(offsetof(Ring, not_empty_) - offsetof(Ring, tail_) >= kCacheLine,
                "event counts must not share tail_'s cache line");
  static_assert(sizeof(Ring) % kCacheLine == 0, "cells must start on a cache line");
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free &&
                    std::atomic<std::uint32_t>::is_always_lock_free,
                "ring atomics must be lock-free to be address-free across processes");
};

}  // namespace dataecho
