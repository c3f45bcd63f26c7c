// Tests of the shuffle buffer with ragged fields (values in the page heap):
// exact accounting per id with lengths from 0 to thousands, budgets generous
// and tight, auto echo and deterministic intake, and a put short of pages
// timing out or being released by close().
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

// Examples: id (8 bytes), tokens (ragged, 4-byte rows), boxes (ragged, 16-byte
// rows). Lengths and values derive from the id, so a torn, misplaced or
// recycled value shows. About one id in eight has no tokens.
std::uint64_t length_of(std::uint64_t id, int field, std::uint64_t longest) {
  const std::uint64_t h = Rng((id + 1) * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(field)).next();
  if (field == 0 && h % 8 == 0) return 0;
  return (h >> 8) % (longest + 1);
}

std::uint32_t value_of(std::uint64_t id, int field, std::uint64_t j) {
  return static_cast<std::uint32_t>(id * 2654435761u + static_cast<std::uint64_t>(field) * 7919u + j);
}

ExampleLayout ragged_layout(std::size_t batch) { return ExampleLayout({8, 4, 16}, batch, {false, true, true}); }

// One example's fields, for put() and put_each().
struct Example {
  Example(std::uint64_t id_in, std::uint64_t longest) : id(id_in) {
    rows[0] = length_of(id, 0, longest);
    rows[1] = length_of(id, 1, 6);
    for (std::uint64_t j = 0; j < rows[0]; ++j) tokens.push_back(value_of(id, 0, j));
    for (std::uint64_t j = 0; j < rows[1] * 4; ++j) boxes.push_back(value_of(id, 1, j));
  }
  std::uint64_t id;
  std::uint64_t rows[2];
  std::vector<std::uint32_t> tokens, boxes;
};

struct Run {
  std::uint32_t producers;
  std::size_t capacity, batch;
  double echo;  // 0: auto, max_echo 3
  std::uint64_t items, longest;
  std::size_t pages, page_bytes;
  std::uint64_t seed;
  bool deterministic = false;
};

std::string describe(const Run& run) {
  std::ostringstream s;
  s << run.producers << " producers, capacity " << run.capacity << ", batch " << run.batch << ", echo "
    << (run.echo == 0 ? std::string("auto") : std::to_string(run.echo)) << ", " << run.items
    << " ids of up to " << run.longest << " tokens, " << run.pages << " pages of " << run.page_bytes << " bytes";
  return s.str();
}

struct Outcome {
  explicit Outcome(std::uint64_t items) : deliveries(items) {}
  Deliveries deliveries;
  std::vector<std::uint64_t> order;
  std::uint64_t rows = 0, batches = 0;
  dataecho::BufferStats stats{};
};

// Checks a batch: offsets, lengths and values by id; counts ids.
void take(const ExampleLayout& layout, const Batch& batch, const Run& run, Outcome& out) {
  const std::byte* base = batch.lease->data();
  const std::int64_t* offsets[2] = {layout.offsets(const_cast<std::byte*>(base), 1),
                                    layout.offsets(const_cast<std::byte*>(base), 2)};
  for (int f = 0; f < 2; ++f) CHECK(offsets[f][0] == 0);
  for (std::size_t row = 0; row < batch.rows; ++row) {
    std::uint64_t id = 0;
    std::memcpy(&id, base + layout.batch_offset(0) + row * 8, 8);
    CHECK_MSG(out.deliveries.known(id), "unknown id " << id << " in row " << row);
    for (int f = 0; f < 2; ++f) {
      const std::uint64_t want = f == 0 ? length_of(id, 0, run.longest) : length_of(id, 1, 6);
      const std::int64_t begin = offsets[f][row], end = offsets[f][row + 1];
      CHECK_MSG(end - begin == static_cast<std::int64_t>(want),
                "id " << id << " field " << f << ": " << end - begin << " rows, expected " << want);
      const auto* values = reinterpret_cast<const std::uint32_t*>(batch.lease->values(static_cast<std::size_t>(f)));
      const std::size_t per_row = f == 0 ? 1 : 4;
      for (std::uint64_t j = 0; j < want * per_row; ++j)
        CHECK_MSG(values[static_cast<std::size_t>(begin) * per_row + j] == value_of(id, f, j),
                  "id " << id << " field " << f << ": value " << j << " corrupted");
    }
    out.deliveries.record(id);
    if (run.deterministic) out.order.push_back(id);
  }
  CHECK(batch.lease->values_used(0) == static_cast<std::size_t>(offsets[0][batch.rows]) * 4);
  out.rows += batch.rows;
  ++out.batches;
}

// Puts `examples` by put() when there is one (and order does not matter), else
// one at a time by put_each; deterministic intake numbers each by its id
// (put_each numbers consecutively). Counts the examples put in `done`.
Status put_examples(ShuffleBuffer& buf, const Run& run, const std::vector<Example>& examples, std::size_t& done) {
  std::vector<const void*> pointers;
  std::vector<std::uint64_t> lengths;
  for (const Example& e : examples) {
    pointers.insert(pointers.end(), {&e.id, e.tokens.data(), e.boxes.data()});
    lengths.insert(lengths.end(), {e.rows[0], e.rows[1]});
  }
  if (examples.size() == 1 && !run.deterministic) {
    const Status st = buf.put(pointers.data(), Deadline::never(), lengths.data());
    done = st == Status::kOk;
    return st;
  }
  Status st = Status::kOk;
  for (std::size_t i = 0; i < examples.size() && st == Status::kOk; ++i) {
    std::size_t one = 0;
    st = run.deterministic ? buf.producer().put_each(pointers.data() + 3 * i, 1, one, Deadline::never(),
                                                     examples[i].id, lengths.data() + 2 * i)
                           : buf.producer().put_each(pointers.data() + 3 * i, 1, one, Deadline::never(), 0,
                                                     lengths.data() + 2 * i);
    done += one;
  }
  return st;
}

// Producer p's strided share of [0, run.items), in chunks of 1 to 12.
void put_share(ShuffleBuffer& buf, const Run& run, std::uint32_t p, Errors& errors) {
  Rng rng(run.seed ^ (0x5A5A5A5Aull + p));
  StridedIds claims(p, run.producers, run.items);
  std::vector<std::uint64_t> ids;
  while (!claims.done()) {
    claims.take(rng.below(2) == 0 ? 1 : 1 + rng.below(12), ids);
    std::vector<Example> examples;
    for (const std::uint64_t id : ids) examples.emplace_back(id, run.longest);
    std::size_t done = 0;
    const Status st = put_examples(buf, run, examples, done);
    if (st != Status::kOk || done != examples.size()) return errors.add(failed_put(p, st, done, examples.size()));
  }
}

// Runs one stream to its end (the last producer closes; the test thread
// consumes), checks that every page and slot came back, returns what was seen.
Outcome run_buffer(const Run& run) {
  BufferConfig config = make_config(run.capacity, run.batch, run.echo == 0 ? 1.0 : run.echo, run.seed);
  config.auto_echo = run.echo == 0;
  config.max_echo = 3;
  config.pages = run.pages;
  config.page_bytes = run.page_bytes;
  config.deterministic = run.deterministic;
  ShuffleBuffer buf(ragged_layout(run.batch), config);
  Outcome out(run.items);
  ProducerGroup producers(buf);
  producers.start(run.producers, [&](std::uint32_t p, Errors& errors) { put_share(buf, run, p, errors); });
  Batch batch;
  for (;;) {
    const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
    if (st == Status::kClosed) break;
    CHECK_MSG(st == Status::kOk, describe(run) << ": next() returned " << static_cast<int>(st));
    take(buf.layout(), batch, run, out);
  }
  producers.expect_no_errors();
  out.stats = buf.stats();
  CHECK_MSG(out.stats.pages_in_use == 0, describe(run) << ": " << out.stats.pages_in_use << " pages still held");
  CHECK_MSG(buf.free_slots() == run.capacity, describe(run) << ": free slots " << buf.free_slots());
  CHECK(out.stats.fresh == run.items && out.stats.delivered == out.rows);
  return out;
}

}  // namespace

// Ragged values through the buffer, with exact accounting per id: lengths 0 to
// thousands, 1/4/8 producers, a generous budget and one that holds a few
// examples (producers block on pages, the assembler draws what it has).
std::string test_buffer_ragged() {
  const std::uint64_t items = std::max<std::uint64_t>(600, g_options.items / 1000);
  std::uint64_t delivered = 0;
  int runs = 0;
  struct Shape {
    std::size_t capacity, batch;
    std::uint64_t longest;
    std::size_t page_bytes;
    bool tight;
  };
  const Shape shapes[] = {{64, 16, 40, 64, false}, {256, 32, 3000, 256, false}, {64, 16, 3000, 64, true},
                          {8, 3, 500, 4096, true}, {1, 1, 20, 64, false}};
  for (const Shape& shape : shapes)
    for (std::uint32_t producers : {1u, 4u, 8u})
      for (double echo : {1.0, 2.0, 1.5}) {
        // Pages of the biggest example; a tight budget holds two of them.
        const std::size_t biggest = (shape.longest * 4 + shape.page_bytes - 1) / shape.page_bytes +
                                    (6 * 16 + shape.page_bytes - 1) / shape.page_bytes;
        const std::size_t pages = shape.tight ? 2 * biggest : shape.capacity * biggest;
        const Run run{producers, shape.capacity, shape.batch, echo, items, shape.longest,
                      pages, shape.page_bytes, run_seed(8000 + static_cast<std::uint64_t>(runs))};
        const Outcome out = run_buffer(run);
        out.deliveries.expect(echo == 1.5 ? Times::between(1, 2) : Times::exactly(static_cast<std::uint32_t>(echo)),
                              describe(run));
        delivered += out.rows;
        ++runs;
      }
  std::ostringstream s;
  s << runs << " runs (P {1,4,8} x 5 shapes, 2 with a budget of two examples x echo {1,2,1.5}), " << delivered
    << " rows delivered exactly, values checked";
  return s.str();
}

// Auto echo and deterministic intake with ragged values.
std::string test_buffer_ragged_modes() {
  const std::uint64_t items = std::max<std::uint64_t>(800, g_options.items / 1000);
  for (bool tight : {false, true}) {
    const Run run{4, 64, 16, 0, items, 900, std::size_t{tight ? 2u * 60 : 64u * 60}, 64, run_seed(8500 + tight)};
    run_buffer(run).deliveries.expect(Times::between(1, 3), describe(run));
  }
  // Deterministic: the same order with 1 and 4 producers, when the budget holds the buffer.
  Run run{1, 64, 16, 2.0, items, 300, 64 * 25, 64, run_seed(8600), true};
  const Outcome one = run_buffer(run);
  run.producers = 4;
  const Outcome four = run_buffer(run);
  CHECK_MSG(one.order == four.order, "deterministic order differs between 1 and 4 producers");
  one.deliveries.expect(Times::exactly(2), describe(run));
  return "auto echo (budget generous and tight): 1 to 3 deliveries each; deterministic: same order for 1 and 4 "
         "producers";
}

// A put waiting for pages times out (its slot goes back) or, at close(), fails.
std::string test_buffer_ragged_blocking() {
  BufferConfig config = make_config(8, 1, 1.0, 1);
  config.prefetch = 1;
  config.initial = 1;
  config.page_bytes = 64;
  config.pages = 4;  // one example of 64 tokens takes every page
  ShuffleBuffer buf(ragged_layout(1), config);
  Example full(0, 0);
  full.tokens.assign(64, 7);
  full.rows[0] = 64;
  full.rows[1] = 0;
  const void* fields[] = {&full.id, full.tokens.data(), full.boxes.data()};
  CHECK(buf.put(fields, Deadline::never(), full.rows) == Status::kOk);  // batch 0: the ready queue is full
  CHECK(buf.put(fields, Deadline::never(), full.rows) == Status::kOk);  // resident; holds every page
  const Status timed = buf.put(fields, Deadline::after_seconds(0.05), full.rows);
  CHECK_MSG(timed == Status::kTimeout, "a put without pages returned " << static_cast<int>(timed));
  CHECK_MSG(buf.free_slots() == 7, "free slots " << buf.free_slots() << ": the timed-out put kept its slot");
  // seq_cst (the default): the early load only asks "not returned yet"; the
  // scope's join orders the final read.
  std::atomic<int> blocked{-1};
  {
    Threads waiter([&] { buf.stop(); });
    waiter.spawn([&] { blocked = static_cast<int>(buf.put(fields, Deadline::never(), full.rows)); });
    sleep_ms(50);
    CHECK(blocked.load() == -1);
    buf.close();
  }
  CHECK_MSG(blocked.load() == static_cast<int>(Status::kClosed), "blocked put returned " << blocked.load());
  int batches = 0;
  Batch batch;
  while (buf.next(batch, Deadline::after_seconds(5)) == Status::kOk) {
    CHECK(batch.rows == 1 && buf.layout().offsets(batch.lease->data(), 1)[1] == 64);
    ++batches;
  }
  CHECK(batches == 2 && buf.stats().pages_in_use == 0);
  return "a put short of pages times out and returns its slot; close() releases a blocked one";
}

}  // namespace dataecho_test
