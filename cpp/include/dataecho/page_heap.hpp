// The page heap: where the values of ragged fields live (token ids of any
// length, a varying number of boxes), in fixed-size pages.
//
// An example's ragged values take ceil(bytes / page_bytes) pages, chained
// through next_: a producer takes all the pages of an example in one step, as
// a chain already linked, and the assembler gives the chain back in one step
// when the example's last echo is gathered. Examples are freed in any order
// (the reservoir draws at random), and pages of one size never fragment: any
// freed page serves any example. Memory is bounded by the number of pages (the
// budget), not by capacity x the longest example. This is how paged KV caches
// hold sequences of unknown length.
//
// The free pages form a lock-free stack (Treiber's), linked through next_:
// the page given back last is taken first, while it is still in the cache. The
// head is one 64-bit word, {page index, tag}; the tag changes on every update,
// so a pop that read a stale head fails its CAS instead of taking pages
// another thread took meanwhile (the ABA problem). Pages never used yet are not
// on the stack: a pop that finds too few there first moves a run of them onto
// it (`fresh` counts those handed out). So a heap sized generously costs only
// the pages ever in use at once (and their links): memory not touched is not
// resident.
//
// Synchronization:
//   (H1) push: the chain's links are stored (relaxed), then the head CAS
//        publishes them, and the pages' bytes the pusher read.
//   (H2) pop: the head load and CAS pair with H1, so the popper sees the links
//        and may write the bytes. Every head update is an RMW, so a load reads
//        the end of one release sequence that orders every earlier push before it.
//   Both are seq_cst: H1 is also the condition store of the `freed` event
//   count, and H2's first load a waiting producer's re-check (see wait.hpp).
//   A pop walks next_ from a head that may be stale: a page in the walk may be
//   taken and relinked by another thread meanwhile. The links are atomics
//   (relaxed: the walk is a guess that the CAS validates), so this is no data
//   race, and a walk that read a changed link fails its CAS, since the head's
//   tag has changed too.
//
// Layout: the head, counters and event count live in the region header; next_
// and the pages in the region (region.hpp), so worker processes use the heap
// too. Nothing here is a pointer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "dataecho/config.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

inline constexpr std::uint32_t kNoPage = 0xFFFFFFFFu;
inline constexpr std::size_t kMaxPages = std::size_t{0xFFFFFFFEu};
inline constexpr std::size_t kMinPageBytes = 64;
inline constexpr std::size_t kMaxPageBytes = std::size_t{1} << 20;

// The heap's shared state, a member of the region header.
struct PageHeapState {
  explicit PageHeapState(bool process_shared) : freed(process_shared) {}

  alignas(kCacheLine) std::atomic<std::uint64_t> head{0};  // {top page, tag} (see pack())
  std::atomic<std::uint64_t> fresh{0};  // pages [fresh, pages) were never on the stack
  alignas(kCacheLine) std::atomic<std::uint64_t> in_use{0};  // pages held: statistics
  std::atomic<std::uint32_t> waiters{0};  // producers waiting for pages (the assembler reads it)
  EventCount freed;                       // pages were given back
};

// A view of a region's heap: copies operate on the same shared state.
class PageHeap {
 public:
  PageHeap() = default;
  PageHeap(PageHeapState* state, std::atomic<std::uint32_t>* next, std::byte* data, std::size_t pages,
           std::size_t page_bytes) noexcept
      : state_(state), next_(next), data_(data), pages_(pages), page_bytes_(page_bytes) {}

  // Bytes each page holds, and pages in all (0: no heap).
  std::size_t page_bytes() const noexcept { return page_bytes_; }
  std::size_t pages() const noexcept { return pages_; }

  // Pages for `bytes` of values.
  std::size_t pages_for(std::size_t bytes) const noexcept { return (bytes + page_bytes_ - 1) / page_bytes_; }

  std::byte* page(std::uint32_t i) const noexcept { return data_ + std::size_t{i} * page_bytes_; }

  // The page after `i` in a chain its holder owns.
  std::uint32_t next(std::uint32_t i) const noexcept {
    return next_[i].load(std::memory_order_relaxed);  // relaxed: the holder's own link, ordered by H2 or the slot's hand-off
  }

  // An empty stack, every page fresh (before the heap is shared).
  void format() const noexcept {
    // relaxed: not yet shared.
    state_->head.store(pack(kNoPage, 0), std::memory_order_relaxed);
    state_->fresh.store(0, std::memory_order_relaxed);
    state_->in_use.store(0, std::memory_order_relaxed);
    state_->waiters.store(0, std::memory_order_relaxed);
  }

  // Takes `count` >= 1 pages at once, as a chain first -> ... -> last (the
  // last's link is left as it was); false if fewer are free right now.
  [[nodiscard]] bool try_pop(std::size_t count, std::uint32_t& first, std::uint32_t& last) const noexcept {
    for (;;) {
      if (pop_stack(count, first, last)) {
        // relaxed: statistics.
        state_->in_use.fetch_add(count, std::memory_order_relaxed);
        return true;
      }
      // Too few on the stack: bring fresh pages, if any are left, and try again.
      if (!refill(count)) return false;
    }
  }

  // Gives back the chain first -> ... -> last of `count` pages; wakes waiting
  // producers only when some wait (the event count's check is one load).
  void push(std::uint32_t first, std::uint32_t last, std::size_t count) const noexcept {
    push_chain(first, last);
    state_->in_use.fetch_sub(count, std::memory_order_relaxed);  // relaxed: statistics
    state_->freed.notify_all();
  }

  // Whether a producer waits for pages: the assembler then draws from what is
  // resident instead of waiting for more input (see Assembler::fill).
  // seq_cst: the re-check in the assembler's wait; pairs with the store in pop_blocking.
  bool starved() const noexcept { return state_ != nullptr && state_->waiters.load(std::memory_order_seq_cst) != 0; }

  std::uint64_t in_use() const noexcept {
    return state_ != nullptr ? state_->in_use.load(std::memory_order_relaxed) : 0;  // relaxed: statistics
  }

  // Takes `count` pages, waiting until they are free, the deadline passes or
  // `closed()` holds. While it waits it counts itself in `waiters` and calls
  // `announce()` (which wakes the assembler: see starved()).
  template <class Closed, class Announce>
  Status pop_blocking(std::size_t count, std::uint32_t& first, std::uint32_t& last, Deadline deadline,
                      Closed&& closed, Announce&& announce) const {
    DATAECHO_CHECK(count >= 1 && count <= pages_);  // more could never come: callers check first
    if (try_pop(count, first, last)) return Status::kOk;
    // seq_cst: the condition store the assembler's starved() re-check pairs with.
    state_->waiters.fetch_add(1, std::memory_order_seq_cst);
    announce();
    bool got = false;
    bool shut = false;
    block_until(state_->freed, deadline, [&] {
      if (closed()) return shut = true;
      return got = try_pop(count, first, last);
    });
    state_->waiters.fetch_sub(1, std::memory_order_seq_cst);  // seq_cst: as above
    if (got) return Status::kOk;
    return shut ? Status::kClosed : Status::kTimeout;
  }

 private:
  static constexpr std::uint64_t pack(std::uint32_t index, std::uint32_t tag) noexcept {
    return (std::uint64_t{tag} << 32) | index;
  }
  static constexpr std::uint32_t index_of(std::uint64_t head) noexcept { return static_cast<std::uint32_t>(head); }
  static constexpr std::uint32_t tag_of(std::uint64_t head) noexcept { return static_cast<std::uint32_t>(head >> 32); }

  static constexpr std::size_t kRefill = 64;  // fresh pages moved onto the stack at a time, at least

  // Moves a run of fresh pages (at least `count`, where that many are left)
  // onto the stack; false when none are left.
  bool refill(std::size_t count) const noexcept {
    // relaxed: the counter only hands out distinct runs; the pages are
    // published by the push below (H1).
    std::uint64_t fresh = state_->fresh.load(std::memory_order_relaxed);
    std::uint64_t take;
    do {
      if (fresh >= pages_) return false;
      take = std::min<std::uint64_t>(pages_ - fresh, std::max(count, kRefill));
    } while (!state_->fresh.compare_exchange_weak(fresh, fresh + take, std::memory_order_relaxed));
    for (std::uint64_t i = fresh; i + 1 < fresh + take; ++i)
      next_[i].store(static_cast<std::uint32_t>(i + 1), std::memory_order_relaxed);  // relaxed: published by H1
    push_chain(static_cast<std::uint32_t>(fresh), static_cast<std::uint32_t>(fresh + take - 1));
    return true;
  }

  bool pop_stack(std::size_t count, std::uint32_t& first, std::uint32_t& last) const noexcept {
    std::uint64_t head = state_->head.load(std::memory_order_seq_cst);  // (H2)
    for (;;) {
      const std::uint32_t top = index_of(head);
      if (top == kNoPage) return false;
      std::uint32_t end = top;
      std::size_t taken = 1;
      while (taken < count) {
        end = next_[end].load(std::memory_order_relaxed);  // relaxed: validated by the CAS below
        if (end == kNoPage || end >= pages_) break;
        ++taken;
      }
      if (taken < count) {
        // Too few, or a stale walk: check that the head is unchanged before saying so.
        const std::uint64_t now = state_->head.load(std::memory_order_seq_cst);  // (H2)
        if (now == head) return false;
        head = now;
        continue;
      }
      const std::uint32_t after = next_[end].load(std::memory_order_relaxed);  // relaxed: as above
      // (H2) on success the links and page bytes of the chain are ours; a
      // failure reloads the head (seq_cst, as the loads above).
      if (state_->head.compare_exchange_weak(head, pack(after, tag_of(head) + 1), std::memory_order_seq_cst,
                                             std::memory_order_seq_cst)) {
        first = top;
        last = end;
        return true;
      }
    }
  }

  void push_chain(std::uint32_t first, std::uint32_t last) const noexcept {
    std::uint64_t head = state_->head.load(std::memory_order_relaxed);  // relaxed: the CAS validates it
    for (;;) {
      next_[last].store(index_of(head), std::memory_order_relaxed);  // relaxed: published by H1
      // (H1) the links above and our reads of the pages happen-before the next
      // pop of them; the condition store for producers waiting in pop_blocking.
      if (state_->head.compare_exchange_weak(head, pack(first, tag_of(head) + 1), std::memory_order_seq_cst,
                                             std::memory_order_relaxed))
        break;
    }
  }

  PageHeapState* state_ = nullptr;
  std::atomic<std::uint32_t>* next_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t pages_ = 0;
  std::size_t page_bytes_ = 0;
};

}  // namespace dataecho
