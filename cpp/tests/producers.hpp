// Claiming producers: the threads that put examples into a shuffle buffer.
// Each producer claims what to put in one of three ways, and a ProducerGroup
// runs them and ends the stream:
//   - StridedIds:  producer p of P puts ids p, p + P, p + 2P, ... (no sharing);
//   - CountedIds:  producers take the next id from one shared counter;
//   - put_claimed: producers claim ranges of positions from the buffer itself
//                  (Producer::claim_range, as dataecho's map-style intake does).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "dataecho/rng.hpp"
#include "examples.hpp"
#include "harness.hpp"

namespace dataecho_test {

// What a producer reports when a put fails or stops short.
inline std::string failed_put(std::uint32_t p, Status st, std::size_t done, std::size_t asked) {
  return "producer " + std::to_string(p) + ": status " + std::to_string(static_cast<int>(st)) + " after " +
         std::to_string(done) + " of " + std::to_string(asked) + " rows";
}

// Producer p's share when P producers split [0, end) without talking to each
// other: ids p, p + P, p + 2P, ...
class StridedIds {
 public:
  static constexpr std::uint64_t kNoEnd = std::numeric_limits<std::uint64_t>::max();

  StridedIds(std::uint32_t p, std::uint32_t producers, std::uint64_t end = kNoEnd)
      : next_(p), step_(producers), end_(end) {}

  bool done() const { return next_ >= end_; }

  // The next id; false when none are left.
  bool next(std::uint64_t& id) {
    if (done()) return false;
    id = next_;
    next_ += step_;
    return true;
  }

  // Up to `most` next ids, replacing `out`'s contents.
  void take(std::size_t most, std::vector<std::uint64_t>& out) {
    out.clear();
    for (std::uint64_t id = 0; out.size() < most && next(id);) out.push_back(id);
  }

 private:
  std::uint64_t next_;
  const std::uint64_t step_;
  const std::uint64_t end_;
};

// Ids [first, end) handed out one at a time from a counter every producer shares.
class CountedIds {
 public:
  CountedIds(std::uint64_t first, std::uint64_t end) : next_(first), end_(end) {}

  // The next unclaimed id; false when none are left.
  bool next(std::uint64_t& id) {
    // relaxed: the counter only has to hand out distinct ids; what is put with
    // them is ordered by the buffer's own synchronization.
    id = next_.fetch_add(1, std::memory_order_relaxed);
    return id < end_;
  }

 private:
  std::atomic<std::uint64_t> next_;
  const std::uint64_t end_;
};

// How the stream ends once every producer has returned.
enum class StreamEnd {
  kLastProducerCloses,  // the last producer to return calls close(): a normal end of input
  kTestEnds,            // the test calls close() or stop() itself
};

// A group of producer threads on one buffer. If a CHECK fails in the test
// thread while they run, the buffer is stopped (after `release`, for producers
// blocked in the test's own code) so that every producer returns, and they
// are joined before the test unwinds further.
class ProducerGroup {
 public:
  explicit ProducerGroup(ShuffleBuffer& buf, StreamEnd end = StreamEnd::kLastProducerCloses,
                         std::function<void()> release = {})
      : buf_(buf), end_(end), threads_([this, release = std::move(release)] {
          if (release) release();
          buf_.stop();
        }) {}
  ProducerGroup(const ProducerGroup&) = delete;
  ProducerGroup& operator=(const ProducerGroup&) = delete;

  // Starts producers p = 0 .. count - 1, each running body(p, errors); once.
  template <class Body>
  void start(std::uint32_t count, Body body) {
    CHECK(!started_);
    started_ = true;
    // relaxed: starting a thread synchronizes with it, so each sees this store.
    running_.store(count, std::memory_order_relaxed);
    for (std::uint32_t p = 0; p < count; ++p)
      threads_.spawn([this, body, p] {
        body(p, errors_);
        // acq_rel: the decrements form one release sequence, so the last
        // producer's close() comes after every other producer's last put.
        if (running_.fetch_sub(1, std::memory_order_acq_rel) == 1 && end_ == StreamEnd::kLastProducerCloses)
          buf_.close();
      });
  }

  void join() { threads_.join(); }

  // Joins, then CHECKs that no producer reported an error (at the caller's line).
  void expect_no_errors(std::source_location where = std::source_location::current()) {
    join();
    if (errors_.count() != 0)
      check_failed("no producer reported an error", where.file_name(), where.line(), errors_.summary());
  }

 private:
  ShuffleBuffer& buf_;
  const StreamEnd end_;
  bool started_ = false;
  Errors errors_;
  std::atomic<std::uint32_t> running_{0};
  Threads threads_;  // last: joined before the members above are destroyed
};

// A map-style producer: claims ranges of positions until none are left, and
// puts row order[position] of `table` for each with put_each, tagged with its
// position; with `hold`, two rows in three by reference (owner = row + 1),
// the rest copied.
inline void put_claimed(ShuffleBuffer& buf, const Rows& table, const std::vector<std::uint64_t>& order,
                        std::uint32_t p, std::uint64_t seed, bool hold, Errors& errors) {
  dataecho::Rng rng(seed ^ (0x9E37ull * (p + 1)));
  for (;;) {
    const auto [first, count] = buf.producer().claim_range(1 + rng.below(40));
    if (count == 0) return;
    std::vector<const void*> rows(count * 2);
    std::vector<std::uint64_t> owners(count);
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::uint64_t row = order[first + i];
      rows[i * 2] = &table.ids[row];
      rows[i * 2 + 1] = &table.payloads[row * kPayload];
      owners[i] = row % 3 == 0 ? 0 : row + 1;
    }
    std::size_t done = 0;
    const Status st = buf.producer().put_each(rows.data(), count, done, Deadline::never(), first, nullptr,
                                              hold ? owners.data() : nullptr);
    if (st != Status::kOk || done != count) return errors.add(failed_put(p, st, done, count));
  }
}

}  // namespace dataecho_test
