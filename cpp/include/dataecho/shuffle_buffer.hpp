// The echo-aware shuffle buffer: producers -> slots -> reservoir -> batches -> consumer.
//
//  1. A producer (producer.hpp) pops a free slot index from the free ring, copies
//     one example into the slot, and pushes the index to the committed ring. The
//     rings and slots live in a region (region.hpp), private to this process or
//     in shared memory mapped by worker processes, which then produce too.
//  2. The assembler thread (one, native; assembler.hpp) pops committed slots into
//     the reservoir, giving each an echo count floor(e) + Bernoulli(e - floor(e)),
//     in arrival order or, deterministic, in sequence order (ordered_intake.hpp).
//  3. For each batch it draws resident examples uniformly without replacement,
//     copies each into the batch (the gather) and decrements its count; a slot
//     whose count reaches zero goes back to the free ring at once. How many
//     examples it takes in before a draw, and which it draws, is the policy:
//     fixed_policy.hpp, or auto_policy.hpp for echo_factor="auto".
//  4. Finished batches wait in a ReadyQueue of depth `prefetch`, so the
//     consumer's next() is a pop.
//
// Ragged fields' values live in the region's page heap (page_heap.hpp), taken
// by the producer with its slot and given back with it; when a producer waits
// for pages, the assembler draws from what is resident instead of waiting to
// fill the reservoir (Assembler::fill), since only draws free pages.
//
// This file keeps what the policies share: the region, the batch pool, the
// ready queue and the assembler thread, with the producers' and the consumer's
// entry points. Checkpoints are checkpoint.hpp.
//
// Wake-ups: slots freed during a gather are pushed to the free ring at once (a
// spinning producer takes them) but sleeping producers are woken once per
// batch, not once per slot: a futex wake is a system call, and on a virtual
// machine an IPI.
//
// Memory bound: capacity slots + the page heap + (prefetch + 1) batches +
// batches the consumer keeps alive. Every slot index is at any time in exactly
// one of: the free ring, a producer's hands, the committed ring, the ordered
// intake, the reservoir; every page in one of: the heap's free stack, a
// producer's hands, the chain of an example whose slot is not free.
//
// Synchronization:
//   - slot bytes: producer's writes -> committed push (P2) -> assembler's pop (C1)
//     -> gather; assembler's gather -> free push (P2) -> producer's pop (C1).
//   - close: the header's closed flag is stored seq_cst before every EventCount
//     is notified; producers test it after raising in_flight (seq_cst), and the
//     assembler declares the input finished only after reading closed and then
//     in_flight == 0 and an empty committed ring (Assembler::input_finished).
//   - stop: stop_ is stored seq_cst before close() notifies; waits re-check it
//     seq_cst (Assembler::stop_requested).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "dataecho/assembler.hpp"
#include "dataecho/auto_policy.hpp"
#include "dataecho/batch_pool.hpp"
#include "dataecho/buffer_config.hpp"
#include "dataecho/checkpoint.hpp"
#include "dataecho/fixed_policy.hpp"
#include "dataecho/layout.hpp"
#include "dataecho/memory.hpp"
#include "dataecho/producer.hpp"
#include "dataecho/ready_queue.hpp"
#include "dataecho/region.hpp"
#include "dataecho/shared_memory.hpp"
#include "dataecho/snapshot.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

class ShuffleBuffer {
 public:
  // `cache`: where a private region's memory comes from and goes back to, for
  // the next buffer of the same size (see BlockCache); none: allocated and freed.
  ShuffleBuffer(ExampleLayout layout, const BufferConfig& config, std::shared_ptr<BlockCache> cache = nullptr)
      : layout_(std::move(layout)),
        config_(validated(config)),
        cache_(std::move(cache)),
        region_(make_region()),
        producer_(layout_, region_),
        // The ready queue, the batch being assembled and one being handed over:
        // what a steady consumer cycles through, kept for reuse.
        pool_(BatchPool::create(layout_.batch_bytes(), layout_.batch_align(), config_.prefetch + 2, cache_)),
        ready_(config_.prefetch, config_.auto_echo ? &region_.committed->not_empty() : nullptr),
        assembler_(config_, layout_, region_, *pool_, ready_, stop_, desk_) {
    DATAECHO_CHECK(layout_.batch_size() == config_.batch_size);
    DATAECHO_CHECK(layout_.ragged_fields().empty() == (config_.pages == 0));
    DATAECHO_CHECK(config_.key_field < 0 || (static_cast<std::size_t>(config_.key_field) < layout_.fields() &&
                                             !layout_.ragged(static_cast<std::size_t>(config_.key_field)) &&
                                             layout_.field_bytes(static_cast<std::size_t>(config_.key_field)) == 8));
    // relaxed: before any producer exists. Resumed puts of resident examples
    // (numbered below next_seq) pass the intake window at once.
    if (config_.restore) region_.header->intake_seq.store(config_.restore->next_seq, std::memory_order_relaxed);
    for (std::uint32_t slot = 0; slot < config_.capacity; ++slot) poison(region_.arena.slot(slot), layout_.slot_stride());
    thread_ = std::thread([this] { assemble(); });
  }

  ShuffleBuffer(const ShuffleBuffer&) = delete;
  ShuffleBuffer& operator=(const ShuffleBuffer&) = delete;

  ~ShuffleBuffer() {
    stop();
    if (thread_.joinable()) thread_.join();
    if (shared_) shared_->unlink();
    // Producers are gone (the caller's contract) and the assembler joined: no
    // one touches the region any more.
    if (cache_) {
      try {
        cache_->give(std::move(private_));
      } catch (...) {  // out of memory for the cache's list: the region is freed instead
      }
    }
  }

  // ---- producers (any thread) ----

  // Copies one example (one pointer per field; `rows` per ragged field) into a
  // slot and commits it; `owners`: see Producer::put.
  Status put(const void* const* fields, Deadline deadline, const std::uint64_t* rows = nullptr,
             const std::uint64_t* owners = nullptr) {
    return producer_.put(fields, deadline, 0, rows, owners);
  }

  // Copies rows [done, n) of stacked per-field arrays; `done` advances as rows
  // land, so a call interrupted by a timeout can be resumed where it stopped.
  Status put_many(const void* const* fields, std::size_t n, std::size_t& done, Deadline deadline,
                  const std::uint64_t* owners = nullptr) {
    return producer_.put_many(fields, n, done, deadline, 0, owners);
  }

  // Puts with sequence numbers, claims of map-style positions (see producer.hpp).
  Producer& producer() noexcept { return producer_; }

  // End of input: puts fail from now on; iteration delivers what is left, echoes
  // included, then ends. Idempotent.
  void close() noexcept {
    region_.header->closed.store(1, std::memory_order_seq_cst);  // condition store for every waiter below
    region_.free->not_empty().notify_all();
    region_.committed->not_empty().notify_all();
    region_.header->intake_advanced.notify_all();  // producers waiting on the reorder window
    region_.header->heap.freed.notify_all();       // ... or for pages
  }

  // Abandon: like close(), but the assembler drops what is resident and exits,
  // and a waiting consumer sees the end at once.
  void stop() noexcept {
    stop_.store(true, std::memory_order_seq_cst);
    close();
    ready_.stop();
  }

  bool closed() const noexcept { return producer_.closed(); }

  // ---- worker processes ----

  // The shared region's name for workers to attach to ("" when private), until
  // unlink_region() removes it (once every worker has attached).
  std::string region_name() const { return shared_ && shared_->linked() ? shared_->name() : std::string(); }
  void unlink_region() noexcept {
    if (shared_) shared_->unlink();
  }

  // Positions [begin, end) of a map-style order, to be claimed by producers.
  void set_index_range(std::uint64_t begin, std::uint64_t end) noexcept {
    // relaxed: set before any producer starts (process creation orders it).
    region_.header->next_index.store(begin, std::memory_order_relaxed);
    region_.header->index_end.store(end, std::memory_order_relaxed);
  }

  // (produced, busy_ns) of worker w.
  std::pair<std::uint64_t, std::uint64_t> worker_counters(std::size_t w) const noexcept {
    const WorkerCounters& c = region_.header->workers[w];
    // relaxed: statistics.
    return {c.produced.load(std::memory_order_relaxed), c.busy_ns.load(std::memory_order_relaxed)};
  }

  // ---- consumer (one thread) ----

  // Deterministic buffers: the state before the next batch to be assembled,
  // with the batches assembled but not yet taken. Waits (until `deadline`) for
  // the assembler to finish the batch it is gathering. kClosed once stopped.
  Status snapshot(Snapshot& out, Deadline deadline) {
    DATAECHO_CHECK(config_.deterministic);
    if (stop_.load(std::memory_order_relaxed)) return Status::kClosed;  // relaxed: polled
    desk_.request();
    ready_.poke();                                 // an assembler waiting for room
    region_.committed->not_empty().notify_all();  // ... or for input
    bool exited = false;
    if (!desk_.wait(out, exited, deadline)) return Status::kTimeout;
    if (exited) {
      if (stop_.load(std::memory_order_relaxed)) return Status::kClosed;  // relaxed: polled
      out = Snapshot{};
      out.ended = true;
      out.queued = ready_.queued_seqs();
    }
    return Status::kOk;
  }

  // The next batch, kClosed at the end of the stream, or kTimeout. `out.unheld`
  // is set with kClosed too: the owners freed at the end (see Assembler::finish).
  Status next(Batch& out, Deadline deadline) {
    const auto start = Clock::now();
    const auto got = ready_.pop(out, deadline);
    // relaxed: statistics; readers tolerate a slightly stale view.
    consumer_wait_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    if (got == ReadyQueue::Pop::kTimeout) return Status::kTimeout;
    if (got == ReadyQueue::Pop::kEnd) return Status::kClosed;
    delivered_.fetch_add(out.rows, std::memory_order_relaxed);  // relaxed: statistics
    batches_.fetch_add(1, std::memory_order_relaxed);           // relaxed: statistics
    return Status::kOk;
  }

  BufferStats stats() const {
    // relaxed: independent counters, each monotone; a snapshot need not be atomic.
    BufferStats s;
    s.fresh = region_.header->fresh.load(std::memory_order_relaxed);
    s.delivered = delivered_.load(std::memory_order_relaxed);
    s.batches = batches_.load(std::memory_order_relaxed);
    s.dropped = assembler_.dropped();
    s.evicted = assembler_.evicted();
    s.resident = assembler_.resident();
    s.free_slots = free_slots();
    s.batch_blocks = pool_->allocated();
    s.pages = region_.heap.pages();
    s.pages_in_use = region_.heap.in_use();
    s.starved = assembler_.starved_fills();
    s.producer_wait_s = 1e-9 * static_cast<double>(region_.header->producer_wait_ns.load(std::memory_order_relaxed));
    s.consumer_wait_s = 1e-9 * static_cast<double>(consumer_wait_ns_.load(std::memory_order_relaxed));
    return s;
  }

  const ExampleLayout& layout() const noexcept { return layout_; }
  const BufferConfig& config() const noexcept { return config_; }
  std::size_t batch_blocks_adopted() const { return pool_->adopted(); }
  // Free slots right now; equals capacity once everything put has been delivered
  // (or dropped), which is how tests prove that no slot leaked.
  std::size_t free_slots() const noexcept { return region_.free->size_approx(); }

  // A block of the batch pool, for a copy of a batch (a repeat a consumer may
  // change in place): blocks come back when their last owner lets go, so
  // copies reuse memory instead of faulting in fresh pages.
  std::shared_ptr<BatchPool::Lease> lease_batch() { return pool_->lease(); }

  // Supplies batch memory from outside (page-locked, say); used before any the
  // pool would allocate. At least layout().batch_bytes() bytes, 64-byte aligned.
  void adopt_batch_memory(Block block) { pool_->adopt(std::move(block)); }

 private:
  // The region: heap memory, or named shared memory for worker processes.
  RegionView make_region() {
    const HeapConfig heap{config_.pages, config_.page_bytes};
    const RegionLayout where(layout_, config_.capacity, heap);
    std::byte* base;
    if (config_.shared) {
      shared_.emplace(SharedMemory::create(where.total_bytes));
      base = shared_->data();
    } else {
      const std::size_t align = std::max(where.align, kCacheLine);
      private_ = cache_ ? cache_->take(where.total_bytes, align) : Block::allocate(where.total_bytes, align);
      base = private_.data();
    }
    // The window: at most window - 1 examples wait out of order for an earlier
    // one. With the reservoir below its target (<= capacity - window - 1
    // resident), that leaves at least two free slots, one for the example
    // being waited for: intake cannot deadlock.
    const std::uint64_t window = config_.deterministic ? config_.window : 0;
    RegionView view = RegionView::create(base, layout_, config_.capacity, config_.shared, window, heap);
    if (const std::size_t per_slot = layout_.holdable_fields().size(); per_slot != 0) {
      DATAECHO_CHECK(!config_.shared);
      held_ = std::make_unique<HeldRef[]>(config_.capacity * per_slot);  // value-initialized: none held
      view.held = held_.get();
      view.held_per_slot = per_slot;
    }
    return view;
  }

  static std::uint64_t elapsed_ns(Clock::time_point start) noexcept {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }

  // The assembler thread: batch after batch until the end of the stream. A
  // snapshot is taken between batches, also while waiting for room, or in the
  // middle of filling for a batch (the policy then returns Step::kSnapshot and
  // is called again for the same batch).
  void assemble() noexcept {
    try {
      std::uint64_t k = 0;
      if (config_.restore) {
        if (!restore(assembler_, *config_.restore)) return desk_.exited();  // stopped
        k = config_.restore->batches;
      }
      for (;;) {
        bool room;
        do {
          if (desk_.wanted()) desk_.serve(capture(assembler_, k));
          room = ready_.wait_for_room(desk_.wanted_flag());
        } while (room && desk_.wanted());
        if (!room) break;  // stopped
        const Step step = config_.auto_echo ? assemble_auto(assembler_, k) : assemble_fixed(assembler_, k);
        if (step == Step::kEnd) break;
        if (step == Step::kBatch) ++k;
      }
    } catch (...) {
      ready_.finish(std::current_exception());
    }
    desk_.exited();
  }

  ExampleLayout layout_;
  BufferConfig config_;

  std::shared_ptr<BlockCache> cache_;   // see the constructor
  std::optional<SharedMemory> shared_;  // the region, when shared
  Block private_;                       // the region, when private
  std::unique_ptr<HeldRef[]> held_;     // the region's HeldRefs, with holdable fields
  RegionView region_;
  Producer producer_;                   // this process's puts
  std::shared_ptr<BatchPool> pool_;
  ReadyQueue ready_;
  SnapshotDesk desk_;
  alignas(kCacheLine) std::atomic<bool> stop_{false};
  Assembler assembler_;  // owned by thread_

  alignas(kCacheLine) std::atomic<std::uint64_t> delivered_{0};
  std::atomic<std::uint64_t> batches_{0};
  std::atomic<std::uint64_t> consumer_wait_ns_{0};

  std::thread thread_;  // last: starts after every member above is built
};

}  // namespace dataecho
