// The echo-aware shuffle buffer: producers -> slots -> reservoir -> batches -> consumer.
//
//  1. A producer (producer.hpp) pops a free slot index from the free ring, copies
//     one example into the slot, and pushes the index to the committed ring. The
//     rings and slots live in a region (region.hpp), private to this process or
//     in shared memory mapped by worker processes, which then produce too.
//  2. The assembler thread (one, native) pops committed slots into the reservoir,
//     giving each an echo count floor(e) + Bernoulli(e - floor(e)).
//  3. For each batch it draws resident examples uniformly without replacement,
//     copies each into the batch (the gather) and decrements its count; a slot
//     whose count reaches zero goes back to `free_` at once.
//  4. Finished batches wait in a ReadyQueue of depth `prefetch`, so the
//     consumer's next() is a pop.
//
// Fill policy. Before batch k the assembler takes in committed examples until
// min(full, max(initial, batch_size) + k * batch_size) are resident: the first
// batch needs only `initial`, and the reservoir then grows by one example per
// example delivered (as in WebDataset's shuffle) until it is `full`, which is
// capacity - batch_size (at least batch_size and initial): the slots the previous batch freed
// are refilled by producers while the next batch is gathered, instead of the
// assembler waiting for the last of them. It never takes in more than the
// target, so with one producer the output order depends only on the seed and the
// input, not on thread timing. After close() and once every in-flight put has
// landed, the target drops to zero and the rest drains.
//
// Wake-ups: slots freed during a gather are pushed to free_ at once (a spinning
// producer takes them) but sleeping producers are woken once per batch, not once
// per slot: a futex wake is a system call, and on a virtual machine an IPI.
//
// Memory bound: capacity slots + (prefetch + 1) batches + batches the consumer
// keeps alive. Every slot index is at any time in exactly one of: free_, a
// producer's hands, committed_, the reservoir.
//
// Synchronization:
//   - slot bytes: producer's writes -> committed_ push (P2) -> assembler's pop (C1)
//     -> gather; assembler's gather -> free_ push (P2) -> producer's pop (C1).
//   - close: the header's closed flag is stored seq_cst before every EventCount
//     is notified; producers test it after raising in_flight (seq_cst), and the
//     assembler declares the input finished only after reading closed and then
//     in_flight == 0 and an empty committed ring (see input_finished()).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include <map>
#include <optional>
#include <string>
#include <unordered_map>

#include "dataecho/batch_pool.hpp"
#include "dataecho/config.hpp"
#include "dataecho/layout.hpp"
#include "dataecho/memory.hpp"
#include "dataecho/producer.hpp"
#include "dataecho/ready_queue.hpp"
#include "dataecho/region.hpp"
#include "dataecho/reservoir.hpp"
#include "dataecho/ring.hpp"
#include "dataecho/rng.hpp"
#include "dataecho/shared_memory.hpp"
#include "dataecho/snapshot.hpp"
#include "dataecho/wait.hpp"

namespace dataecho {

struct BufferConfig {
  std::size_t capacity = 4096;
  std::size_t batch_size = 256;
  double echo_factor = 1.0;  // fixed: each example is delivered floor(e) or floor(e) + 1 times
  bool auto_echo = false;    // instead: repeat only while the consumer would wait (see assemble_auto)
  double max_echo = 4.0;     // auto: per-example budget, drawn like a fixed factor
  std::uint64_t seed = 0;
  bool drop_last = false;
  std::size_t prefetch = 2;
  std::size_t initial = 0;  // 0: see ShuffleBuffer::default_initial
  bool shared = false;      // the region in named shared memory, for worker processes
  // Deterministic intake: examples enter the reservoir in the order of the
  // sequence numbers their puts carry (0, 1, 2, ...), and the fractional part of
  // the echo factor is spread by sequence number, so the output depends on the
  // seed and the input alone, not on how many producers there are or their
  // timing. Not with auto_echo, which depends on timing by design.
  bool deterministic = false;
  // Echo counts by sequence number (as in deterministic mode, see echoes_for),
  // without reordering intake: the number of deliveries of n examples is then
  // exact, which data-parallel ranks need to yield equally many batches.
  bool exact_echo = false;
  // Resume (deterministic only): the assembler starts from this state, once the
  // resident examples it names have been put again with their numbers.
  std::shared_ptr<const Snapshot> restore;
};

struct BufferStats {
  std::uint64_t fresh = 0;      // examples accepted by put/put_many
  std::uint64_t delivered = 0;  // examples in batches handed to the consumer
  std::uint64_t batches = 0;    // batches handed to the consumer
  std::uint64_t dropped = 0;    // echoes discarded with a short last batch (drop_last)
  std::uint64_t evicted = 0;    // auto echo: unspent budget of examples freed to make room
  std::uint64_t resident = 0;   // examples in the reservoir with echoes left
  double producer_wait_s = 0;   // summed over producers: blocked waiting for a free slot
  double consumer_wait_s = 0;   // consumer blocked waiting for a batch
};

class ShuffleBuffer {
 public:
  // Default for `initial`: a quarter of the buffer, at least one batch, so that
  // training starts long before a large buffer has filled.
  static std::size_t default_initial(std::size_t capacity, std::size_t batch_size) noexcept {
    const std::size_t quarter = capacity / 4;
    return quarter > batch_size ? quarter : batch_size;
  }

  ShuffleBuffer(ExampleLayout layout, const BufferConfig& config)
      : layout_(std::move(layout)),
        config_(validated(config, layout_)),
        echo_base_(static_cast<std::uint32_t>(std::floor(per_example_echo(config_)))),
        echo_fraction_(per_example_echo(config_) - std::floor(per_example_echo(config_))),
        region_(make_region()),
        producer_(layout_, region_),
        pool_(BatchPool::create(layout_.batch_bytes(), layout_.batch_align())),
        ready_(config_.prefetch, config_.auto_echo ? &region_.committed->not_empty() : nullptr),
        reservoir_(config_.capacity),
        rng_(config_.seed) {
    full_ = std::max({config_.batch_size, config_.capacity - config_.batch_size, config_.initial});
    // relaxed: before any producer exists. Resumed puts of resident examples
    // (numbered below next_seq) pass the intake window at once.
    if (config_.restore) region_.header->intake_seq.store(config_.restore->next_seq, std::memory_order_relaxed);
    for (std::uint32_t slot = 0; slot < config_.capacity; ++slot) poison(region_.arena.slot(slot), layout_.slot_stride());
    assembler_ = std::thread([this] { assemble(); });
  }

  ShuffleBuffer(const ShuffleBuffer&) = delete;
  ShuffleBuffer& operator=(const ShuffleBuffer&) = delete;

  ~ShuffleBuffer() {
    stop();
    if (assembler_.joinable()) assembler_.join();
    if (shared_) shared_->unlink();
  }

  // ---- producers (any thread) ----

  // Copies one example (one pointer per field) into a slot and commits it.
  Status put(const void* const* fields, Deadline deadline) { return producer_.put(fields, deadline); }

  // Copies rows [done, n) of stacked per-field arrays; `done` advances as rows
  // land, so a call interrupted by a timeout can be resumed where it stopped.
  Status put_many(const void* const* fields, std::size_t n, std::size_t& done, Deadline deadline) {
    return producer_.put_many(fields, n, done, deadline);
  }

  // End of input: puts fail from now on; iteration delivers what is left, echoes
  // included, then ends. Idempotent.
  void close() noexcept {
    region_.header->closed.store(1, std::memory_order_seq_cst);  // condition store for every waiter below
    region_.free->not_empty().notify_all();
    region_.committed->not_empty().notify_all();
    region_.header->intake_advanced.notify_all();  // producers waiting on the reorder window
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

  Producer& producer() noexcept { return producer_; }

  // (produced, busy_ns) of worker w.
  std::pair<std::uint64_t, std::uint64_t> worker_counters(std::size_t w) const noexcept {
    const WorkerCounters& c = region_.header->workers[w];
    // relaxed: statistics.
    return {c.produced.load(std::memory_order_relaxed), c.busy_ns.load(std::memory_order_relaxed)};
  }

  // ---- consumer (one thread) ----

  // Deterministic buffers: the state before the next batch to be assembled,
  // with the batches assembled but not yet taken. Waits (until `deadline`) for
  // the assembler to finish the batch it is on. kClosed once stopped.
  Status snapshot(Snapshot& out, Deadline deadline) {
    DATAECHO_CHECK(config_.deterministic);
    if (stop_.load(std::memory_order_relaxed)) return Status::kClosed;  // relaxed: polled
    desk_.request();
    ready_.poke();
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

  // The next batch, kClosed at the end of the stream, or kTimeout.
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

  BufferStats stats() const noexcept {
    // relaxed: independent counters, each monotone; a snapshot need not be atomic.
    BufferStats s;
    s.fresh = region_.header->fresh.load(std::memory_order_relaxed);
    s.delivered = delivered_.load(std::memory_order_relaxed);
    s.batches = batches_.load(std::memory_order_relaxed);
    s.dropped = dropped_.load(std::memory_order_relaxed);
    s.evicted = evicted_.load(std::memory_order_relaxed);
    s.resident = resident_.load(std::memory_order_relaxed);
    s.producer_wait_s = 1e-9 * static_cast<double>(region_.header->producer_wait_ns.load(std::memory_order_relaxed));
    s.consumer_wait_s = 1e-9 * static_cast<double>(consumer_wait_ns_.load(std::memory_order_relaxed));
    return s;
  }

  const ExampleLayout& layout() const noexcept { return layout_; }
  const BufferConfig& config() const noexcept { return config_; }
  std::size_t batch_blocks_allocated() const { return pool_->allocated(); }
  std::size_t batch_blocks_adopted() const { return pool_->adopted(); }

  // Supplies batch memory from outside (page-locked, say); used before any the
  // pool would allocate. At least layout().batch_bytes() bytes, 64-byte aligned.
  void adopt_batch_memory(Block block) { pool_->adopt(std::move(block)); }
  // Free slots right now; equals capacity once everything put has been delivered
  // (or dropped), which is how tests prove that no slot leaked.
  std::size_t free_slots() const noexcept { return region_.free->size_approx(); }

 private:
  // Checks the configuration before any member uses it; fills in `initial`.
  static BufferConfig validated(BufferConfig config, const ExampleLayout& layout) {
    DATAECHO_CHECK(config.capacity >= 1 && config.capacity <= Ring::kMaxCapacity);
    DATAECHO_CHECK(config.batch_size >= 1 && config.batch_size <= config.capacity);
    DATAECHO_CHECK(config.prefetch >= 1 && layout.batch_size() == config.batch_size);
    DATAECHO_CHECK(config.echo_factor >= 1.0 && config.echo_factor < 4294967296.0);
    DATAECHO_CHECK(config.max_echo >= 1.0 && config.max_echo < 4294967296.0);
    DATAECHO_CHECK(!((config.deterministic || config.exact_echo) && config.auto_echo));
    if (config.restore) {
      const Snapshot& s = *config.restore;
      DATAECHO_CHECK(config.deterministic && s.seqs.size() == s.echoes.size() && s.seqs.size() <= config.capacity &&
                     s.available <= s.seqs.size());
      for (std::uint32_t echoes : s.echoes) DATAECHO_CHECK(echoes >= 1);
    }
    if (config.initial == 0) config.initial = default_initial(config.capacity, config.batch_size);
    if (config.initial > config.capacity) config.initial = config.capacity;
    return config;
  }

  static double per_example_echo(const BufferConfig& config) noexcept {
    return config.auto_echo ? config.max_echo : config.echo_factor;
  }

  // The region: heap memory, or named shared memory for worker processes.
  RegionView make_region() {
    const RegionLayout where(layout_, config_.capacity);
    std::byte* base;
    if (config_.shared) {
      shared_.emplace(SharedMemory::create(where.total_bytes));
      base = shared_->data();
    } else {
      private_ = Block::allocate(where.total_bytes, std::max(where.align, kCacheLine));
      base = private_.data();
    }
    // The window: at most batch_size - 1 examples wait out of order for an
    // earlier one. With the reservoir below its target (<= capacity - batch_size
    // - 1 resident), that leaves at least two free slots, one for the example
    // being waited for: intake cannot deadlock.
    const std::uint64_t window = config_.deterministic ? config_.batch_size : 0;
    return RegionView::create(base, layout_, config_.capacity, config_.shared, window);
  }

  static std::uint64_t elapsed_ns(Clock::time_point start) noexcept {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }

  // True when no example can arrive any more: closed, no put in flight, and
  // the committed ring drained. Order matters: closed (seq_cst) then in_flight
  // (seq_cst, pairs with I1/I2 in producer.hpp) then the ring. A put that raised
  // in_flight after our read of it sees closed and takes no slot; one that
  // finished before has its pushes
  // ordered before its decrement, so the final try_pop sees them.
  bool input_finished(std::uint32_t& slot, bool& got) {
    got = false;
    if (!region_.header->closed.load(std::memory_order_seq_cst)) return false;
    if (region_.header->in_flight.load(std::memory_order_seq_cst) != 0) return false;
    got = region_.committed->try_pop(slot);
    return !got;
  }

  // Takes a committed slot in (not deterministic): at once, with an echo count
  // drawn from the RNG.
  void take_in(std::uint32_t slot) {
    std::uint32_t echoes = echo_base_;
    if (config_.exact_echo)
      echoes = echoes_for(region_.slot_seq[slot]);
    else if (echo_fraction_ > 0 && rng_.bernoulli(echo_fraction_))
      ++echoes;
    if (config_.auto_echo)
      reservoir_.add_fresh(slot, echoes);  // echoes = its budget under max_echo
    else
      reservoir_.add(slot, echoes);
  }

  // Deterministic intake: committed slots wait in pending_ and enter the
  // reservoir one at a time, in sequence order, so that how many are resident
  // at each draw depends on counts alone. Admits the next one if it has come
  // (or, once the input is over, the lowest, skipping a number whose put failed).
  bool admit_next(bool input_over) {
    if (pending_.empty()) return false;
    const auto first = pending_.begin();
    if (first->first > next_seq_ && !input_over) return false;
    reservoir_.add(first->second, echoes_for(first->first));
    next_seq_ = std::max(next_seq_, first->first + 1);
    pending_.erase(first);
    publish_intake();
    return true;
  }

  void publish_intake() noexcept {
    // seq_cst: the condition store for producers waiting on the window
    // (Producer::wait_for_window); the notify below pairs with their re-check.
    region_.header->intake_seq.store(next_seq_, std::memory_order_seq_cst);
    region_.header->intake_advanced.notify_all();
  }

  // Deterministic echo count of the example numbered `seq`: floor(e), plus one
  // for a share f = e - floor(e) of the numbers, spread evenly: exactly
  // floor(n * f) of the first n numbers get the extra echo (a Beatty sequence),
  // so the number of deliveries of n examples is known in advance.
  std::uint32_t echoes_for(std::uint64_t seq) const noexcept {
    const double f = echo_fraction_;
    const auto step = static_cast<std::uint32_t>(std::floor(static_cast<double>(seq + 1) * f) -
                                                 std::floor(static_cast<double>(seq) * f));
    return echo_base_ + step;
  }

  // Waits for the next committed slot; false once stopped or the input finished.
  bool next_committed(std::uint32_t& slot) {
    bool got = false;
    block_until(region_.committed->not_empty(), Deadline::never(), [&] {
      if (region_.committed->try_pop(slot)) return got = true;
      if (stop_.load(std::memory_order_seq_cst)) return true;
      return input_finished(slot, got) || got;
    });
    return got;
  }

  // Takes in committed examples until `target` are resident. Returns false when
  // the input finished first (the caller then drains what is resident).
  bool fill(std::size_t target) {
    while (reservoir_.size() < target) {
      if (stop_.load(std::memory_order_relaxed)) return false;  // relaxed: polled; exit is best-effort prompt
      if (config_.deterministic && admit_next(/*input_over=*/false)) continue;
      std::uint32_t slot;
      if (!next_committed(slot)) {
        if (config_.deterministic && admit_next(/*input_over=*/true)) continue;
        return false;
      }
      if (config_.deterministic)
        pending_.emplace(region_.slot_seq[slot], slot);
      else
        take_in(slot);
    }
    return true;
  }

  void assemble() noexcept {
    try {
      std::uint64_t k = 0;
      if (config_.restore) {
        if (!restore(*config_.restore)) return desk_.exited();  // stopped
        k = config_.restore->batches;
      }
      for (;; ++k) {
        bool room;
        do {  // a snapshot is taken between batches, also while waiting for room
          if (desk_.wanted()) desk_.serve(capture(k));
          room = ready_.wait_for_room(desk_.wanted_flag());
        } while (room && desk_.wanted());
        if (!room) break;  // stopped
        const bool more = config_.auto_echo ? assemble_auto(k) : assemble_fixed(k);
        if (!more) break;
      }
    } catch (...) {
      ready_.finish(std::current_exception());
    }
    desk_.exited();
  }

  // The state before batch k (see snapshot.hpp). Deterministic mode: nothing is
  // pending that is not re-read on resume (pending_ holds numbers >= next_seq_).
  Snapshot capture(std::uint64_t k) const {
    Snapshot s;
    s.batches = k;
    s.rng_state = rng_.state();
    s.next_seq = next_seq_;
    s.available = reservoir_.available();
    for (const auto& [slot, echoes] : reservoir_.contents()) {
      s.seqs.push_back(region_.slot_seq[slot]);
      s.echoes.push_back(echoes);
    }
    s.queued = ready_.queued_seqs();
    return s;
  }

  // Resume: takes in committed examples until every resident one of `s` has
  // come (later numbers wait in pending_ as usual), then rebuilds the reservoir
  // in its order, the RNG and the intake position. False if stopped first.
  bool restore(const Snapshot& s) {
    std::unordered_map<std::uint64_t, std::uint32_t> slot_of;
    while (slot_of.size() < s.seqs.size()) {
      std::uint32_t slot;
      const bool got = next_committed(slot);
      if (stop_.load(std::memory_order_relaxed)) return false;  // relaxed: polled
      if (!got) throw std::runtime_error("resume: the input ended before every resident example was put again");
      const std::uint64_t seq = region_.slot_seq[slot];
      if (seq >= s.next_seq) {
        pending_.emplace(seq, slot);
      } else if (!slot_of.emplace(seq, slot).second) {
        throw std::runtime_error("resume: example " + std::to_string(seq) + " was put twice");
      }
    }
    std::vector<std::pair<std::uint32_t, std::uint32_t>> contents;
    for (std::size_t i = 0; i < s.seqs.size(); ++i) {
      const auto found = slot_of.find(s.seqs[i]);
      if (found == slot_of.end())
        throw std::runtime_error("resume: example " + std::to_string(s.seqs[i]) + " was not put again");
      contents.emplace_back(found->second, s.echoes[i]);
    }
    reservoir_.restore(contents, s.available);
    rng_.set_state(s.rng_state);
    next_seq_ = s.next_seq;
    publish_intake();
    publish_resident();
    return true;
  }

  // Fixed echo factor: fill to the target, then draw uniformly. Returns false at the end.
  bool assemble_fixed(std::uint64_t k) {
    const std::size_t target = std::min<std::uint64_t>(
        full_, std::max(config_.initial, config_.batch_size) + k * config_.batch_size);
    const bool more_input = fill(target);
    if (stop_.load(std::memory_order_relaxed)) return false;  // relaxed: polled
    std::size_t rows = config_.batch_size;
    if (!more_input && reservoir_.echoes_left() < rows) {
      rows = static_cast<std::size_t>(reservoir_.echoes_left());
      if (rows == 0 || config_.drop_last) return finish();
    }
    Batch batch{pool_->lease(), rows, {}};
    if (config_.deterministic) batch.seqs.reserve(rows);  // one allocation per batch, not per row
    reservoir_.begin_batch();
    for (std::size_t row = 0; row < rows; ++row) gather_row(reservoir_.draw(rng_), batch, row);
    push(std::move(batch));
    return true;
  }

  // echo_factor="auto": every example may be delivered up to its budget (drawn
  // from max_echo), fresh ones first. A batch is completed with repeats only when
  // no fresh example is at hand and the consumer has drained the ready queue,
  // i.e. is about to wait; otherwise the assembler waits for fresh examples. So a
  // fast upstream yields an echo factor near 1 and a slow one near max_echo.
  // Delivered examples keep their slot until the budget is spent or producers
  // run short of free slots (then a uniformly chosen one is evicted). When the
  // input ends, the fresh ones left are delivered and nothing more is repeated.
  bool assemble_auto(std::uint64_t k) {
    bool more_input = true;
    if (k == 0) more_input = fill(std::max(config_.initial, config_.batch_size));
    if (stop_.load(std::memory_order_relaxed)) return false;  // relaxed: polled
    reservoir_.begin_batch();
    make_room();
    Batch batch{pool_->lease(), 0, {}};
    std::size_t row = 0;
    std::uint32_t slot;
    bool got = false;
    while (row < config_.batch_size) {
      if (reservoir_.fresh() > 0) {
        gather_row(reservoir_.draw_fresh(rng_), batch, row++);
        continue;
      }
      if (got || region_.committed->try_pop(slot)) {
        take_in(slot);
        got = false;
        continue;
      }
      if (more_input && input_finished(slot, got)) more_input = false;
      if (got) continue;
      if (!more_input) break;
      if (reservoir_.size() > 0 && ready_.size() == 0) {
        gather_row(reservoir_.draw_seen(rng_), batch, row++);  // the consumer is waiting: echo
        continue;
      }
      block_until(region_.committed->not_empty(), Deadline::never(), [&] {
        if (region_.committed->try_pop(slot)) return got = true;
        if (stop_.load(std::memory_order_seq_cst)) return true;
        if (reservoir_.size() > 0 && ready_.size() == 0) return true;  // the consumer drained it
        return input_finished(slot, got) || got;
      });
      if (stop_.load(std::memory_order_relaxed)) return false;  // relaxed: polled
    }
    if (row == 0 || (row < config_.batch_size && config_.drop_last)) {
      // relaxed: statistics. Only never-delivered examples count as dropped.
      dropped_.fetch_add(row, std::memory_order_relaxed);
      return finish();
    }
    batch.rows = row;
    push(std::move(batch));
    if (!more_input && reservoir_.fresh() == 0) return finish();
    return true;
  }

  // Auto echo: frees delivered examples, uniformly chosen, until producers
  // have a batch's worth of free slots or no delivered example is left.
  void make_room() {
    std::uint64_t evicted = 0;
    while (reservoir_.size() > reservoir_.fresh() && region_.free->size_approx() < config_.batch_size) {
      const auto [slot, echoes] = reservoir_.evict_seen(rng_);
      evicted += echoes;
      release_slot(slot);
    }
    if (evicted == 0) return;
    evicted_.fetch_add(evicted, std::memory_order_relaxed);  // relaxed: statistics
    region_.free->not_empty().notify_all();
  }

  void gather_row(Reservoir::Draw draw, Batch& batch, std::size_t row) {
    layout_.gather(region_.arena.slot(draw.slot), batch.lease->data(), row);
    if (config_.deterministic) batch.seqs.push_back(region_.slot_seq[draw.slot]);  // for snapshots
    if (draw.last) release_slot(draw.slot);
  }

  void push(Batch batch) {
    region_.free->not_empty().notify_all();  // one wake-up for the slots this batch freed
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
  void release_slot(std::uint32_t slot) noexcept {
    poison(region_.arena.slot(slot), layout_.slot_stride());
    if (region_.free->try_push_quiet(slot)) return;
    block_until(region_.free->not_full(), Deadline::never(), [&] { return region_.free->try_push_quiet(slot); });
  }

  // End of the stream: what is resident is not needed any more.
  bool finish() {
    // relaxed: statistics. With auto echo, unspent budget is not a loss.
    if (!config_.auto_echo) dropped_.fetch_add(reservoir_.echoes_left(), std::memory_order_relaxed);
    reservoir_.clear([this](std::uint32_t slot) { release_slot(slot); });
    region_.free->not_empty().notify_all();
    publish_resident();
    ready_.finish();
    return false;
  }

  void publish_resident() noexcept {
    resident_.store(reservoir_.size(), std::memory_order_relaxed);  // relaxed: statistics
  }

  ExampleLayout layout_;
  BufferConfig config_;
  const std::uint32_t echo_base_;
  const double echo_fraction_;
  std::size_t full_ = 0;  // steady-state fill target

  std::optional<SharedMemory> shared_;  // the region, when shared
  Block private_;                       // the region, when private
  RegionView region_;
  Producer producer_;                   // this process's puts
  std::shared_ptr<BatchPool> pool_;
  ReadyQueue ready_;

  // Assembler-owned.
  Reservoir reservoir_;
  Rng rng_;
  std::uint64_t next_seq_ = 0;                         // deterministic intake: next number taken in
  std::multimap<std::uint64_t, std::uint32_t> pending_;  // ... and those that came early (seq -> slot)
  SnapshotDesk desk_;

  alignas(kCacheLine) std::atomic<bool> stop_{false};
  alignas(kCacheLine) std::atomic<std::uint64_t> delivered_{0};
  std::atomic<std::uint64_t> batches_{0};
  std::atomic<std::uint64_t> consumer_wait_ns_{0};
  std::atomic<std::uint64_t> dropped_{0};
  std::atomic<std::uint64_t> evicted_{0};
  std::atomic<std::uint64_t> resident_{0};

  std::thread assembler_;  // last: starts after every member above is built
};

}  // namespace dataecho
