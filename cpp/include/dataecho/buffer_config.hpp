// A shuffle buffer's configuration, its limits and its counters.
//
// Arguments are validated, with messages that name them, by the Python layer;
// validated() here is the memory-safety backstop and aborts on a violation.
#pragma once

#include <algorithm>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dataecho/config.hpp"
#include "dataecho/page_heap.hpp"
#include "dataecho/ring.hpp"
#include "dataecho/snapshot.hpp"

namespace dataecho {

// Slots per buffer: a slot index is a 32-bit ring value.
inline constexpr std::size_t kMaxCapacity = Ring::kMaxCapacity;
// Echo factors are below 2**32: an echo count is a 32-bit number.
inline constexpr double kMaxEcho = 4294967296.0;

struct BufferConfig {
  std::size_t capacity = 4096;
  std::size_t batch_size = 256;
  double echo_factor = 1.0;  // fixed: each example is delivered floor(e) or floor(e) + 1 times
  bool auto_echo = false;    // instead: repeat only while the consumer would wait (see auto_policy.hpp)
  double max_echo = 4.0;     // auto: per-example budget, drawn like a fixed factor
  std::uint64_t echo_gap = 1;  // auto: an example delivered in batch k is repeated from batch k + echo_gap on
  // Auto: repeat only while the consumer is blocked in next(), not as soon as
  // the ready queue runs empty: for a consumer that reads the input itself
  // between its batches (num_workers=0), and so is not waiting then.
  bool paced = false;
  std::uint64_t seed = 0;
  bool drop_last = false;
  std::size_t prefetch = 2;
  std::size_t initial = 0;  // 0: see default_initial()
  bool shared = false;      // the region in named shared memory, for worker processes
  // Deterministic intake: examples enter the reservoir in the order of the
  // sequence numbers their puts carry (0, 1, 2, ...), and the fractional part of
  // the echo factor is spread by sequence number, so the output depends on the
  // seed and the input alone, not on how many producers there are or their
  // timing. Not with auto_echo, which depends on timing by design.
  bool deterministic = false;
  // Deterministic intake: how far beyond the next number the reservoir takes
  // in a producer may put (its read-ahead); 0: batch_size. The reservoir then
  // holds at most capacity - window examples, so that the examples waiting
  // out of order always leave a slot for the one waited for.
  std::size_t window = 0;
  // Echo counts by sequence number (as in deterministic mode, see EchoCounts),
  // without reordering intake: the number of deliveries of n examples is then
  // exact, which data-parallel ranks need to yield equally many batches.
  bool exact_echo = false;
  // Draws in intake order instead of at random (a FIFO): with deterministic
  // intake and an echo factor of 1, batches hold the examples in sequence order.
  bool in_order = false;
  // The page heap for ragged fields' values: `pages` pages of `page_bytes` (a
  // power of two from 64 B to 1 MiB); none (0) without ragged fields.
  std::size_t pages = 0;
  std::size_t page_bytes = 0;
  // A fixed 8-byte field holding a key per example (the Python layer's handle
  // on the example's Python objects), or -1: keys of examples whose slots are
  // freed are reported with the next batch (Batch::released).
  std::int64_t key_field = -1;
  // Fixed fields of at least this many bytes per example are holdable: a put
  // may hand their values over by reference (layout.hpp). 0: none; private
  // regions only (the binding applies it, when it builds the layout).
  std::size_t hold_min_bytes = 0;
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
  std::uint64_t free_slots = 0;    // slots free now: capacity once everything put was delivered
  std::uint64_t batch_blocks = 0;  // batch blocks the pool allocated (adopted ones not counted)
  std::uint64_t pages = 0;         // pages of the heap for ragged values (0: none)
  std::uint64_t pages_in_use = 0;  // ... held by resident examples (and puts under way)
  std::uint64_t starved = 0;       // fills cut short because producers waited for pages
  double producer_wait_s = 0;   // summed over producers: blocked waiting for a free slot
  double consumer_wait_s = 0;   // consumer blocked waiting for a batch
};

// Default for `initial`: a quarter of the buffer, at least one batch, so that
// training starts long before a large buffer has filled.
inline std::size_t default_initial(std::size_t capacity, std::size_t batch_size) noexcept {
  const std::size_t quarter = capacity / 4;
  return quarter > batch_size ? quarter : batch_size;
}

// Checks the configuration before any member of the buffer uses it; fills in `initial`.
inline BufferConfig validated(BufferConfig config) {
  DATAECHO_CHECK(config.capacity >= 1 && config.capacity <= kMaxCapacity);
  DATAECHO_CHECK(config.batch_size >= 1 && config.batch_size <= config.capacity);
  DATAECHO_CHECK(config.prefetch >= 1);
  DATAECHO_CHECK(config.echo_factor >= 1.0 && config.echo_factor < kMaxEcho);
  DATAECHO_CHECK(config.max_echo >= 1.0 && config.max_echo < kMaxEcho);
  DATAECHO_CHECK(config.echo_gap >= 1);
  DATAECHO_CHECK(!((config.deterministic || config.exact_echo) && config.auto_echo));
  // Deterministic intake: up to window - 1 examples wait out of order beside
  // the resident ones (at most capacity - window): both must fit, and a batch.
  if (config.deterministic && config.window == 0) config.window = config.batch_size;
  DATAECHO_CHECK(!config.deterministic ||
                 (config.window >= config.batch_size && config.capacity >= config.batch_size + config.window));
  DATAECHO_CHECK(!config.in_order || (config.deterministic && config.echo_factor == 1.0 && !config.auto_echo));
  DATAECHO_CHECK(config.pages <= kMaxPages);
  if (config.restore) {
    const Snapshot& s = *config.restore;
    DATAECHO_CHECK(config.deterministic && s.seqs.size() == s.echoes.size() && s.seqs.size() <= config.capacity &&
                   s.available <= s.seqs.size());
    for (std::uint32_t echoes : s.echoes) DATAECHO_CHECK(echoes >= 1);
  }
  if (config.initial == 0) config.initial = default_initial(config.capacity, config.batch_size);
  if (config.initial > config.capacity) config.initial = config.capacity;
  if (config.deterministic) config.initial = std::min(config.initial, config.capacity - config.window);
  return config;
}

}  // namespace dataecho
