// The assembler's state, and the steps every assembly policy (fixed_policy.hpp,
// auto_policy.hpp) shares: taking committed examples into the reservoir,
// gathering a drawn example into a batch, freeing slots, and handing finished
// batches to the ready queue.
//
// One thread, the buffer's assembler, owns all of it. Other threads only read
// the counters published for stats() (relaxed atomics) and raise the desk's
// request for a snapshot.
//
// Synchronization (the assembler's side of shuffle_buffer.hpp's list):
//   - slot bytes: the committed pop (C1) pairs with the producer's push (P2),
//     so the gather reads what the producer wrote; the gather happens-before
//     the free push (P2), which pairs with the next producer's pop (C1).
//   - end of input: input_finished() reads closed, then in_flight, then the
//     committed ring, all seq_cst (see producer.hpp, I1/I2).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dataecho/batch_pool.hpp"
#include "dataecho/buffer_config.hpp"
#include "dataecho/delivered_pool.hpp"
#include "dataecho/layout.hpp"
#include "dataecho/memory.hpp"
#include "dataecho/ordered_intake.hpp"
#include "dataecho/ready_queue.hpp"
#include "dataecho/region.hpp"
#include "dataecho/reservoir.hpp"
#include "dataecho/rng.hpp"
#include "dataecho/snapshot.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

// What one call of an assembly policy (or of Assembler::fill) achieved.
enum class Step {
  kBatch,     // a batch was pushed (fill: the target was reached)
  kEnd,       // the stream is over (or stopped)
  kSnapshot,  // interrupted before drawing, for a snapshot: call again for the same batch
  kStarved,   // fill only: short of its target because a producer waits for pages of the
              // heap, which only draws can free: draw from what is resident
};

class Assembler {
 public:
  Assembler(const BufferConfig& config, const ExampleLayout& layout, const RegionView& region, BatchPool& pool,
            ReadyQueue& ready, const std::atomic<bool>& stop, const SnapshotDesk& desk)
      : config_(config),
        layout_(layout),
        region_(region),
        pool_(pool),
        ready_(ready),
        stop_(stop),
        desk_(desk),
        echoes_(config.auto_echo ? config.max_echo : config.echo_factor),
        reservoir_(config.capacity, config.in_order),
        delivered_(config.auto_echo ? config.capacity : 0, config.echo_gap),
        rng_(config.seed),
        // Deterministic: the window's slots stay free for examples that wait out of order.
        full_(std::max({config.batch_size, config.capacity - (config.deterministic ? config.window : config.batch_size),
                        config.initial})),
        values_hint_(layout.ragged_fields().size(), 0) {}

  const BufferConfig& config() const noexcept { return config_; }
  const RegionView& region() const noexcept { return region_; }
  Reservoir& reservoir() noexcept { return reservoir_; }
  const Reservoir& reservoir() const noexcept { return reservoir_; }
  DeliveredPool& delivered() noexcept { return delivered_; }  // auto echo only
  Rng& rng() noexcept { return rng_; }
  const Rng& rng() const noexcept { return rng_; }
  OrderedIntake& ordered() noexcept { return ordered_; }
  const OrderedIntake& ordered() const noexcept { return ordered_; }
  ReadyQueue& ready() noexcept { return ready_; }
  const ReadyQueue& ready() const noexcept { return ready_; }

  // Steady-state fill target: capacity - batch_size, at least batch_size and
  // initial, so that the slots one batch frees are refilled while the next is gathered.
  std::size_t full() const noexcept { return full_; }

  bool stopped() const noexcept { return stop_.load(std::memory_order_relaxed); }  // relaxed: polled
  // seq_cst: the re-check of a wait's condition; pairs with ShuffleBuffer::stop()'s
  // store, which is followed by a notify of every event count.
  bool stop_requested() const noexcept { return stop_.load(std::memory_order_seq_cst); }

  // ---- intake ----

  // Takes in committed examples until `target` are resident. kBatch: reached;
  // kEnd: the input finished first (the caller drains what is resident) or the
  // buffer was stopped; kSnapshot: a snapshot is wanted first (only with
  // serve_snapshots); kStarved: a producer waits for pages of the heap while
  // examples are resident (draws free pages; waiting for input would not).
  //
  // With nothing resident a starved heap is held by producers about to commit
  // (they took all their pages at once) or, deterministic, by examples waiting
  // out of order: the lowest of those is admitted, so intake cannot deadlock,
  // though the order then depends on timing (memory budget too small).
  Step fill(std::size_t target, bool serve_snapshots = true) {
    while (reservoir_.size() < target) {
      if (stopped()) return Step::kEnd;
      if (config_.deterministic && admit_next(/*input_over=*/false)) continue;
      if (serve_snapshots && desk_.wanted()) return Step::kSnapshot;
      std::uint32_t slot;
      const Committed got = next_committed(slot, serve_snapshots, /*starve=*/true);
      if (got == Committed::kSnapshot) return Step::kSnapshot;
      if (got == Committed::kStarved) {
        if (reservoir_.size() > 0) {
          starved_.fetch_add(1, std::memory_order_relaxed);  // relaxed: statistics
          return Step::kStarved;
        }
        if (config_.deterministic && admit_next(/*input_over=*/true)) continue;
        if (next_committed(slot, serve_snapshots, /*starve=*/false) != Committed::kSlot) continue;
      } else if (got == Committed::kEnd) {
        if (config_.deterministic && admit_next(/*input_over=*/true)) continue;
        return Step::kEnd;
      }
      if (config_.deterministic)
        ordered_.hold(region_.slot_seq[slot], slot);
      else
        take_in(slot);
    }
    return Step::kBatch;
  }

  enum class Committed { kSlot, kEnd, kSnapshot, kStarved };

  // Waits for the next committed slot; kEnd once stopped or the input finished;
  // kSnapshot (only with serve_snapshots) when a snapshot is wanted first;
  // kStarved (only with `starve`) when a producer waits for pages.
  Committed next_committed(std::uint32_t& slot, bool serve_snapshots, bool starve = false) {
    bool got = false;
    bool wanted = false;
    bool starved = false;
    block_until(region_.committed->not_empty(), Deadline::never(), [&] {
      if (region_.committed->try_pop(slot)) return got = true;  // (C1)
      if (stop_requested()) return true;
      // seq_cst: the re-check of the flag SnapshotDesk::request stores; the
      // consumer notifies not_empty after it.
      if (serve_snapshots && desk_.wanted()) return wanted = true;
      // A producer that starts waiting for pages counts itself, then notifies
      // not_empty (PageHeap::pop_blocking): this re-check pairs with that.
      if (starve && region_.heap.starved()) return starved = true;
      return input_finished(slot, got) || got;
    });
    if (got) return Committed::kSlot;
    if (starved) return Committed::kStarved;
    return wanted ? Committed::kSnapshot : Committed::kEnd;
  }

  // Whether a producer waits for pages of the heap.
  bool starved() const noexcept { return region_.heap.starved(); }

  // True when no example can arrive any more: closed, no put in flight, and
  // the committed ring drained. Order matters: closed (seq_cst) then in_flight
  // (seq_cst, pairs with I1/I2 in producer.hpp) then the ring. A put that raised
  // in_flight after our read of it sees closed and takes no slot; one that
  // finished before has its pushes ordered before its decrement, so the final
  // try_pop sees them.
  bool input_finished(std::uint32_t& slot, bool& got) {
    got = false;
    if (!region_.header->closed.load(std::memory_order_seq_cst)) return false;
    if (region_.header->in_flight.load(std::memory_order_seq_cst) != 0) return false;
    got = region_.committed->try_pop(slot);
    return !got;
  }

  // Takes a committed slot in at once (not deterministic), with an echo count
  // drawn from the RNG, or by sequence number for exact echo.
  void take_in(std::uint32_t slot) {
    const std::uint32_t echoes =
        config_.exact_echo ? echoes_.by_seq(region_.slot_seq[slot]) : echoes_.drawn(rng_);
    if (config_.auto_echo)
      reservoir_.add_fresh(slot, echoes);  // echoes = its budget under max_echo
    else
      reservoir_.add(slot, echoes);
  }

  // Deterministic intake: admits the next example in sequence order, if it has
  // come (or, once the input is over, the lowest waiting).
  bool admit_next(bool input_over) {
    std::uint64_t seq;
    std::uint32_t slot;
    if (!ordered_.next(input_over, seq, slot)) return false;
    reservoir_.add(slot, echoes_.by_seq(seq));
    ordered_.publish(*region_.header);
    return true;
  }

  // ---- output ----

  // An empty batch on a block of the pool (with value blocks sized like the
  // last batch's, for ragged fields).
  Batch new_batch(std::size_t rows) {
    Batch batch{pool_.lease(), rows, {}, {}, {}};
    batch.seqs.reserve(rows > 0 ? rows : config_.batch_size);  // one allocation per batch, not per row
    for (std::size_t r = 0; r < values_hint_.size(); ++r) {
      layout_.offsets(batch.lease->data(), layout_.ragged_fields()[r])[0] = 0;
      batch.lease->reserve_values(r, values_hint_[r] + values_hint_[r] / 8);
    }
    return batch;
  }

  void gather_row(Reservoir::Draw draw, Batch& batch, std::size_t row) {
    const std::byte* slot = region_.arena.slot(draw.slot);
    layout_.gather(slot, region_.refs(draw.slot), batch.lease->data(), row);
    if (!values_hint_.empty()) gather_ragged(slot, batch, row);
    batch.seqs.push_back(region_.slot_seq[draw.slot]);  // for snapshots and the delivery ledger
    if (draw.last) release_slot(draw.slot);
  }

  void push(Batch batch) {
    stream_fence();  // the gather's streaming stores, before the ready queue publishes the batch
    region_.free->not_empty().notify_all();  // one wake-up for the slots this batch freed
    for (std::size_t r = 0; r < values_hint_.size(); ++r) values_hint_[r] = batch.lease->values_used(r);
    batch.released = std::move(released_);
    released_.clear();
    batch.unheld = std::move(unheld_);
    unheld_.clear();
    if (region_.held != nullptr) unheld_.reserve(config_.batch_size);  // no reallocation per row
    publish_resident();
    ready_.push(std::move(batch));
  }

  // Returns a slot to producers without waking them; callers notify afterwards.
  //
  // free_ has a cell per slot, yet a push can find its cell still "full": a
  // producer that claimed the pop one lap earlier (won the tail_ CAS) may not yet
  // have stored the cell's release (C2) when the other slots have lapped it. That
  // producer is mid-operation, so wait for its pop to complete (it notifies
  // not_full) instead of treating it as an error.
  void release_slot(std::uint32_t slot) {
    std::byte* bytes = region_.arena.slot(slot);
    if (config_.key_field >= 0) {  // the Python layer's key for the example's objects
      std::uint64_t key;
      std::memcpy(&key, bytes + layout_.slot_offset(static_cast<std::size_t>(config_.key_field)), sizeof key);
      released_.push_back(key);
    }
    if (!values_hint_.empty()) release_pages(bytes);
    if (HeldRef* refs = region_.refs(slot)) {
      for (std::size_t h = 0; h < region_.held_per_slot; ++h) {
        if (refs[h].data != nullptr) unheld_.push_back(refs[h].owner);
        refs[h] = HeldRef{nullptr, 0};
      }
    }
    poison(bytes, layout_.slot_stride());
    if (region_.free->try_push_quiet(slot)) return;
    block_until(region_.free->not_full(), Deadline::never(), [&] { return region_.free->try_push_quiet(slot); });
  }

  // End of the stream: what is resident is not needed any more. The owners of
  // the held values freed since the last batch (those never delivered again:
  // a drop_last remainder, unspent auto-echo budget) go with the end itself.
  Step finish() {
    // relaxed: statistics. With auto echo, unspent budget is not a loss.
    if (!config_.auto_echo) dropped_.fetch_add(reservoir_.echoes_left(), std::memory_order_relaxed);
    reservoir_.clear([this](std::uint32_t slot) { release_slot(slot); });
    delivered_.clear([this](std::uint32_t slot) { release_slot(slot); });
    region_.free->not_empty().notify_all();
    publish_resident();
    ready_.finish(nullptr, std::move(unheld_));
    unheld_.clear();
    return Step::kEnd;
  }

  // The ragged values of the example in `slot`: appended to each field's value
  // block of the batch, its row's end written to the field's offsets.
  void gather_ragged(const std::byte* slot, Batch& batch, std::size_t row) {
    const PageHeap& heap = region_.heap;
    BatchPool::Lease& lease = *batch.lease;
    const auto& ragged = layout_.ragged_fields();
    for (std::size_t r = 0; r < ragged.size(); ++r) {
      const RaggedRef& ref = layout_.ref(slot, ragged[r]);
      std::int64_t* offsets = layout_.offsets(lease.data(), ragged[r]);
      const std::size_t bytes = static_cast<std::size_t>(ref.rows) * layout_.field_bytes(ragged[r]);
      const std::size_t used = lease.values_used(r);
      std::byte* to = lease.reserve_values(r, used + bytes) + used;
      std::uint32_t page = ref.first;
      for (std::size_t copied = 0; copied < bytes;) {
        const std::size_t piece = std::min(heap.page_bytes(), bytes - copied);
        std::memcpy(to + copied, heap.page(page), piece);
        copied += piece;
        if (copied < bytes) page = heap.next(page);
      }
      lease.set_values_used(r, used + bytes);
      offsets[row + 1] = offsets[row] + static_cast<std::int64_t>(ref.rows);
    }
  }

  // Gives the pages of the example in `slot` back to the heap: one chain, from
  // the first non-empty ragged field's first page to the last one's last.
  void release_pages(std::byte* slot) noexcept {
    const PageHeap& heap = region_.heap;
    std::uint32_t first = kNoPage;
    std::uint32_t last = kNoPage;
    std::size_t pages = 0;
    for (std::size_t f : layout_.ragged_fields()) {
      const RaggedRef& ref = layout_.ref(slot, f);
      if (ref.rows == 0) continue;
      if (first == kNoPage) first = ref.first;
      last = ref.last;
      pages += heap.pages_for(static_cast<std::size_t>(ref.rows) * layout_.field_bytes(f));
    }
    if (pages > 0) region_.heap.push(first, last, pages);
  }

  void publish_resident() noexcept {
    resident_.store(reservoir_.size() + delivered_.size(), std::memory_order_relaxed);  // relaxed: statistics
  }

  // ---- counters for stats() (any thread) ----

  void count_dropped(std::uint64_t n) noexcept { dropped_.fetch_add(n, std::memory_order_relaxed); }  // relaxed: statistics
  void count_evicted(std::uint64_t n) noexcept { evicted_.fetch_add(n, std::memory_order_relaxed); }  // relaxed: statistics
  // relaxed: independent monotone counters; a snapshot of them need not be atomic.
  std::uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  std::uint64_t evicted() const noexcept { return evicted_.load(std::memory_order_relaxed); }
  std::uint64_t resident() const noexcept { return resident_.load(std::memory_order_relaxed); }
  std::uint64_t starved_fills() const noexcept { return starved_.load(std::memory_order_relaxed); }

 private:
  const BufferConfig& config_;
  const ExampleLayout& layout_;
  const RegionView region_;
  BatchPool& pool_;
  ReadyQueue& ready_;
  const std::atomic<bool>& stop_;
  const SnapshotDesk& desk_;
  const EchoCounts echoes_;

  Reservoir reservoir_;
  DeliveredPool delivered_;  // auto echo: the examples delivered that have echoes left
  Rng rng_;
  OrderedIntake ordered_;
  const std::size_t full_;
  std::vector<std::size_t> values_hint_;  // per ragged field: the last batch's value bytes
  std::vector<std::uint64_t> released_;   // keys of the examples freed since the last batch
  std::vector<std::uint64_t> unheld_;     // owners of the held values freed since the last batch

  alignas(kCacheLine) std::atomic<std::uint64_t> dropped_{0};
  std::atomic<std::uint64_t> evicted_{0};
  std::atomic<std::uint64_t> resident_{0};
  std::atomic<std::uint64_t> starved_{0};
};

}  // namespace dataecho
