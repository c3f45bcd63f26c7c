// Tests of ring.hpp (and the block_until of wait.hpp over its event counts):
// single-threaded FIFO semantics, parked threads waking, and many producers
// and consumers with exactly-once delivery and per-producer order.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dataecho/memory.hpp"
#include "dataecho/ring.hpp"
#include "dataecho/wait.hpp"
#include "deliveries.hpp"
#include "harness.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::Block;
using dataecho::Deadline;
using dataecho::Ring;

// A ring in its own cache-line aligned block, as the shuffle buffer places them.
struct OwnedRing {
  explicit OwnedRing(std::size_t capacity)
      : memory(Block::allocate(Ring::bytes(capacity), dataecho::kCacheLine)),
        ring(Ring::create(memory.data(), capacity)) {}
  Block memory;
  Ring* ring;
};

// Ring::kMinCapacity is 2: with one cell, full and free share a sequence number.
const std::size_t kRingCapacities[] = {2, 4, 8, 64, 1024};

// ---------------------------------------------------------------------------
// Basic
// ---------------------------------------------------------------------------

// Single-threaded semantics: FIFO, empty and full detected, across several laps.
void check_ring_semantics(std::size_t capacity) {
  OwnedRing owned(capacity);
  Ring& r = *owned.ring;
  CHECK(r.capacity() == capacity);
  std::uint32_t v = 0;
  CHECK(!r.try_pop(v));
  std::uint32_t next_in = 0, next_out = 0;
  for (int lap = 0; lap < 4; ++lap) {
    for (std::size_t i = 0; i < capacity; ++i)
      CHECK(lap % 2 ? r.try_push_quiet(next_in++) : r.try_push(next_in++));
    CHECK_MSG(r.size_approx() == capacity, "capacity " << capacity << ": size_approx " << r.size_approx());
    CHECK_MSG(!r.try_push(0xDEADBEEF),
              "capacity " << capacity << ": try_push on a full ring succeeded (lap " << lap << ")");
    CHECK_MSG(!r.try_push_quiet(0xDEADBEEF),
              "capacity " << capacity << ": try_push_quiet on a full ring succeeded");
    for (std::size_t i = 0; i < capacity; ++i) {
      CHECK(r.try_pop(v));
      CHECK_MSG(v == next_out, "capacity " << capacity << ": popped " << v << ", expected " << next_out);
      ++next_out;
    }
    CHECK(!r.try_pop(v));
    CHECK(r.size_approx() == 0);
  }
  // Half-full wrap-around: positions cross every cell many times.
  const std::size_t half = capacity / 2;  // leaves room for the push below
  for (std::size_t i = 0; i < half; ++i) CHECK(r.try_push(next_in++));
  for (std::size_t i = 0; i < 5 * capacity + 3; ++i) {
    CHECK(r.try_push(next_in++));
    CHECK(r.try_pop(v) && v == next_out++);
  }
  CHECK(r.size_approx() == half);
}

// ---------------------------------------------------------------------------
// Blocking: block_until over the ring's event counts
// ---------------------------------------------------------------------------

// A consumer parked on an empty ring (the sleep outlasts spin and yield) wakes on a push.
void check_parked_consumer_wakes() {
  OwnedRing owned(4);
  Ring& r = *owned.ring;
  // Polled only to see that the consumer has not woken yet; `got` is read after
  // join, which orders it, so the release/acquire pair is not load-bearing.
  std::atomic<bool> woke{false};
  std::uint32_t got = 0;
  Threads threads([&] { (void)r.try_push(0); });  // on a failed CHECK: let it return
  threads.spawn([&] {
    block_until(r.not_empty(), Deadline::never(), [&] { return r.try_pop(got); });
    woke.store(true, std::memory_order_release);
  });
  sleep_ms(30);
  CHECK(!woke.load(std::memory_order_acquire));
  CHECK(r.try_push(42));
  threads.join();
  CHECK(got == 42);
}

// A producer parked on a full ring wakes on a pop, and its value lands last.
void check_parked_producer_wakes() {
  OwnedRing owned(4);
  Ring& r = *owned.ring;
  for (std::uint32_t i = 0; i < 4; ++i) CHECK(r.try_push(i));
  std::atomic<bool> pushed{false};  // as `woke` above: polled for "not yet"; join orders the rest
  Threads threads([&] {
    std::uint32_t drop = 0;
    (void)r.try_pop(drop);
  });
  threads.spawn([&] {
    block_until(r.not_full(), Deadline::never(), [&] { return r.try_push(99); });
    pushed.store(true, std::memory_order_release);
  });
  sleep_ms(30);
  CHECK(!pushed.load(std::memory_order_acquire));
  std::uint32_t v = 0;
  CHECK(r.try_pop(v) && v == 0);
  threads.join();
  for (std::uint32_t want : {1u, 2u, 3u, 99u}) CHECK(r.try_pop(v) && v == want);
}

// Several parked consumers: notify_all wakes every one that gets a value.
void check_notify_all_wakes_every_sleeper() {
  OwnedRing owned(8);
  Ring& r = *owned.ring;
  std::atomic<std::uint32_t> sum{0};
  Threads threads([&] {
    for (int i = 0; i < 4; ++i) (void)r.try_push(0);
  });
  for (int t = 0; t < 4; ++t)
    threads.spawn([&] {
      std::uint32_t v = 0;
      block_until(r.not_empty(), Deadline::never(), [&] { return r.try_pop(v); });
      sum.fetch_add(v, std::memory_order_relaxed);  // relaxed: read after join
    });
  sleep_ms(30);
  for (std::uint32_t v = 1; v <= 4; ++v) CHECK(r.try_push(v));
  threads.join();
  CHECK(sum.load() == 10);
}

// A timed wait on an empty ring gives up at its deadline, not before.
void check_timed_wait_gives_up() {
  OwnedRing owned(2);
  Ring& r = *owned.ring;
  std::uint32_t v = 0;
  const auto start = Clock::now();
  CHECK(!block_until(r.not_empty(), Deadline::after_seconds(0.03), [&] { return r.try_pop(v); }));
  const double waited = seconds_since(start);
  CHECK_MSG(waited >= 0.03 && waited < 5, "waited " << waited << " s for a 0.03 s deadline");
  CHECK(!block_until(r.not_empty(), Deadline::now(), [&] { return r.try_pop(v); }));
}

// ---------------------------------------------------------------------------
// Stress: P producers x C consumers
// ---------------------------------------------------------------------------

struct RingRun {
  std::uint32_t producers;
  std::uint32_t consumers;
  std::size_t capacity;
  bool spin;  // try_push/try_pop retry loops instead of block_until
};

constexpr std::uint32_t kProducerShift = 28;  // value = producer << 28 | sequence
constexpr std::uint32_t kSequenceMask = (1u << kProducerShift) - 1;
constexpr std::uint32_t kStopValue = 0xFFFFFFFFu;  // producer 15: never a real producer

void backoff(unsigned& attempt) {
  if (++attempt < 32)
    dataecho::cpu_relax();
  else
    std::this_thread::yield();
}

void push_value(Ring& r, bool spin, std::uint32_t value) {
  if (spin) {
    for (unsigned attempt = 0; !r.try_push(value);) backoff(attempt);
  } else {
    block_until(r.not_full(), Deadline::never(), [&] { return r.try_push(value); });
  }
}

std::uint32_t pop_value(Ring& r, bool spin) {
  std::uint32_t v = 0;
  if (spin) {
    for (unsigned attempt = 0; !r.try_pop(v);) backoff(attempt);
  } else {
    block_until(r.not_empty(), Deadline::never(), [&] { return r.try_pop(v); });
  }
  return v;
}

// What one consumer saw; items are numbered producer * per_producer + sequence.
struct RingConsumerLog {
  explicit RingConsumerLog(std::size_t items) : deliveries(items) {}
  Deliveries deliveries;
  std::uint64_t out_of_order = 0;
  std::uint64_t bad_values = 0;
};

// Pops until a stop value, logging every value.
void consume_ring(Ring& r, const RingRun& run, std::uint32_t per_producer, RingConsumerLog& log) {
  std::vector<std::int64_t> last(run.producers, -1);
  for (;;) {
    const std::uint32_t v = pop_value(r, run.spin);
    if (v == kStopValue) return;
    const std::uint32_t p = v >> kProducerShift, seq = v & kSequenceMask;
    if (p >= run.producers || seq >= per_producer) {
      ++log.bad_values;
      continue;
    }
    // A consumer's pops take increasing positions, as do a producer's
    // pushes, so each consumer sees each producer's sequence increase.
    if (static_cast<std::int64_t>(seq) <= last[p]) ++log.out_of_order;
    last[p] = seq;
    log.deliveries.record(std::size_t{p} * per_producer + seq);
  }
}

// Moves `per_producer` tagged values from every producer through the ring, then
// one stop value per consumer; checks exactly-once delivery and per-producer order.
void run_ring(const RingRun& run, std::uint32_t per_producer) {
  OwnedRing owned(run.capacity);
  Ring& r = *owned.ring;
  const std::size_t total = std::size_t{run.producers} * per_producer;
  std::vector<RingConsumerLog> logs(run.consumers, RingConsumerLog(total));
  {
    Threads consumers;
    for (std::uint32_t c = 0; c < run.consumers; ++c)
      consumers.spawn([&, c] { consume_ring(r, run, per_producer, logs[c]); });
    {
      Threads producers;
      for (std::uint32_t p = 0; p < run.producers; ++p)
        producers.spawn([&, p] {
          for (std::uint32_t seq = 0; seq < per_producer; ++seq) push_value(r, run.spin, p << kProducerShift | seq);
        });
    }
    // Every value is in (or through) the ring now, so the stop values come last.
    for (std::uint32_t c = 0; c < run.consumers; ++c) push_value(r, run.spin, kStopValue);
  }

  Deliveries all(total);
  std::uint64_t disorder = 0, bad = 0;
  for (const RingConsumerLog& log : logs) {
    all.add(log.deliveries);
    disorder += log.out_of_order;
    bad += log.bad_values;
  }
  const Tally t = all.tally(Times::exactly(1));
  std::uint32_t leftover = 0;
  CHECK_MSG(t.ok() && disorder == 0 && bad == 0 && !r.try_pop(leftover),
            run.producers << "P x " << run.consumers << "C, capacity " << run.capacity
                          << (run.spin ? ", spinning" : ", blocking") << ": lost " << t.lost << ", duplicated "
                          << t.too_many << ", out of order " << disorder << ", bad values " << bad
                          << (t.ok() ? std::string()
                                     : ", first wrong item producer " + std::to_string(t.first_wrong / per_producer) +
                                           " seq " + std::to_string(t.first_wrong % per_producer)));
}

}  // namespace

std::string test_ring_basic() {
  std::string failed;
  for (std::size_t capacity : kRingCapacities) {
    try {
      check_ring_semantics(capacity);
    } catch (const TestFailure&) {
      failed += " " + std::to_string(capacity);
    }
  }
  CHECK_MSG(failed.empty(), "ring semantics fail for capacities" << failed);
  return "FIFO, empty/full and wrap-around for capacities 2..1024";
}

std::string test_ring_blocking() {
  check_parked_consumer_wakes();
  check_parked_producer_wakes();
  check_notify_all_wakes_every_sleeper();
  check_timed_wait_gives_up();
  return "parked consumer/producer wake, notify_all to 4 sleepers, timed wait";
}

std::string test_ring_stress() {
  std::vector<RingRun> runs;
  for (std::size_t capacity : kRingCapacities)
    for (std::uint32_t producers : {1u, 4u, 8u})
      for (std::uint32_t consumers : {1u, 4u}) runs.push_back({producers, consumers, capacity, false});
  for (RingRun spin : {RingRun{1, 1, 2, true}, RingRun{4, 1, 8, true}, RingRun{8, 4, 64, true},
                       RingRun{1, 4, 1024, true}, RingRun{8, 1, 1024, true}, RingRun{4, 4, 4, true}})
    runs.push_back(spin);

  const std::uint64_t per_run = std::max<std::uint64_t>(800, g_options.items / runs.size());
  std::uint64_t moved = 0;
  std::size_t done = 0;
  for (const RingRun& run : runs) {
    const auto per_producer =
        static_cast<std::uint32_t>(std::min<std::uint64_t>(per_run / run.producers, kSequenceMask));
    run_ring(run, per_producer);
    moved += std::uint64_t{per_producer} * run.producers;
    ++done;
  }
  std::ostringstream s;
  s << done << " runs (P in {1,4,8} x C in {1,4} x 5 capacities blocking, 6 spinning), " << moved
    << " values, ~" << per_run << " per run";
  return s.str();
}

}  // namespace dataecho_test
