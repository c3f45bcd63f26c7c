// The producer side of a shuffle buffer: take a free slot, copy one example in,
// commit it. Works on a RegionView, so the same code runs in the process that
// owns the buffer and in worker processes that mapped its region.
//
// An example with ragged fields also takes every page its values need from the
// page heap (page_heap.hpp) in one step, after its slot, before copying: a
// producer never holds part of what it needs while waiting for the rest, so
// two producers cannot each hold half of the last pages.
//
// Synchronization (with the assembler, shuffle_buffer.hpp):
//   - slot bytes: the copy into the slot happens-before the committed push (P2),
//     which pairs with the assembler's pop (C1); the assembler's gather
//     happens-before its free push, which pairs with our pop.
//   - close: (I1) raise in_flight before testing closed; (I2) lower it after the
//     last push. close() stores closed before reading anything, and the
//     assembler reads closed, then in_flight, then the ring: all seq_cst, so in
//     the single order either a put sees closed and takes no slot, or the
//     assembler sees its in_flight and waits for it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "dataecho/layout.hpp"
#include "dataecho/region.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

class Producer {
 public:
  Producer(ExampleLayout layout, RegionView region) : layout_(std::move(layout)), region_(region) {}

  // Copies one example (one pointer per field) into a slot and commits it,
  // tagged with sequence number `seq` (its position in the input, for
  // deterministic intake; ignored otherwise). `rows`: the row count of each
  // ragged field, in order (none without ragged fields); every example's
  // values must fit in the page heap (see fits()). `owners`: one handle per
  // holdable field (layout.hpp): a value whose handle is not 0 is held by
  // reference, not copied, and must stay unchanged until the handle comes
  // back with a batch (Batch::unheld); none: every value is copied.
  Status put(const void* const* fields, Deadline deadline, std::uint64_t seq = 0,
             const std::uint64_t* rows = nullptr, const std::uint64_t* owners = nullptr) {
    std::size_t done = 0;
    return put_rows(fields, rows, 1, done, deadline, Rows::kOne, seq, owners);
  }

  // Copies rows [done, n) of stacked per-field arrays, row i tagged first_seq + i;
  // `done` advances as rows land, so a call interrupted by a timeout can be
  // resumed where it stopped.
  // No ragged fields. `owners`: as put()'s, one per holdable field for every row.
  Status put_many(const void* const* fields, std::size_t n, std::size_t& done, Deadline deadline,
                  std::uint64_t first_seq = 0, const std::uint64_t* owners = nullptr) {
    DATAECHO_CHECK(layout_.ragged_fields().empty());
    return put_rows(fields, nullptr, n, done, deadline, Rows::kStacked, first_seq, owners);
  }

  // Same, for rows given one pointer per field each, row-major: row i's fields
  // are rows[i * F], ..., rows[i * F + F - 1] for F fields. For examples that
  // are not stacked: gathered by index from a source, or one array each.
  // `lengths`: row i's ragged fields have lengths[i * R], ..., lengths[i * R + R - 1]
  // rows, for R ragged fields (none without them). `owners`: as put()'s, row
  // i's at owners[i * H], ..., for H holdable fields (none: all copied).
  Status put_each(const void* const* rows, std::size_t n, std::size_t& done, Deadline deadline,
                  std::uint64_t first_seq = 0, const std::uint64_t* lengths = nullptr,
                  const std::uint64_t* owners = nullptr) {
    return put_rows(rows, lengths, n, done, deadline, Rows::kEach, first_seq, owners);
  }

  // Write-into: the caller writes an example's fixed fields straight into a
  // slot, with no copy of its own (no ragged fields; nothing held):
  //   begin(); then per example reserve(seq) -> slot_data(slot), written by
  //   the caller, then commit(slot, seq) or cancel(slot); end() once.
  // Between begin() and end() a put is in flight (I1/I2), so a close() waits
  // for the examples being written. commit() publishes as put does (P2).
  void begin() noexcept { region_.header->in_flight.fetch_add(1, std::memory_order_seq_cst); }  // (I1)

  void end() noexcept {
    region_.committed->not_empty().notify_all();
    RegionHeader& h = *region_.header;
    // (I2) seq_cst, as at the end of put_rows.
    if (h.in_flight.fetch_sub(1, std::memory_order_seq_cst) == 1 && h.closed.load(std::memory_order_seq_cst))
      region_.committed->not_empty().notify_all();
  }

  // Waits for the window to reach `seq` and for a free slot, as put does.
  Status reserve(std::uint64_t seq, std::uint32_t& slot, Deadline deadline) {
    DATAECHO_CHECK(layout_.ragged_fields().empty());
    const auto wake = [this] { region_.committed->not_empty().notify_all(); };
    if (region_.header->window != 0) {
      const Status status = wait_for_window(seq, deadline, wake);
      if (status != Status::kOk) return status;
    }
    return acquire_slot(slot, deadline, wake);
  }

  std::byte* slot_data(std::uint32_t slot) noexcept { return region_.arena.slot(slot); }

  void commit(std::uint32_t slot, std::uint64_t seq) noexcept {
    // The caller's stores are ordinary ones, but it may have streamed (NumPy's
    // large copies do): fenced, so that the push's release orders them all.
    stream_fence();
    if (HeldRef* refs = region_.refs(slot))  // its values are in the slot, none held
      for (std::size_t h = 0; h < layout_.holdable_fields().size(); ++h) refs[h] = HeldRef{nullptr, 0};
    region_.slot_seq[slot] = seq;  // published with the slot by the push below
    // relaxed: ordered by the commit's release (P2), as in put_rows.
    region_.header->fresh.fetch_add(1, std::memory_order_relaxed);
    DATAECHO_CHECK(region_.committed->try_push_quiet(slot));  // never full: see put_rows
    region_.committed->not_empty().notify_all();
  }

  void cancel(std::uint32_t slot) noexcept { give_back(slot); }

  // Pages of the heap that an example with these ragged row counts takes.
  std::size_t pages_for(const std::uint64_t* lengths) const noexcept {
    std::size_t pages = 0;
    const auto& ragged = layout_.ragged_fields();
    for (std::size_t r = 0; r < ragged.size(); ++r)
      pages += region_.heap.pages_for(static_cast<std::size_t>(lengths[r]) * layout_.field_bytes(ragged[r]));
    return pages;
  }

  // Whether an example with these ragged row counts can ever be stored: its
  // values need no more pages than the heap has. Callers check before a put.
  bool fits(const std::uint64_t* lengths) const noexcept {
    const auto& ragged = layout_.ragged_fields();
    std::size_t bytes = 0;
    for (std::size_t r = 0; r < ragged.size(); ++r) {
      const std::size_t row = layout_.field_bytes(ragged[r]);
      if (lengths[r] > (kMaxExampleBytes - bytes) / row) return false;
      bytes += static_cast<std::size_t>(lengths[r]) * row;
    }
    return ragged.empty() || pages_for(lengths) <= region_.heap.pages();
  }

  // Up to `count` consecutive positions of the order: (first, how many), the
  // count 0 when all are taken. Each position goes to exactly one producer.
  std::pair<std::uint64_t, std::uint64_t> claim_range(std::uint64_t count) noexcept {
    RegionHeader& h = *region_.header;
    // relaxed: the counter only hands out distinct numbers; no data rides on
    // it. Every producer claims at most once past the end, so it cannot wrap.
    const std::uint64_t end = h.index_end.load(std::memory_order_relaxed);
    const std::uint64_t first = h.next_index.fetch_add(count, std::memory_order_relaxed);
    return {first, first < end ? std::min(count, end - first) : 0};
  }

  // Adds to worker `w`'s counters (w < kMaxWorkers).
  void record(std::size_t worker, std::uint64_t produced, std::uint64_t busy_ns) noexcept {
    if (worker >= kMaxWorkers) return;
    // relaxed: statistics.
    region_.header->workers[worker].produced.fetch_add(produced, std::memory_order_relaxed);
    region_.header->workers[worker].busy_ns.fetch_add(busy_ns, std::memory_order_relaxed);
  }

  bool closed() const noexcept { return region_.header->closed.load(std::memory_order_seq_cst) != 0; }
  const ExampleLayout& layout() const noexcept { return layout_; }
  const RegionView& region() const noexcept { return region_; }

 private:
  static std::uint64_t elapsed_ns(Clock::time_point start) noexcept {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }

  enum class Rows { kOne, kStacked, kEach };

  // Bytes of rows committed between two wake-ups of the assembler (put_rows).
  static constexpr std::size_t kWakeBytes = std::size_t{64} << 10;

  Status put_rows(const void* const* fields, const std::uint64_t* lengths, std::size_t n, std::size_t& done,
                  Deadline deadline, Rows rows, std::uint64_t first_seq, const std::uint64_t* owners) {
    RegionHeader& h = *region_.header;
    const std::size_t ragged = layout_.ragged_fields().size();
    const std::size_t holdable = layout_.holdable_fields().size();
    const bool streams = layout_.streams();
    DATAECHO_CHECK(ragged == 0 || lengths != nullptr);
    DATAECHO_CHECK(owners == nullptr || region_.held != nullptr);  // private regions only
    h.in_flight.fetch_add(1, std::memory_order_seq_cst);  // (I1)
    // Rows are committed quietly and the assembler woken once per kWakeBytes
    // (one wake-up for a batch of small rows, not one per row), and before any
    // wait here: the assembler may be what frees the slot or opens the window.
    // No wake-up is lost: each commit's seq_cst cell store precedes the
    // notify's seq_cst load of the waiter count (EventCount, wait.hpp).
    std::size_t quiet_bytes = 0;
    const auto wake = [&] {
      if (quiet_bytes == 0) return;
      quiet_bytes = 0;
      region_.committed->not_empty().notify_all();
    };
    Status status = Status::kOk;
    while (done < n) {
      const std::uint64_t seq = first_seq + (rows == Rows::kOne ? 0 : done);
      if (h.window != 0) {
        status = wait_for_window(seq, deadline, wake);
        if (status != Status::kOk) break;
      }
      std::uint32_t slot;
      status = acquire_slot(slot, deadline, wake);
      if (status != Status::kOk) break;
      const void* const* example = rows == Rows::kEach ? fields + done * layout_.fields() : fields;
      std::byte* dst = region_.arena.slot(slot);
      if (ragged != 0) {
        status = write_ragged(example, lengths + (rows == Rows::kEach ? done * ragged : 0), dst, deadline);
        if (status != Status::kOk) {
          give_back(slot);
          break;
        }
      }
      const std::uint64_t* held = owners == nullptr ? nullptr : owners + (rows == Rows::kEach ? done * holdable : 0);
      if (rows == Rows::kStacked)
        layout_.scatter_row(fields, done, dst, region_.refs(slot), held);
      else
        layout_.scatter(example, dst, region_.refs(slot), held);
      // Streaming stores are weakly ordered: fenced here, so that the push's
      // release orders them before the assembler's reads (stream_copy.hpp).
      if (streams) stream_fence();
      region_.slot_seq[slot] = seq;  // published with the slot by the push below
      // Counted before its commit: whoever has a batch holding the example
      // (commit -> assembler -> ready queue -> consumer, each step ordering the
      // next) reads a count that includes it. A loader's skip count for resume
      // is this count, so it never misses an example that was delivered.
      // relaxed: that ordering comes from the commit's release (P2).
      h.fresh.fetch_add(1, std::memory_order_relaxed);
      // Never full: it has a cell per slot, and its one popper (the assembler)
      // cannot be lapped while stalled, since that would need capacity + 1 slots.
      DATAECHO_CHECK(region_.committed->try_push_quiet(slot));
      ++done;
      quiet_bytes += layout_.example_bytes() + 1;
      if (quiet_bytes >= kWakeBytes) wake();
    }
    wake();
    // (I2) seq_cst: the condition store for the assembler's wait; our pushes are
    // ordered before it. The closed load is seq_cst so that it and close()'s
    // store are in one order with the assembler's in_flight read.
    if (h.in_flight.fetch_sub(1, std::memory_order_seq_cst) == 1 && h.closed.load(std::memory_order_seq_cst))
      region_.committed->not_empty().notify_all();
    return status;
  }

  // Deterministic intake: a put may take a slot only while its sequence number
  // is within `window` of the next one the assembler needs, so that examples
  // waiting out of order can never hold every slot (see shuffle_buffer.hpp).
  // `before_wait`: called before it blocks.
  template <class BeforeWait>
  Status wait_for_window(std::uint64_t seq, Deadline deadline, BeforeWait&& before_wait) {
    RegionHeader& h = *region_.header;
    // seq_cst: as the re-check below.
    if (seq < h.intake_seq.load(std::memory_order_seq_cst) + h.window) return Status::kOk;
    before_wait();
    bool closed = false;
    const bool ok = block_until(h.intake_advanced, deadline, [&] {
      if (h.closed.load(std::memory_order_seq_cst)) return closed = true;
      // seq_cst: the re-check load of the intake_advanced event count; pairs
      // with the assembler's store of intake_seq.
      return seq < h.intake_seq.load(std::memory_order_seq_cst) + h.window;
    });
    if (closed) return Status::kClosed;
    return ok ? Status::kOk : Status::kTimeout;
  }

  // Takes the pages of an example's ragged values (waiting for them), copies the
  // values in and writes each field's RaggedRef into the slot.
  Status write_ragged(const void* const* fields, const std::uint64_t* lengths, std::byte* slot, Deadline deadline) {
    PageHeap& heap = region_.heap;
    const std::size_t total = pages_for(lengths);
    std::uint32_t page = kNoPage;
    std::uint32_t last = kNoPage;
    if (total > 0) {
      RegionHeader& h = *region_.header;
      const auto start = Clock::now();
      const Status got = heap.pop_blocking(
          total, page, last, deadline, [&] { return h.closed.load(std::memory_order_seq_cst) != 0; },  // seq_cst: pairs with close()
          [&] { region_.committed->not_empty().notify_all(); });  // the assembler re-checks starved()
      h.producer_wait_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);  // relaxed: statistics
      if (got != Status::kOk) return got;
    }
    const auto& ragged = layout_.ragged_fields();
    std::size_t taken = 0;
    for (std::size_t r = 0; r < ragged.size(); ++r) {
      const std::size_t f = ragged[r];
      const std::size_t bytes = static_cast<std::size_t>(lengths[r]) * layout_.field_bytes(f);
      RaggedRef& ref = layout_.ref(slot, f);
      ref = RaggedRef{lengths[r], kNoPage, kNoPage};
      const auto* from = static_cast<const std::byte*>(fields[f]);
      for (std::size_t copied = 0; copied < bytes;) {
        if (ref.first == kNoPage) ref.first = page;
        const std::size_t piece = std::min(heap.page_bytes(), bytes - copied);
        std::memcpy(heap.page(page), from + copied, piece);
        copied += piece;
        ref.last = page;
        // The chain's last link leads out of it: never followed.
        if (++taken < total) page = heap.next(page);
      }
    }
    DATAECHO_CHECK(taken == total && (total == 0 || ref_last(slot) == last));
    return Status::kOk;
  }

  // The last page of the example's chain (the last non-empty ragged field's).
  std::uint32_t ref_last(const std::byte* slot) const noexcept {
    const auto& ragged = layout_.ragged_fields();
    for (std::size_t r = ragged.size(); r-- > 0;)
      if (layout_.ref(slot, ragged[r]).rows != 0 && layout_.ref(slot, ragged[r]).last != kNoPage)
        return layout_.ref(slot, ragged[r]).last;
    return kNoPage;
  }

  // A slot taken and not filled (no pages came in time) goes back to producers.
  void give_back(std::uint32_t slot) noexcept {
    if (!region_.free->try_push(slot))  // its cell may still be mid-pop by a producer a lap ahead
      block_until(region_.free->not_full(), Deadline::never(), [&] { return region_.free->try_push(slot); });
  }

  // `before_wait`: called before it blocks.
  template <class BeforeWait>
  Status acquire_slot(std::uint32_t& slot, Deadline deadline, BeforeWait&& before_wait) {
    RegionHeader& h = *region_.header;
    // seq_cst: pairs with close(); after it, no new slot is taken.
    if (h.closed.load(std::memory_order_seq_cst)) return Status::kClosed;
    if (region_.free->try_pop(slot)) return Status::kOk;
    before_wait();
    const auto start = Clock::now();
    bool got = false;
    bool closed = false;
    block_until(region_.free->not_empty(), deadline, [&] {
      if (h.closed.load(std::memory_order_seq_cst)) return closed = true;
      return got = region_.free->try_pop(slot);
    });
    h.producer_wait_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);  // relaxed: statistics
    if (got) return Status::kOk;
    return closed ? Status::kClosed : Status::kTimeout;
  }

  ExampleLayout layout_;
  RegionView region_;
};

}  // namespace dataecho
