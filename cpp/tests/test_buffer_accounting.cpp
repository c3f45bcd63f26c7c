// Tests of shuffle_buffer.hpp's accounting: every id delivered exactly as often
// as the echo factor says, under many producers, for integral and fractional
// echo, with drop_last, with a deterministic order, with map-style intake
// (claim_range + put_each) and with values held by reference.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
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

constexpr std::uint32_t kHeldProducers = 4;

// ---------------------------------------------------------------------------
// One stream: P producers, one consumer, full accounting at the end
// ---------------------------------------------------------------------------

struct BufferRun {
  std::uint32_t producers;
  std::size_t capacity;
  std::size_t batch;
  double echo;
  bool drop_last;
  std::uint64_t items;
  std::uint64_t seed;
};

std::string describe(const BufferRun& run) {
  std::ostringstream s;
  s << run.producers << " producers, capacity " << run.capacity << ", batch " << run.batch << ", echo "
    << run.echo << (run.drop_last ? ", drop_last" : "") << ", " << run.items << " ids";
  return s.str();
}

// Producer p's strided share of [0, run.items), by a seeded mix of put() and
// put_many() chunks, so that both paths race each other.
void put_share(ShuffleBuffer& buf, const BufferRun& run, std::uint32_t p, Errors& errors) {
  Rng rng(run.seed ^ (0xA5A5A5A5ull + p));
  StridedIds claims(p, run.producers, run.items);
  std::vector<std::uint64_t> ids;
  while (!claims.done()) {
    claims.take(rng.below(3) == 0 ? 1 : 1 + rng.below(48), ids);
    Status st;
    std::size_t done = 0;
    if (ids.size() == 1 && rng.below(2) == 0) {
      st = put_id(buf, ids[0], Deadline::never());
      done = st == Status::kOk;
    } else {
      st = Rows(ids).put(buf, done, Deadline::never());
    }
    if (st != Status::kOk || done != ids.size()) return errors.add(failed_put(p, st, done, ids.size()));
  }
}

// What must hold of the buffer once a run has delivered everything.
void check_end_of_run(const ShuffleBuffer& buf, const BufferConfig& config, const BufferRun& run,
                      const Consumer& consumer) {
  const auto stats = buf.stats();
  CHECK_MSG(stats.fresh == run.items, "fresh " << stats.fresh << " of " << run.items);
  CHECK(stats.delivered == consumer.rows && stats.batches == consumer.batches);
  CHECK_MSG(stats.resident == 0, "resident " << stats.resident << " after the end");
  CHECK_MSG(stats.delivered + stats.dropped >= run.items,
            "delivered " << stats.delivered << " + dropped " << stats.dropped);
  // Every slot is back once everything is delivered: none leaked.
  CHECK_MSG(buf.free_slots() == run.capacity, "free slots " << buf.free_slots() << " of " << run.capacity);
  CHECK_MSG(buf.stats().batch_blocks <= config.prefetch + 2, "batch blocks allocated "
                                                                  << buf.stats().batch_blocks
                                                                  << " with prefetch " << config.prefetch);
  if (run.drop_last) {
    CHECK_MSG(!consumer.short_seen, "drop_last delivered a short batch");
    CHECK_MSG(stats.dropped < run.batch, "dropped " << stats.dropped << " echoes, batch " << run.batch);
  } else {
    CHECK_MSG(stats.dropped == 0, "dropped " << stats.dropped << " without drop_last");
  }
}

// Runs one stream to its end (the last producer closes; the test thread consumes)
// and returns what the consumer saw, with the buffer's final stats.
Consumer run_buffer(const BufferRun& run, bool record_order = false) {
  BufferConfig config = make_config(run.capacity, run.batch, run.echo, run.seed);
  config.drop_last = run.drop_last;
  ShuffleBuffer buf(id_layout(run.batch), config);
  Consumer consumer(buf, run.items);
  ProducerGroup producers(buf);
  producers.start(run.producers, [&](std::uint32_t p, Errors& errors) { put_share(buf, run, p, errors); });
  consumer.drain(buf, record_order);
  producers.expect_no_errors();
  check_end_of_run(buf, config, run, consumer);
  consumer.stats = buf.stats();
  return consumer;
}

// ---------------------------------------------------------------------------
// Fractional echo and drop_last
// ---------------------------------------------------------------------------

// Echo 1.5: each id once or twice, about half of them twice. Returns rows delivered.
std::uint64_t check_fractional_echo(std::uint64_t items) {
  std::uint64_t delivered = 0;
  for (auto [producers, capacity, batch] :
       {std::tuple{4u, std::size_t{64}, std::size_t{16}}, std::tuple{8u, std::size_t{7}, std::size_t{3}}}) {
    const std::uint64_t n = capacity < 16 ? items / 10 : items;
    const BufferRun run{producers, capacity, batch, 1.5, false, n, run_seed(2000 + capacity)};
    const Consumer c = run_buffer(run);
    c.deliveries.expect(Times::between(1, 2), describe(run));
    const std::uint64_t twice = c.deliveries.items_arrived(2);
    // The mean echo is 1 + Binomial(n, 0.5) / n: six standard deviations of slack.
    const double mean = 1.0 + static_cast<double>(twice) / static_cast<double>(n);
    CHECK_MSG(std::fabs(mean - 1.5) < 3.0 / std::sqrt(static_cast<double>(n)), describe(run)
                                                                                   << ": mean echo " << mean);
    delivered += c.rows;
  }
  return delivered;
}

// drop_last: no short batch, each id at most ceil(echo) times, fewer than a
// batch of echoes dropped. Returns rows delivered.
std::uint64_t check_drop_last(std::uint64_t items) {
  std::uint64_t delivered = 0;
  for (auto [producers, capacity, batch, echo] : {std::tuple{4u, std::size_t{64}, std::size_t{16}, 2.0},
                                                  std::tuple{1u, std::size_t{7}, std::size_t{3}, 1.5},
                                                  std::tuple{8u, std::size_t{1024}, std::size_t{100}, 1.0}}) {
    const std::uint64_t n = items / 4 + 7;  // not a multiple of the batch
    const BufferRun run{producers, capacity, batch, echo, true, n, run_seed(3000 + capacity)};
    const Consumer c = run_buffer(run);
    const auto most = static_cast<std::uint32_t>(std::ceil(echo));
    c.deliveries.expect(Times::at_most(most), describe(run));
    // An id never delivered lost all its echoes to the drop.
    const std::uint64_t missing = c.deliveries.items_arrived(0);
    CHECK_MSG(missing <= c.stats.dropped, describe(run) << ": " << missing << " ids never delivered, "
                                                        << c.stats.dropped << " echoes dropped");
    if (echo == std::floor(echo))
      CHECK(c.rows + c.stats.dropped == n * most);
    else
      CHECK(c.rows + c.stats.dropped >= n && c.rows + c.stats.dropped <= n * most);
    CHECK(c.rows % batch == 0);
    delivered += c.rows;
  }
  return delivered;
}

// ---------------------------------------------------------------------------
// Held values
// ---------------------------------------------------------------------------

// One run of test_buffer_held at `echo` over `table` (row i holds id i), in
// batches of `batch`; with `drop_last`, the owners of the examples whose echoes
// are dropped at the end come back with the end (kClosed) instead.
void check_held_run(Rows& table, double echo, std::size_t batch_size, bool drop_last) {
  const std::uint64_t n = table.ids.size();
  for (std::uint64_t i = 0; i < n; ++i) payload_of(i, &table.payloads[i * kPayload]);  // the last run overwrote them
  BufferConfig config = make_config(128, batch_size, echo, run_seed(4400) + static_cast<std::uint64_t>(echo * 2));
  config.drop_last = drop_last;
  ShuffleBuffer buf(ExampleLayout({8, kPayload}, batch_size, {}, kPayload), config);
  CHECK(buf.layout().holdable_fields() == std::vector<std::size_t>{1});
  buf.set_index_range(0, n);
  Consumer consumer(buf, n);
  Deliveries returned(n);                       // owners back, by id
  std::vector<std::uint32_t> delivered_then(n, 0);  // deliveries of the id when its owner came back

  ProducerGroup producers(buf);
  producers.start(kHeldProducers, [&](std::uint32_t p, Errors& errors) {
    put_claimed(buf, table, table.ids, p, run_seed(4401), true, errors);
  });
  for (;;) {
    Batch batch;  // a fresh one: the end's owners must not be the last batch's again
    const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
    CHECK_MSG(st == Status::kOk || st == Status::kClosed, "next() returned status " << static_cast<int>(st));
    if (st == Status::kOk) consumer.take(batch, false);
    for (const std::uint64_t owner : batch.unheld) {
      CHECK_MSG(owner >= 1 && owner <= n && (owner - 1) % 3 != 0, "unexpected owner " << owner);
      returned.record(owner - 1);
      delivered_then[owner - 1] = consumer.deliveries[owner - 1];
      std::memset(&table.payloads[(owner - 1) * kPayload], 0xDB, kPayload);  // no longer read by anyone
    }
    if (st != Status::kOk) break;
  }
  producers.expect_no_errors();

  const bool integral = echo == static_cast<double>(static_cast<std::uint32_t>(echo));
  const auto most = static_cast<std::uint32_t>(std::ceil(echo));
  consumer.deliveries.expect(drop_last  ? Times::at_most(most)
                             : integral ? Times::exactly(most)
                                        : Times::at_least(1),
                             "echo " + std::to_string(echo));
  for (std::uint64_t i = 0; i < n; ++i) {
    if (i % 3 == 0) continue;  // copied, not held: no owner
    CHECK_MSG(returned[i] == 1, "owner of id " << i << " came back " << returned[i] << " times");
    CHECK_MSG(delivered_then[i] == consumer.deliveries[i], "id " << i << " delivered after its owner came back");
  }
  CHECK(buf.free_slots() == 128);
  CHECK_MSG(returned.total() == n - (n + 2) / 3, returned.total() << " owners came back");
}

}  // namespace

std::string test_buffer_accounting() {
  // {capacity, batch, ids per run in units of --items / 1000}: tiny buffers hand
  // over one or two examples per wake-up, so they get fewer ids to stay fast.
  struct Shape {
    std::size_t capacity, batch;
    std::uint64_t ids_per_mille;
  };
  const Shape shapes[] = {{1, 1, 1}, {2, 2, 1}, {3, 2, 1}, {7, 3, 2}, {64, 16, 8}, {1024, 100, 16}};
  std::uint64_t delivered = 0, ids_total = 0;
  int runs = 0;
  for (auto [capacity, batch, per_mille] : shapes)
    for (std::uint32_t producers : {1u, 4u, 8u})
      for (int echo : {1, 2, 3}) {
        const std::uint64_t items = std::max<std::uint64_t>(200, g_options.items * per_mille / 1000);
        const BufferRun run{producers,
                            capacity,
                            batch,
                            static_cast<double>(echo),
                            false,
                            items,
                            run_seed(1000 + static_cast<std::uint64_t>(runs))};
        const Consumer c = run_buffer(run);
        c.deliveries.expect(Times::exactly(static_cast<std::uint32_t>(echo)), describe(run));
        CHECK(c.rows == items * static_cast<std::uint64_t>(echo));
        delivered += c.rows;
        ids_total += items;
        ++runs;
      }
  std::ostringstream s;
  s << runs << " runs (P {1,4,8} x 6 capacities x echo {1,2,3}), " << ids_total << " ids, " << delivered
    << " rows delivered exactly";
  return s.str();
}

std::string test_buffer_fractional_and_drop_last() {
  const std::uint64_t items = std::max<std::uint64_t>(2000, g_options.items / 20);
  std::uint64_t delivered = check_fractional_echo(items);
  delivered += check_drop_last(items);
  std::ostringstream s;
  s << "echo 1.5 (2 runs, mean within 6 sd), drop_last (3 runs), " << delivered << " rows";
  return s.str();
}

// With one producer the output order depends only on the seed and the input.
std::string test_buffer_deterministic() {
  const std::uint64_t n = std::max<std::uint64_t>(1000, g_options.items / 400);
  const BufferRun runs[] = {{1, 64, 16, 2.0, false, n, run_seed(4000)},
                            {1, 7, 3, 1.5, true, n, run_seed(4001)}};
  for (const BufferRun& run : runs) {
    const Consumer a = run_buffer(run, true);
    const Consumer b = run_buffer(run, true);
    CHECK_MSG(a.order == b.order, describe(run) << ": same seed, different order (" << a.order.size()
                                                << " vs " << b.order.size() << " rows)");
    BufferRun other = run;
    other.seed ^= 1;
    const Consumer c = run_buffer(other, true);
    CHECK_MSG(a.order != c.order, describe(run)
                                      << ": seeds " << run.seed << " and " << other.seed << " agree");
  }
  return "same seed -> same order, different seed -> different order (1 producer, 2 configs)";
}

// Map-style intake as dataecho's producers run it: threads claim ranges of a
// shuffled order (claim_range) and put_each rows gathered by pointer from a
// source table. Every position is claimed once and every row arrives intact;
// with in-order intake, in the order's sequence.
std::string test_buffer_put_each() {
  const std::uint64_t n = std::max<std::uint64_t>(5000, g_options.items / 200);
  const std::vector<std::uint64_t> ids = iota_ids(n);
  const Rows table(ids);  // row i holds id i
  std::vector<std::uint64_t> order = ids;
  Rng shuffle(run_seed(4300));
  for (std::uint64_t i = n - 1; i > 0; --i) std::swap(order[i], order[shuffle.below(i + 1)]);
  constexpr std::uint32_t kProducers = 4;
  for (const bool in_order : {false, true}) {
    BufferConfig config = make_config(128, 16, 1.0, run_seed(4301));
    config.deterministic = in_order;
    config.in_order = in_order;
    ShuffleBuffer buf(id_layout(16), config);
    buf.set_index_range(0, n);
    Consumer consumer(buf, n);
    ProducerGroup producers(buf);
    producers.start(kProducers, [&](std::uint32_t p, Errors& errors) {
      put_claimed(buf, table, order, p, run_seed(4302), false, errors);
    });
    consumer.drain(buf, true);
    producers.expect_no_errors();
    consumer.deliveries.expect(Times::exactly(1), in_order ? "in-order intake" : "shuffled intake");
    if (in_order) CHECK_MSG(consumer.order == order, "in-order intake: not in the order's sequence");
  }
  std::ostringstream s;
  s << kProducers << " producers claiming ranges, " << n << " rows put by pointer, each once; in order when asked";
  return s.str();
}

// Write-into (Producer::begin/reserve/commit/cancel/end): producers claim
// ranges and write each row straight into its slot, cancelling one
// reservation in five first (as a failed write does) and reserving again; the
// consumer drains concurrently. Every row arrives once and whole, in the
// order's sequence where asked; the buffer is closed while the last writes
// are in flight, and the stream still ends only after them.
std::string test_buffer_put_into() {
  const std::uint64_t n = std::max<std::uint64_t>(5000, g_options.items / 200);
  const std::vector<std::uint64_t> ids = iota_ids(n);
  std::vector<std::uint64_t> order = ids;
  Rng shuffle(run_seed(4400));
  for (std::uint64_t i = n - 1; i > 0; --i) std::swap(order[i], order[shuffle.below(i + 1)]);
  constexpr std::uint32_t kProducers = 4;
  const ExampleLayout layout = id_layout(16);
  for (const bool in_order : {false, true}) {
    BufferConfig config = make_config(128, 16, 1.0, run_seed(4401));
    config.deterministic = in_order;
    config.in_order = in_order;
    config.window = in_order ? 32 : 0;
    ShuffleBuffer buf(id_layout(16), config);
    buf.set_index_range(0, n);
    Consumer consumer(buf, n);
    ProducerGroup producers(buf);
    producers.start(kProducers, [&](std::uint32_t p, Errors& errors) {
      dataecho::Producer& producer = buf.producer();
      Rng rng(run_seed(4402) ^ (0x9E37ull * (p + 1)));
      producer.begin();
      for (;;) {
        const auto [first, count] = producer.claim_range(1 + rng.below(8));
        if (count == 0) break;
        for (std::uint64_t i = 0; i < count; ++i) {
          const std::uint64_t seq = first + i, id = order[seq];
          std::uint32_t slot = 0;
          Status st = producer.reserve(seq, slot, Deadline::never());
          if (st == Status::kOk && rng.below(5) == 0) {
            producer.cancel(slot);
            st = producer.reserve(seq, slot, Deadline::never());
          }
          if (st != Status::kOk) {
            errors.add(failed_put(p, st, i, count));
            producer.end();
            return;
          }
          std::byte* data = producer.slot_data(slot);
          std::memcpy(data + layout.slot_offset(0), &id, sizeof id);
          payload_of(id, reinterpret_cast<std::uint8_t*>(data + layout.slot_offset(1)));
          producer.commit(slot, seq);
        }
      }
      producer.end();
    });
    consumer.drain(buf, true);
    producers.expect_no_errors();
    consumer.deliveries.expect(Times::exactly(1), in_order ? "written in order" : "written, shuffled");
    if (in_order) CHECK_MSG(consumer.order == order, "written in order: not in the order's sequence");
  }
  {  // close() while a row is being written: the stream ends after the row, which is delivered
    ShuffleBuffer buf(id_layout(4), make_config(8, 4, 1.0, run_seed(4403)));
    std::atomic<int> step{0};  // 1: reserved; 2: closed
    ProducerGroup writer(buf, StreamEnd::kTestEnds);
    writer.start(1, [&](std::uint32_t, Errors& errors) {
      dataecho::Producer& producer = buf.producer();
      producer.begin();
      std::uint32_t slot = 0;
      const Status st = producer.reserve(0, slot, Deadline::never());
      // release/acquire: the test closes only once the slot is reserved, and we write only once it closed.
      step.store(1, std::memory_order_release);
      while (step.load(std::memory_order_acquire) != 2) sleep_ms(1);
      if (st != Status::kOk) {
        errors.add(failed_put(0, st, 0, 1));
      } else {
        const std::uint64_t id = 7;
        std::byte* data = producer.slot_data(slot);
        std::memcpy(data + layout.slot_offset(0), &id, sizeof id);
        payload_of(id, reinterpret_cast<std::uint8_t*>(data + layout.slot_offset(1)));
        producer.commit(slot, 0);
      }
      producer.end();
    });
    while (step.load(std::memory_order_acquire) != 1) sleep_ms(1);
    buf.close();
    step.store(2, std::memory_order_release);
    Consumer consumer(buf, 8);
    consumer.drain(buf);
    writer.join();
    writer.expect_no_errors();
    CHECK_MSG(consumer.deliveries.total() == 1, "a row reserved before close() and committed after it is lost");
  }
  std::ostringstream s;
  s << kProducers << " producers writing " << n << " claimed rows straight into slots, one reservation in five "
    << "cancelled first: each row once, whole; in order when asked; a row written across close() delivered";
  return s.str();
}

// Held values: the payload field is holdable; two rows in three are handed
// over by reference (owner = id + 1), the rest copied. Every owner comes back
// exactly once, with or after the batch of its example's last echo: the
// consumer then overwrites the row it was held from, so a gather from it after
// that would show as a corrupt payload (and as a race under TSan).
std::string test_buffer_held() {
  const std::uint64_t n = std::max<std::uint64_t>(6000, g_options.items / 200);
  Rows table(iota_ids(n));
  for (const double echo : {1.0, 2.0, 1.5}) check_held_run(table, echo, 16, false);
  check_held_run(table, 1.0, 7, true);  // 10,000 ids by default: the last 4 echoes are dropped
  std::ostringstream s;
  s << kHeldProducers << " producers, " << n
    << " ids, two in three held by reference, echo 1, 2, 1.5, and 1 with drop_last: each owner back once, after "
       "its last echo or with the end";
  return s.str();
}

}  // namespace dataecho_test
