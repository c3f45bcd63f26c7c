// Tests of shuffle_buffer.hpp's blocking and lifecycle: deadlines on put() and
// next(), close() and stop() releasing blocked producers and consumers, and
// destruction after close/stop + join, with held batches outliving the buffer.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dataecho/rng.hpp"
#include "dataecho/shuffle_buffer.hpp"
#include "deliveries.hpp"
#include "examples.hpp"
#include "harness.hpp"
#include "producers.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::Rng;

// Producers that put fresh ids (a stride each, without end) until a put fails,
// and report the failing status; the test ends the stream itself.
struct Flood {
  Flood(ShuffleBuffer& buf, std::uint32_t producers)
      : statuses(producers, Status::kOk), last_id(producers, 0), group(buf, StreamEnd::kTestEnds) {
    group.start(producers, [this, &buf, producers](std::uint32_t p, Errors&) {
      StridedIds ids(p, producers);
      for (std::uint64_t id = 0; ids.next(id);) {
        const Status st = put_id(buf, id, Deadline::never());
        if (st != Status::kOk) {
          statuses[p] = st;
          return;
        }
        // relaxed: polled as a progress counter, read exactly after join.
        accepted.fetch_add(1, std::memory_order_relaxed);
        last_id[p] = id;
      }
    });
  }
  void join() { group.join(); }
  // Upper bound on the ids accepted (valid after join).
  std::uint64_t id_limit() const { return *std::max_element(last_id.begin(), last_id.end()) + 1; }

  std::vector<Status> statuses;        // per producer, written by it alone, read after join
  std::vector<std::uint64_t> last_id;  // per producer: the last id accepted
  std::atomic<std::uint64_t> accepted{0};
  ProducerGroup group;  // last: joined before the members above are destroyed
};

// Waits until the producers are stuck in put(): no free slot and nothing
// accepted for 30 ms, long enough for them to have spun, yielded and parked.
void wait_until_blocked(const ShuffleBuffer& buf, const std::atomic<std::uint64_t>& accepted) {
  std::uint64_t last = ~0ull;
  for (int stable = 0; stable < 3;) {
    sleep_ms(10);
    const std::uint64_t now = accepted.load(std::memory_order_relaxed);  // relaxed: a progress counter
    stable = (now == last && buf.free_slots() == 0) ? stable + 1 : 0;
    last = now;
  }
}

// ---------------------------------------------------------------------------
// Timeouts
// ---------------------------------------------------------------------------

// next() on an empty (or underfilled) open buffer times out; after close() the
// few examples come as one short batch and the end is sticky.
void check_next_times_out() {
  ShuffleBuffer buf(id_layout(16), make_config(64, 16, 1.0, run_seed(5000)));
  Batch batch;
  auto start = Clock::now();
  CHECK(buf.next(batch, Deadline::after_seconds(0.05)) == Status::kTimeout);
  const double waited = seconds_since(start);
  CHECK_MSG(waited >= 0.05 && waited < 5, "next() waited " << waited << " s for a 0.05 s deadline");
  CHECK(buf.next(batch, Deadline::now()) == Status::kTimeout);
  // Fewer than `initial` examples: still no batch while open.
  for (std::uint64_t id = 0; id < 5; ++id) CHECK(put_id(buf, id, Deadline::never()) == Status::kOk);
  CHECK(buf.next(batch, Deadline::after_seconds(0.03)) == Status::kTimeout);
  buf.close();
  CHECK(put_id(buf, 99, Deadline::never()) == Status::kClosed);
  Consumer c(buf, 5);
  c.drain(buf);
  CHECK(c.batches == 1 && c.rows == 5);
  c.deliveries.expect(Times::exactly(1));
  CHECK(buf.next(batch, Deadline::never()) == Status::kClosed);  // the end is sticky
  CHECK(buf.free_slots() == 64);
}

// A put on a full buffer times out part-way, and put_many resumes where it
// stopped once a consumer runs.
void check_put_times_out_and_resumes() {
  BufferConfig config = make_config(4, 2, 1.0, run_seed(5001));
  config.prefetch = 1;
  ShuffleBuffer buf(id_layout(2), config);
  const Rows rows(iota_ids(100));
  std::size_t done = 0;
  // No consumer: slots run out, and the put gives up at its deadline.
  const auto start = Clock::now();
  CHECK(rows.put(buf, done, Deadline::after_seconds(0.05)) == Status::kTimeout);
  CHECK(seconds_since(start) >= 0.05);
  CHECK_MSG(done >= 1 && done < rows.ids.size(), "done " << done);
  CHECK(buf.stats().producer_wait_s > 0);
  CHECK(put_id(buf, 1000, Deadline::now()) == Status::kTimeout);
  Consumer c(buf, rows.ids.size());
  {
    Threads consumer([&] { buf.stop(); });
    consumer.spawn([&] {
      try {
        c.drain(buf);
      } catch (const TestFailure&) {  // reported already; the checks below fail too
      }
    });
    CHECK(rows.put(buf, done, Deadline::after_seconds(g_options.timeout_s)) == Status::kOk);
    CHECK(done == rows.ids.size());
    buf.close();
  }
  c.deliveries.expect(Times::exactly(1));
  CHECK(buf.free_slots() == 4);
}

// ---------------------------------------------------------------------------
// stop()
// ---------------------------------------------------------------------------

// Producers blocked on a full buffer (no consumer): stop() releases them.
void check_stop_releases_producers() {
  BufferConfig config = make_config(8, 4, 1.0, run_seed(7000));
  config.prefetch = 1;
  ShuffleBuffer buf(id_layout(4), config);
  Flood flood(buf, 8);
  wait_until_blocked(buf, flood.accepted);
  buf.stop();
  flood.join();
  for (Status st : flood.statuses) CHECK(st == Status::kClosed);
  Batch batch;
  CHECK(buf.next(batch, Deadline::never()) == Status::kClosed);  // queued batches are dropped
}

// A consumer blocked on an empty open buffer: stop() releases it. (Producers
// and the consumer cannot both be blocked at once: with no free slot and no
// batch, every slot would be resident, and then a batch can be made.)
void check_stop_releases_consumer() {
  ShuffleBuffer buf(id_layout(16), make_config(64, 16, 1.0, run_seed(7001)));
  // release/acquire: the early load only asks "not returned yet"; join orders the final one.
  std::atomic<int> status{-1};
  Threads consumer([&] { buf.stop(); });
  consumer.spawn([&] {
    Batch batch;
    status.store(static_cast<int>(buf.next(batch, Deadline::never())), std::memory_order_release);
  });
  sleep_ms(30);
  CHECK(status.load(std::memory_order_acquire) == -1);
  buf.stop();
  consumer.join();
  CHECK(status.load() == static_cast<int>(Status::kClosed));
  CHECK(put_id(buf, 1, Deadline::never()) == Status::kClosed);
}

// stop() at a random moment of a running stream: producers and the consumer,
// each repeatedly blocking on the other, all return. Returns rows consumed.
std::uint64_t check_stop_mid_stream(int round, Rng& rng) {
  BufferConfig config = make_config(round % 2 ? 8 : 3, round % 2 ? 4 : 2, 1.0 + round % 3, rng.next());
  config.prefetch = 1;
  ShuffleBuffer buf(id_layout(config.batch_size), config);
  std::atomic<int> consumer_status{-1};
  std::atomic<std::uint64_t> consumed{0};
  Flood flood(buf, 4);
  {
    Threads consumer([&] { buf.stop(); });
    consumer.spawn([&] {
      Batch batch;
      for (;;) {
        const Status st = buf.next(batch, Deadline::never());
        if (st != Status::kOk) {
          consumer_status.store(static_cast<int>(st), std::memory_order_release);
          return;
        }
        consumed.fetch_add(batch.rows, std::memory_order_relaxed);  // relaxed: read after join
      }
    });
    sleep_ms(1 + static_cast<int>(rng.below(20)));
    buf.stop();
  }
  flood.join();
  for (Status st : flood.statuses) CHECK(st == Status::kClosed);
  CHECK(consumer_status.load() == static_cast<int>(Status::kClosed));
  return consumed.load();
}

// ---------------------------------------------------------------------------
// Destruction
// ---------------------------------------------------------------------------

// Destroyed after close() or stop() with producers blocked (then joined), a
// batch queued, slots resident and committed, and (after close) a stream that
// still had echoes to deliver; the batch taken before stays readable.
void check_destroy_with_held_batch(bool use_stop) {
  BufferConfig config = make_config(8, 4, 2.0, run_seed(8000 + use_stop));
  config.prefetch = 2;
  auto buf = std::make_unique<ShuffleBuffer>(id_layout(4), config);
  Consumer held_reader(*buf, 1u << 20);
  Batch held;
  std::uint64_t accepted = 0;
  {
    Flood flood(*buf, 4);
    CHECK(buf->next(held, Deadline::after_seconds(g_options.timeout_s)) == Status::kOk);
    wait_until_blocked(*buf, flood.accepted);
    if (use_stop)
      buf->stop();
    else
      buf->close();
    flood.join();
    for (Status st : flood.statuses) CHECK(st == Status::kClosed);
    accepted = flood.accepted.load();
  }
  CHECK(accepted > 0);
  buf.reset();
  held_reader.take(held, false);  // payloads intact: the lease outlived the buffer
}

// Destroyed with a consumer that was released by stop() and joined.
void check_destroy_after_released_consumer() {
  auto buf = std::make_unique<ShuffleBuffer>(id_layout(4), make_config(16, 4, 1.0, run_seed(8002)));
  Threads consumer([&] { buf->stop(); });
  std::atomic<int> status{-1};  // read after join only
  consumer.spawn([&] {
    Batch batch;
    status.store(static_cast<int>(buf->next(batch, Deadline::never())), std::memory_order_release);
  });
  sleep_ms(10);
  buf->stop();
  consumer.join();
  CHECK(status.load() == static_cast<int>(Status::kClosed));
  buf.reset();
}

// Created and destroyed at once, and mid-stream with nobody inside a call:
// the assembler thread starts and stops cleanly. Returns buffers destroyed.
int check_destroy_idle(Rng& rng) {
  int destroyed = 0;
  for (int i = 0; i < 200; ++i) {
    auto buf = std::make_unique<ShuffleBuffer>(id_layout(2), make_config(4, 2, 1.5, rng.next()));
    for (std::uint64_t id = 0; id < rng.below(4); ++id) CHECK(put_id(*buf, id, Deadline::never()) == Status::kOk);
    if (i % 3 == 0) buf->close();
    buf.reset();
    ++destroyed;
  }
  return destroyed;
}

}  // namespace

std::string test_buffer_timeouts() {
  check_next_times_out();
  check_put_times_out_and_resumes();
  return "next() times out on an empty/underfilled open buffer; put times out; put_many resumes";
}

// close() with producers blocked on a full buffer: each gets kClosed, and what
// was accepted is still delivered, echoes included.
std::string test_buffer_close() {
  for (std::uint32_t producers : {1u, 4u}) {
    BufferConfig config = make_config(8, 4, 2.0, run_seed(6000 + producers));
    config.prefetch = 1;
    ShuffleBuffer buf(id_layout(4), config);
    Flood flood(buf, producers);
    wait_until_blocked(buf, flood.accepted);
    buf.close();
    flood.join();
    for (Status st : flood.statuses)
      CHECK_MSG(st == Status::kClosed, "blocked producer got status " << static_cast<int>(st));
    CHECK(buf.closed());
    Consumer c(buf, flood.id_limit());
    c.drain(buf);
    const std::uint64_t accepted = flood.accepted.load();
    // An accepted id comes with both its echoes, one never accepted not at all.
    c.deliveries.expect(Times::exactly(2).or_none(), std::to_string(producers) + " producers");
    const std::uint64_t ids = c.deliveries.items_arrived(2);
    CHECK_MSG(ids == accepted, "delivered " << ids << " distinct ids, accepted " << accepted);
    CHECK(buf.free_slots() == 8);
  }
  return "blocked producers get kClosed; everything accepted is delivered after close";
}

std::string test_buffer_stop() {
  check_stop_releases_producers();
  check_stop_releases_consumer();
  const int rounds = 12;
  Rng rng(run_seed(7002));
  std::uint64_t moved = 0;
  for (int round = 0; round < rounds; ++round) moved += check_stop_mid_stream(round, rng);
  std::ostringstream s;
  s << "stop() releases blocked producers, a blocked consumer, and " << rounds << " running streams ("
    << moved << " rows before the stops)";
  return s.str();
}

// Destruction. Legal: stop() or close(), let every thread inside put()/next()
// return (join it), then destroy. A thread still inside a call when the
// destructor runs would touch freed memory, so the test never does that; the
// destructor's own stop() only releases the assembler. Batches the consumer
// holds stay valid after the buffer is gone: their lease owns the batch pool.
std::string test_buffer_destroy() {
  int destroyed = 0;
  for (bool use_stop : {false, true}) {
    check_destroy_with_held_batch(use_stop);
    ++destroyed;
  }
  check_destroy_after_released_consumer();
  ++destroyed;
  Rng rng(run_seed(8003));
  destroyed += check_destroy_idle(rng);
  std::ostringstream s;
  s << destroyed << " buffers destroyed after close/stop + join; held batches outlive their buffer";
  return s.str();
}

}  // namespace dataecho_test
