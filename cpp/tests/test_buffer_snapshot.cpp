// Tests of deterministic intake and snapshot.hpp through the shuffle buffer:
// with four producers racing, the order depends only on the seed; a buffer
// restored from a snapshot (taken between batches, or while the assembler
// waits for input) yields exactly what the uninterrupted buffer yielded after
// it; in-order intake delivers 0, 1, 2, ... and resumes in order.
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "dataecho/shuffle_buffer.hpp"
#include "dataecho/snapshot.hpp"
#include "examples.hpp"
#include "harness.hpp"
#include "producers.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::Snapshot;

constexpr std::uint32_t kProducers = 4;

struct Plan {
  std::size_t capacity, batch;
  double echo;
  std::uint64_t items, seed;
  bool in_order = false;
};

BufferConfig config_of(const Plan& plan) {
  BufferConfig config = make_config(plan.capacity, plan.batch, plan.echo, plan.seed);
  config.deterministic = true;
  config.in_order = plan.in_order;
  return config;
}

// Holds back puts of ids at or above `limit` until opened: starves the
// assembler mid-stream, so that a snapshot is asked for while it waits for input.
struct Gate {
  std::mutex mutex;
  std::condition_variable opened;
  std::uint64_t limit = UINT64_MAX;

  void pass(std::uint64_t id) {
    std::unique_lock<std::mutex> lock(mutex);
    opened.wait(lock, [&] { return id < limit; });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      limit = UINT64_MAX;
    }
    opened.notify_all();
  }
};

// Starts the producers: each claims the next id from `ids` and puts it tagged
// with the id as its sequence number; the last one closes the buffer.
void produce(ProducerGroup& producers, ShuffleBuffer& buf, CountedIds& ids, Gate* gate = nullptr) {
  producers.start(kProducers, [&buf, &ids, gate](std::uint32_t, Errors&) {
    for (std::uint64_t id = 0; ids.next(id);) {
      if (gate != nullptr) gate->pass(id);
      if (put_seq(buf, id) != Status::kOk) break;  // stopped: the test has what it needs
    }
  });
}

// The ids of the first `stop_after` batches (all of them when 0), and a
// snapshot after them when asked. With `starve_at`, only ids below it are put
// until the snapshot: the consumer takes batches until none comes for a while
// (the assembler is waiting for input), and the snapshot is taken then.
std::vector<std::uint64_t> run(const Plan& plan, std::size_t stop_after, Snapshot* snapshot,
                               std::uint64_t starve_at = 0) {
  ShuffleBuffer buf(id_layout(plan.batch), config_of(plan));
  Consumer consumer(buf, plan.items);
  CountedIds ids(0, plan.items);
  Gate gate;
  if (starve_at > 0) gate.limit = starve_at;
  ProducerGroup producers(buf, StreamEnd::kLastProducerCloses, [&] { gate.open(); });
  produce(producers, buf, ids, &gate);
  Batch batch;
  while (stop_after == 0 || consumer.batches < stop_after) {
    const double wait_s = starve_at > 0 ? 0.2 : g_options.timeout_s;
    const Status st = buf.next(batch, Deadline::after_seconds(wait_s));
    if (st == Status::kClosed || (st == Status::kTimeout && starve_at > 0)) break;
    CHECK_MSG(st == Status::kOk, "next() returned status " << static_cast<int>(st));
    consumer.take(batch, true);
  }
  if (snapshot) CHECK(buf.snapshot(*snapshot, Deadline::after_seconds(g_options.timeout_s)) == Status::kOk);
  gate.open();
  buf.stop();
  producers.join();
  return consumer.order;
}

// What a buffer restored from `snapshot` yields: its queued batches first, then
// its resident examples put again by sequence number and the rest of the input.
std::vector<std::uint64_t> resume(const Plan& plan, const Snapshot& snapshot) {
  BufferConfig config = config_of(plan);
  config.restore = std::make_shared<const Snapshot>(snapshot);
  ShuffleBuffer buf(id_layout(plan.batch), config);
  Consumer consumer(buf, plan.items);
  for (const std::vector<std::uint64_t>& rows : snapshot.queued)  // assembled before: yielded first
    consumer.order.insert(consumer.order.end(), rows.begin(), rows.end());
  if (snapshot.ended) return consumer.order;
  for (std::uint64_t seq : snapshot.seqs) CHECK(put_seq(buf, seq) == Status::kOk);
  CountedIds ids(snapshot.next_seq, plan.items);
  ProducerGroup producers(buf);
  produce(producers, buf, ids);
  consumer.drain(buf, true);
  producers.join();
  return consumer.order;
}

// The order is the same in two runs, and resuming after batch k gives the
// rest of it, for k across the stream. Returns the number of resumes.
std::size_t check_resumes_between_batches(const Plan& plan) {
  std::size_t resumes = 0;
  const std::vector<std::uint64_t> reference = run(plan, 0, nullptr);
  CHECK_MSG(run(plan, 0, nullptr) == reference, "4 producers: the order changed between runs");
  const std::size_t batches = (reference.size() + plan.batch - 1) / plan.batch;
  for (std::size_t k : {std::size_t{1}, std::size_t{2}, batches / 3, batches / 2, batches - 1, batches}) {
    if (k == 0) continue;
    Snapshot snapshot;
    std::vector<std::uint64_t> order = run(plan, k, &snapshot);
    CHECK_MSG(order.size() == std::min(reference.size(), k * plan.batch), "took " << order.size() << " rows");
    const std::vector<std::uint64_t> rest = resume(plan, snapshot);
    order.insert(order.end(), rest.begin(), rest.end());
    CHECK_MSG(order == reference, "capacity " << plan.capacity << ", batch " << plan.batch << ", echo "
                                              << plan.echo << ": resumed after batch " << k << " differs");
    ++resumes;
  }
  return resumes;
}

// Snapshots while the assembler waits for input part-way through filling for
// a batch: served there (not only between batches), and as good. Returns the
// number of resumes.
std::size_t check_resumes_while_starved(const Plan& plan, std::uint64_t n) {
  std::size_t starved = 0;
  const std::vector<std::uint64_t> reference = run(plan, 0, nullptr);
  for (std::uint64_t starve_at : {plan.capacity / 2 + 1, n / 3, n / 2 + 7}) {
    Snapshot snapshot;
    std::vector<std::uint64_t> order = run(plan, 0, &snapshot, starve_at);
    CHECK_MSG(!snapshot.ended, "the stream ended before the input was released");
    const std::vector<std::uint64_t> rest = resume(plan, snapshot);
    order.insert(order.end(), rest.begin(), rest.end());
    CHECK_MSG(order == reference, "capacity " << plan.capacity << ", batch " << plan.batch << ": resumed from "
                                              << "a snapshot taken with ids below " << starve_at << " differs");
    ++starved;
  }
  return starved;
}

}  // namespace

// In order (deterministic intake, echo 1, FIFO draws): four producers racing,
// and the batches still hold 0, 1, 2, ... in order, the last one short; a
// resume from a snapshot at any batch goes on in order.
std::string test_buffer_in_order() {
  const std::uint64_t n = std::max<std::uint64_t>(2001, g_options.items / 400 + 1);
  const Plan plans[] = {{64, 8, 1.0, n, run_seed(4200), true}, {6, 3, 1.0, n, run_seed(4201), true},
                        {256, 100, 1.0, n, run_seed(4202), true}};
  const std::vector<std::uint64_t> expected = iota_ids(n);
  std::size_t resumes = 0;
  for (const Plan& plan : plans) {
    CHECK_MSG(run(plan, 0, nullptr) == expected, "capacity " << plan.capacity << ", batch " << plan.batch
                                                             << ": not in order");
    const std::size_t batches = (n + plan.batch - 1) / plan.batch;
    for (std::size_t k : {std::size_t{1}, batches / 2, batches - 1}) {
      Snapshot snapshot;
      std::vector<std::uint64_t> order = run(plan, k, &snapshot);
      const std::vector<std::uint64_t> rest = resume(plan, snapshot);
      order.insert(order.end(), rest.begin(), rest.end());
      CHECK_MSG(order == expected, "capacity " << plan.capacity << ", batch " << plan.batch
                                               << ": resumed after batch " << k << " is not in order");
      ++resumes;
    }
  }
  std::ostringstream s;
  s << kProducers << " producers, " << n << " items in order in 3 configurations (short last batch), " << resumes
    << " resumes in order";
  return s.str();
}

// Deterministic intake with several producers, and resume: a buffer restored
// from a snapshot taken after batch k yields exactly what the uninterrupted
// buffer yielded after k.
std::string test_buffer_snapshot() {
  const std::uint64_t n = std::max<std::uint64_t>(2000, g_options.items / 400);
  const Plan plans[] = {{64, 8, 1.5, n, run_seed(4100)}, {7, 3, 2.0, n, run_seed(4101)},
                        {256, 32, 1.0, n, run_seed(4102)}};
  std::size_t resumes = 0, starved = 0;
  for (const Plan& plan : plans) resumes += check_resumes_between_batches(plan);
  for (const Plan& plan : plans) starved += check_resumes_while_starved(plan, n);
  std::ostringstream s;
  s << kProducers << " producers, deterministic order; " << resumes << " resumes from snapshots between batches and "
    << starved << " taken while waiting for input, each equal to the uninterrupted run";
  return s.str();
}

}  // namespace dataecho_test
