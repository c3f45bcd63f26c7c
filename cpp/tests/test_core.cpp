// Native tests for the dataecho core: the generator, the reservoir, the ring and
// the shuffle buffer, with exact per-item accounting under contention.
//
// No framework: a failed CHECK prints file:line, the test and the seed, the test
// is reported FAIL and the program exits non-zero at the end. A watchdog bounds
// every test in time (a lost wake-up shows as a TIMEOUT, not a hung CI job).
// Worker threads record what they saw and the test thread checks it after
// joining them; if a CHECK fails first, the threads are released and joined.
//
// Usage: dataecho_tests [--seed N] [--items N] [--timeout-s S] [--only SUBSTRING]
//   --items scales every stress size; the default moves about 2 million values
//   through the ring tests and runs in a few seconds in a Release build.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "dataecho/layout.hpp"
#include "dataecho/memory.hpp"
#include "dataecho/page_heap.hpp"
#include "dataecho/reservoir.hpp"
#include "dataecho/ring.hpp"
#include "dataecho/rng.hpp"
#include "dataecho/shuffle_buffer.hpp"
#include "dataecho/wait.hpp"

namespace {

using dataecho::Batch;
using dataecho::BatchPool;
using dataecho::Block;
using dataecho::BufferConfig;
using dataecho::Deadline;
using dataecho::ExampleLayout;
using dataecho::Reservoir;
using dataecho::Ring;
using dataecho::Rng;
using dataecho::ShuffleBuffer;
using dataecho::Snapshot;
using dataecho::Status;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

struct Options {
  std::uint64_t seed = 20240611;
  std::uint64_t items = 2'000'000;
  double timeout_s = 60;
  std::string only;
};

Options g_options;
const char* volatile g_test = "";  // read by the abort handler
std::string g_first_failure;       // of the current test, for its FAIL line

struct TestFailure : std::exception {};

[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& detail) {
  std::ostringstream where;
  where << file << ":" << line << ": " << expr << (detail.empty() ? "" : ": ") << detail;
  std::fprintf(stderr, "  CHECK failed at %s (test %s, seed %llu)\n", where.str().c_str(), g_test,
               static_cast<unsigned long long>(g_options.seed));
  std::fflush(stderr);
  if (g_first_failure.empty()) g_first_failure = where.str();
  throw TestFailure{};
}

// The core's own invariant checks (DATAECHO_CHECK) abort the process: name the
// test and the seed first, with async-signal-safe calls only.
char g_seed_text[32];

void write_text(const char* text) {
  std::size_t n = 0;
  while (text[n] != '\0') ++n;
  (void)!::write(2, text, n);
}

void on_fatal_signal(int signo) {
  write_text("FATAL signal in test ");
  write_text(g_test);
  write_text(" (seed ");
  write_text(g_seed_text);
  write_text(")\n");
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) check_failed(#cond, __FILE__, __LINE__, std::string()); \
  } while (0)

// CHECK_MSG(cond, "id " << id << " seen " << n << " times")
#define CHECK_MSG(cond, stream)                                  \
  do {                                                           \
    if (!(cond)) {                                               \
      std::ostringstream check_msg_;                             \
      check_msg_ << stream;                                      \
      check_failed(#cond, __FILE__, __LINE__, check_msg_.str()); \
    }                                                            \
  } while (0)

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// A distinct, reproducible seed for each run of a test.
std::uint64_t run_seed(std::uint64_t salt) {
  return Rng(g_options.seed ^ (salt * 0x9E3779B97F4A7C15ull)).next();
}

// Kills the process if one test runs past --timeout-s: a hang is a failure too.
class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(const char* test, double seconds) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      test_ = test;
      deadline_ =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
      armed_ = true;
    }
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = false;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!quit_) {
      if (!armed_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ && Clock::now() >= deadline_) {
        std::fprintf(stderr, "TIMEOUT %s: still running after %.0f s (seed %llu); a thread is stuck\n",
                     test_.c_str(), g_options.timeout_s, static_cast<unsigned long long>(g_options.seed));
        std::fflush(stderr);
        std::_Exit(3);
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::string test_;
  Clock::time_point deadline_{};
  bool armed_ = false;
  bool quit_ = false;
  std::thread thread_;
};

// What worker threads saw go wrong; the test thread CHECKs it after joining them.
class Errors {
 public:
  void add(std::string what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (list_.size() < 16) list_.push_back(std::move(what));
    ++count_;
  }
  std::size_t count() {
    std::lock_guard<std::mutex> lock(mutex_);
    return count_;
  }
  std::string summary() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string s;
    for (const auto& e : list_) s += "\n    " + e;
    return s;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> list_;
  std::size_t count_ = 0;
};

// Joins its threads on scope exit. When the scope is left by an exception (a
// CHECK failed in the test thread), `release` runs first so that workers blocked
// in the code under test return.
class Threads {
 public:
  explicit Threads(std::function<void()> release = {})
      : release_(std::move(release)), exceptions_(std::uncaught_exceptions()) {}
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;
  ~Threads() {
    if (release_ && std::uncaught_exceptions() > exceptions_) release_();
    join();
  }
  template <class F>
  void spawn(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }
  void join() {
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

 private:
  std::function<void()> release_;
  const int exceptions_;
  std::vector<std::thread> threads_;
};

// Pearson's statistic against a uniform expectation, and a loose bound for it:
// mean k plus six standard deviations plus a margin (p < 1e-6 for these k).
double chi_square(const std::vector<std::uint64_t>& observed) {
  std::uint64_t total = 0;
  for (auto o : observed) total += o;
  const double expected = static_cast<double>(total) / static_cast<double>(observed.size());
  double chi = 0;
  for (auto o : observed)
    chi += (static_cast<double>(o) - expected) * (static_cast<double>(o) - expected) / expected;
  return chi;
}

double chi_square_bound(std::size_t cells) {
  const double k = static_cast<double>(cells - 1);
  return k + 6 * std::sqrt(2 * k) + 10;
}

// ---------------------------------------------------------------------------
// 1. Rng
// ---------------------------------------------------------------------------

std::string test_rng() {
  const std::uint64_t seed = run_seed(1);

  Rng a(seed), b(seed), c(seed + 1);
  int differ = 0;
  for (int i = 0; i < 1000; ++i) {
    const auto x = a.next();
    CHECK_MSG(x == b.next(), "same seed, different output at draw " << i);
    differ += x != c.next();
  }
  CHECK_MSG(differ > 990,
            "seeds " << seed << " and " << seed + 1 << " agree on " << 1000 - differ << " draws");

  // The state is a counter: saving and restoring it replays the same draws.
  const std::uint64_t saved = a.state();
  std::vector<std::uint64_t> first;
  for (int i = 0; i < 100; ++i) first.push_back(a.below(1000));
  a.set_state(saved);
  for (int i = 0; i < 100; ++i) CHECK(a.below(1000) == first[static_cast<std::size_t>(i)]);

  const std::uint64_t bounds[] = {
      1, 2, 3, 7, 10, 1000, (1ull << 32) - 1, (1ull << 32) + 15, (1ull << 63) + 1, UINT64_MAX};
  for (std::uint64_t n : bounds) {
    std::uint64_t top = 0;
    for (int i = 0; i < 20000; ++i) {
      const std::uint64_t v = a.below(n);
      CHECK_MSG(v < n, "below(" << n << ") returned " << v);
      top = std::max(top, v);
    }
    // The largest of 20000 uniform draws lies in the top 0.1% of the range.
    if (n > 1)
      CHECK_MSG(static_cast<double>(top) >= 0.999 * static_cast<double>(n - 1) || n <= 1000,
                "below(" << n << "): max of 20000 draws is " << top);
  }

  std::size_t cells_checked = 0;
  for (std::uint64_t n : {2ull, 3ull, 7ull, 10ull, 100ull}) {
    std::vector<std::uint64_t> hist(n, 0);
    const std::uint64_t draws = 2000 * n;
    for (std::uint64_t i = 0; i < draws; ++i) ++hist[a.below(n)];
    const double chi = chi_square(hist);
    CHECK_MSG(chi < chi_square_bound(n),
              "below(" << n << ") chi-square " << chi << " over " << draws << " draws");
    cells_checked += n;
  }

  double sum = 0;
  int heads = 0;
  const int draws = 100000;
  for (int i = 0; i < draws; ++i) {
    const double u = a.uniform();
    CHECK(u >= 0.0 && u < 1.0);
    sum += u;
    heads += a.bernoulli(0.25);
  }
  CHECK_MSG(std::fabs(sum / draws - 0.5) < 0.01, "uniform() mean " << sum / draws);
  CHECK_MSG(std::fabs(static_cast<double>(heads) / draws - 0.25) < 0.01, "bernoulli(0.25) rate " << heads);

  std::ostringstream s;
  s << "determinism, state replay, below() range for 10 bounds, chi-square over " << cells_checked
    << " cells";
  return s.str();
}

// ---------------------------------------------------------------------------
// 2. Reservoir (single-threaded)
// ---------------------------------------------------------------------------

std::string test_reservoir() {
  Rng rng(run_seed(2));
  std::uint64_t draws_checked = 0;

  // (a) Random walk against a model: sizes, echo counts, `last`, and no repeat
  // within a batch until every resident has been drawn.
  {
    const std::uint32_t capacity = 64;
    Reservoir r(capacity);
    std::vector<std::uint32_t> echoes(capacity, 0);  // model, indexed by slot
    std::vector<bool> drawn(capacity, false);        // drawn since the batch began
    std::vector<std::uint32_t> free_slots;
    for (std::uint32_t s = 0; s < capacity; ++s) free_slots.push_back(capacity - 1 - s);
    std::uint64_t model_left = 0;
    std::size_t model_size = 0;
    const std::uint64_t steps = std::max<std::uint64_t>(20000, g_options.items / 10);
    for (std::uint64_t step = 0; step < steps; ++step) {
      const auto op = rng.below(16);
      if (op == 0) {
        r.begin_batch();
        std::fill(drawn.begin(), drawn.end(), false);
      } else if (!free_slots.empty() && (op < 7 || model_size == 0)) {
        const std::size_t at = rng.below(free_slots.size());
        const std::uint32_t slot = free_slots[at];
        free_slots.erase(free_slots.begin() + static_cast<std::ptrdiff_t>(at));
        const auto e = static_cast<std::uint32_t>(1 + rng.below(5));
        r.add(slot, e);
        echoes[slot] = e;
        drawn[slot] = false;
        model_left += e;
        ++model_size;
      } else if (model_size > 0) {
        const bool was_exhausted = r.available() == 0;
        const auto d = r.draw(rng);
        ++draws_checked;
        CHECK_MSG(d.slot < capacity && echoes[d.slot] > 0, "draw returned non-resident slot " << d.slot);
        if (was_exhausted) {
          std::fill(drawn.begin(), drawn.end(), false);  // every resident drawn: a new round
        } else {
          CHECK_MSG(!drawn[d.slot], "slot " << d.slot << " drawn twice in a batch with " << r.available() + 1
                                            << " undrawn residents left");
        }
        drawn[d.slot] = true;
        --echoes[d.slot];
        --model_left;
        CHECK_MSG(d.last == (echoes[d.slot] == 0),
                  "slot " << d.slot << " last=" << d.last << " with " << echoes[d.slot] << " echoes left");
        if (d.last) {
          --model_size;
          free_slots.push_back(d.slot);
        }
      }
      CHECK_MSG(r.size() == model_size, "size " << r.size() << ", model " << model_size);
      CHECK_MSG(r.echoes_left() == model_left, "echoes_left " << r.echoes_left() << ", model " << model_left);
      CHECK(r.available() <= r.size());
    }
  }

  // (b) Without replacement: a batch of size() draws gives each resident once,
  // and a resident added mid-batch is drawable in that batch.
  {
    const std::uint32_t n = 50;
    Reservoir r(n + 1);
    for (std::uint32_t s = 0; s < n; ++s) r.add(s, 1000);
    for (int batch = 0; batch < 200; ++batch) {
      r.begin_batch();
      CHECK(r.available() == n);
      std::vector<int> seen(n + 1, 0);
      for (std::uint32_t i = 0; i < n; ++i) {
        const auto d = r.draw(rng);
        CHECK(!d.last);
        ++seen[d.slot];
      }
      CHECK(r.available() == 0);
      for (std::uint32_t s = 0; s < n; ++s)
        CHECK_MSG(seen[s] == 1, "slot " << s << " drawn " << seen[s] << " times");
      draws_checked += n;
    }
    r.begin_batch();
    std::vector<int> seen(n + 1, 0);
    for (int i = 0; i < 10; ++i) ++seen[r.draw(rng).slot];
    r.add(n, 1);
    CHECK(r.available() == n - 10 + 1);
    bool new_one_drawn = false;
    for (std::uint32_t i = 0; i < n - 10 + 1; ++i) {
      const auto d = r.draw(rng);
      CHECK(seen[d.slot] == 0);
      ++seen[d.slot];
      if (d.slot == n) {
        CHECK(d.last);
        new_one_drawn = true;
      }
    }
    CHECK(new_one_drawn && r.size() == n);
    draws_checked += n + 1;
  }

  // (c) draw.last exactly on the final echo; more draws than residents repeat
  // only after every resident was drawn.
  {
    Reservoir r(3);
    r.add(0, 3);
    r.begin_batch();
    CHECK(!r.draw(rng).last);
    CHECK(!r.draw(rng).last);  // available was 0: a new round over the one resident
    const auto d = r.draw(rng);
    CHECK(d.slot == 0 && d.last && r.size() == 0 && r.echoes_left() == 0);
    r.add(0, 2);
    r.add(1, 2);
    r.add(2, 2);
    r.begin_batch();
    std::vector<int> seen(3, 0);
    for (int i = 0; i < 3; ++i) ++seen[r.draw(rng).slot];
    CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1);
    for (int i = 0; i < 3; ++i) CHECK(r.draw(rng).last);  // second round: each one's last echo
    CHECK(r.size() == 0 && r.echoes_left() == 0);
  }

  // (c2) In order: a FIFO over a ring that wraps many times, against a model
  // queue; contents() lists the residents oldest first, and a restore keeps that.
  {
    const std::uint32_t capacity = 7;
    Reservoir r(capacity, /*in_order=*/true);
    std::vector<std::uint32_t> model;  // resident slots, oldest first
    std::uint32_t next_slot = 0;
    for (int step = 0; step < 20000; ++step) {
      if (model.size() < capacity && (rng.below(2) == 0 || model.empty())) {
        const std::uint32_t slot = next_slot++ % 1000 % capacity;  // a slot no resident holds
        if (std::find(model.begin(), model.end(), slot) != model.end()) continue;
        r.add(slot, 1);
        model.push_back(slot);
      } else {
        const auto d = r.draw_first();
        CHECK_MSG(d.slot == model.front() && d.last, "drew " << d.slot << ", the oldest is " << model.front());
        model.erase(model.begin());
        ++draws_checked;
      }
      CHECK(r.size() == model.size() && r.available() == r.size() && r.echoes_left() == model.size());
    }
    const auto contents = r.contents();
    CHECK(contents.size() == model.size());
    for (std::size_t i = 0; i < model.size(); ++i) CHECK(contents[i].first == model[i]);
    Reservoir restored(capacity, /*in_order=*/true);
    restored.restore(contents, contents.size());
    for (std::uint32_t slot : model) CHECK(restored.draw_first().slot == slot);
  }

  // (d) Uniformity: the first draw of a batch over 10 residents, and the order
  // of a full batch over 3 residents (all 6 permutations equally likely).
  {
    Reservoir r(10);
    for (std::uint32_t s = 0; s < 10; ++s) r.add(s, 4'000'000'000u);
    std::vector<std::uint64_t> first(10, 0);
    const int trials = 100000;
    for (int t = 0; t < trials; ++t) {
      r.begin_batch();
      ++first[r.draw(rng).slot];
      r.draw(rng);  // stir the order
    }
    const double chi = chi_square(first);
    CHECK_MSG(chi < chi_square_bound(10), "first draw over 10 residents: chi-square " << chi);
    draws_checked += 2 * trials;
  }
  {
    Reservoir r(3);
    for (std::uint32_t s = 0; s < 3; ++s) r.add(s, 4'000'000'000u);
    std::vector<std::uint64_t> perms(9, 0);  // index a*3+b: the first two draws fix the permutation
    const int trials = 60000;
    for (int t = 0; t < trials; ++t) {
      r.begin_batch();
      const auto x = r.draw(rng).slot, y = r.draw(rng).slot, z = r.draw(rng).slot;
      CHECK(x != y && y != z && x != z);
      ++perms[x * 3 + y];
    }
    std::vector<std::uint64_t> six;
    for (std::uint32_t i = 0; i < 9; ++i)
      if (i / 3 != i % 3) six.push_back(perms[i]);
    const double chi = chi_square(six);
    CHECK_MSG(chi < chi_square_bound(6), "batch order over 3 residents: chi-square " << chi);
    draws_checked += 3 * trials;
  }

  std::ostringstream s;
  s << draws_checked << " draws checked against a model; without-replacement, last, uniformity";
  return s.str();
}

// ---------------------------------------------------------------------------
// 3. Ring
// ---------------------------------------------------------------------------

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

// block_until over the ring's event counts: parked threads wake, deadlines hold.
std::string test_ring_blocking() {
  // A consumer parked on an empty ring (the sleep outlasts spin and yield) wakes on a push.
  {
    OwnedRing owned(4);
    Ring& r = *owned.ring;
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
  {
    OwnedRing owned(4);
    Ring& r = *owned.ring;
    for (std::uint32_t i = 0; i < 4; ++i) CHECK(r.try_push(i));
    std::atomic<bool> pushed{false};
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
  {
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
  {
    OwnedRing owned(2);
    Ring& r = *owned.ring;
    std::uint32_t v = 0;
    const auto start = Clock::now();
    CHECK(!block_until(r.not_empty(), Deadline::after_seconds(0.03), [&] { return r.try_pop(v); }));
    const double waited = seconds_since(start);
    CHECK_MSG(waited >= 0.03 && waited < 5, "waited " << waited << " s for a 0.03 s deadline");
    CHECK(!block_until(r.not_empty(), Deadline::now(), [&] { return r.try_pop(v); }));
  }
  return "parked consumer/producer wake, notify_all to 4 sleepers, timed wait";
}

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

// Moves `per_producer` tagged values from every producer through the ring, then
// one stop value per consumer; checks exactly-once delivery and per-producer order.
void run_ring(const RingRun& run, std::uint32_t per_producer) {
  OwnedRing owned(run.capacity);
  Ring& r = *owned.ring;
  const std::size_t total = std::size_t{run.producers} * per_producer;
  std::vector<std::vector<std::uint8_t>> counts(run.consumers, std::vector<std::uint8_t>(total, 0));
  std::vector<std::uint64_t> out_of_order(run.consumers, 0), bad_values(run.consumers, 0);

  auto push = [&](std::uint32_t value) {
    if (run.spin) {
      for (unsigned attempt = 0; !r.try_push(value);) backoff(attempt);
    } else {
      block_until(r.not_full(), Deadline::never(), [&] { return r.try_push(value); });
    }
  };

  {
    Threads consumers;
    for (std::uint32_t c = 0; c < run.consumers; ++c)
      consumers.spawn([&, c] {
        std::vector<std::int64_t> last(run.producers, -1);
        auto& mine = counts[c];
        for (;;) {
          std::uint32_t v = 0;
          if (run.spin) {
            for (unsigned attempt = 0; !r.try_pop(v);) backoff(attempt);
          } else {
            block_until(r.not_empty(), Deadline::never(), [&] { return r.try_pop(v); });
          }
          if (v == kStopValue) return;
          const std::uint32_t p = v >> kProducerShift, seq = v & kSequenceMask;
          if (p >= run.producers || seq >= per_producer) {
            ++bad_values[c];
            continue;
          }
          // A consumer's pops take increasing positions, as do a producer's
          // pushes, so each consumer sees each producer's sequence increase.
          if (static_cast<std::int64_t>(seq) <= last[p]) ++out_of_order[c];
          last[p] = seq;
          auto& n = mine[std::size_t{p} * per_producer + seq];
          if (n < 255) ++n;
        }
      });
    {
      Threads producers;
      for (std::uint32_t p = 0; p < run.producers; ++p)
        producers.spawn([&, p] {
          for (std::uint32_t seq = 0; seq < per_producer; ++seq) push(p << kProducerShift | seq);
        });
    }
    // Every value is in (or through) the ring now, so the stop values come last.
    for (std::uint32_t c = 0; c < run.consumers; ++c) push(kStopValue);
  }

  std::uint64_t lost = 0, duplicated = 0, disorder = 0, bad = 0;
  std::size_t first_bad = total;
  for (std::size_t i = 0; i < total; ++i) {
    unsigned seen = 0;
    for (std::uint32_t c = 0; c < run.consumers; ++c) seen += counts[c][i];
    if (seen == 0) ++lost;
    if (seen > 1) ++duplicated;
    if (seen != 1 && first_bad == total) first_bad = i;
  }
  for (std::uint32_t c = 0; c < run.consumers; ++c) {
    disorder += out_of_order[c];
    bad += bad_values[c];
  }
  std::uint32_t leftover = 0;
  CHECK_MSG(lost == 0 && duplicated == 0 && disorder == 0 && bad == 0 && !r.try_pop(leftover),
            run.producers << "P x " << run.consumers << "C, capacity " << run.capacity
                          << (run.spin ? ", spinning" : ", blocking") << ": lost " << lost << ", duplicated "
                          << duplicated << ", out of order " << disorder << ", bad values " << bad
                          << (first_bad < total ? ", first wrong item producer " : "")
                          << (first_bad < total ? std::to_string(first_bad / per_producer) + " seq " +
                                                      std::to_string(first_bad % per_producer)
                                                : std::string()));
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

// ---------------------------------------------------------------------------
// 4. ShuffleBuffer
// ---------------------------------------------------------------------------

constexpr std::size_t kPayload = 24;  // bytes of id-derived payload; the id field is 8 bytes

void payload_of(std::uint64_t id, std::uint8_t* out) {
  for (std::size_t j = 0; j < kPayload; ++j) out[j] = static_cast<std::uint8_t>((id * 31 + j * 7) % 251);
}

ExampleLayout id_layout(std::size_t batch_size) { return ExampleLayout({8, kPayload}, batch_size); }

BufferConfig make_config(std::size_t capacity, std::size_t batch, double echo, std::uint64_t seed) {
  BufferConfig config;
  config.capacity = capacity;
  config.batch_size = batch;
  config.echo_factor = echo;
  config.seed = seed;
  return config;
}

// One example by put() (two field pointers).
Status put_id(ShuffleBuffer& buf, std::uint64_t id, Deadline deadline) {
  std::uint8_t payload[kPayload];
  payload_of(id, payload);
  const void* fields[] = {&id, payload};
  return buf.put(fields, deadline);
}

// Stacked ids and payloads for put_many().
struct Rows {
  explicit Rows(const std::vector<std::uint64_t>& ids_in) : ids(ids_in), payloads(ids.size() * kPayload) {
    for (std::size_t i = 0; i < ids.size(); ++i) payload_of(ids[i], &payloads[i * kPayload]);
  }
  Status put(ShuffleBuffer& buf, std::size_t& done, Deadline deadline) const {
    const void* fields[] = {ids.data(), payloads.data()};
    return buf.put_many(fields, ids.size(), done, deadline);
  }
  std::vector<std::uint64_t> ids;
  std::vector<std::uint8_t> payloads;
};

// Reads batches as the consumer; checks shapes and payloads, counts ids.
struct Consumer {
  // Keeps a copy of the layout: batches stay readable after the buffer is gone.
  Consumer(const ShuffleBuffer& buf, std::uint64_t id_limit) : layout(buf.layout()), counts(id_limit, 0) {}

  // Checks one batch; "only the last batch is short" is checked as batches come.
  void take(const Batch& batch, bool record_order) {
    CHECK_MSG(batch.rows >= 1 && batch.rows <= layout.batch_size(),
              "batch of " << batch.rows << " rows, batch_size " << layout.batch_size());
    CHECK_MSG(!short_seen, "a batch followed a short batch");
    if (batch.rows < layout.batch_size()) short_seen = true;
    const std::byte* base = batch.lease->data();
    for (std::size_t row = 0; row < batch.rows; ++row) {
      std::uint64_t id = 0;
      std::memcpy(&id, base + layout.batch_offset(0) + row * 8, 8);
      CHECK_MSG(id < counts.size(), "unknown id " << id << " in row " << row);
      std::uint8_t want[kPayload];
      payload_of(id, want);
      CHECK_MSG(std::memcmp(want, base + layout.batch_offset(1) + row * kPayload, kPayload) == 0,
                "payload of id " << id << " corrupted (row " << row << ")");
      ++counts[id];
      if (record_order) order.push_back(id);
    }
    rows += batch.rows;
    ++batches;
  }

  // Takes batches until the end of the stream; each wait is bounded.
  void drain(ShuffleBuffer& buf, bool record_order = false) {
    Batch batch;
    for (;;) {
      const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
      if (st == Status::kClosed) return;
      CHECK_MSG(st == Status::kOk, "next() returned status " << static_cast<int>(st));
      take(batch, record_order);
    }
  }

  ExampleLayout layout;
  std::vector<std::uint32_t> counts;
  std::vector<std::uint64_t> order;
  std::uint64_t rows = 0;
  std::uint64_t batches = 0;
  bool short_seen = false;
  dataecho::BufferStats stats{};  // the buffer's, at the end of run_buffer
};

struct BufferRun {
  std::uint32_t producers;
  std::size_t capacity;
  std::size_t batch;
  double echo;
  bool drop_last;
  std::uint64_t items;
  std::uint64_t seed;
};

// Producers put ids p, p + P, p + 2P, ... by a seeded mix of put() and put_many()
// chunks; the last one to finish closes the buffer; the test thread consumes.
Consumer run_buffer(const BufferRun& run, bool record_order = false) {
  BufferConfig config = make_config(run.capacity, run.batch, run.echo, run.seed);
  config.drop_last = run.drop_last;
  ShuffleBuffer buf(id_layout(run.batch), config);
  Consumer consumer(buf, run.items);
  Errors errors;
  std::atomic<std::uint32_t> running{run.producers};
  {
    Threads producers([&] { buf.stop(); });
    for (std::uint32_t p = 0; p < run.producers; ++p)
      producers.spawn([&, p] {
        Rng rng(run.seed ^ (0xA5A5A5A5ull + p));
        std::uint64_t id = p;
        while (id < run.items) {
          const std::size_t chunk = rng.below(3) == 0 ? 1 : 1 + rng.below(48);
          std::vector<std::uint64_t> ids;
          for (; ids.size() < chunk && id < run.items; id += run.producers) ids.push_back(id);
          Status st;
          std::size_t done = 0;
          if (ids.size() == 1 && rng.below(2) == 0) {
            st = put_id(buf, ids[0], Deadline::never());
            done = st == Status::kOk;
          } else {
            st = Rows(ids).put(buf, done, Deadline::never());
          }
          if (st != Status::kOk || done != ids.size()) {
            errors.add("producer " + std::to_string(p) + ": status " + std::to_string(static_cast<int>(st)) +
                       " after " + std::to_string(done) + " of " + std::to_string(ids.size()) + " rows");
            break;
          }
        }
        if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) buf.close();
      });
    consumer.drain(buf, record_order);
    producers.join();
  }
  CHECK_MSG(errors.count() == 0, errors.summary());

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
  consumer.stats = stats;
  return consumer;
}

std::string describe(const BufferRun& run) {
  std::ostringstream s;
  s << run.producers << " producers, capacity " << run.capacity << ", batch " << run.batch << ", echo "
    << run.echo << (run.drop_last ? ", drop_last" : "") << ", " << run.items << " ids";
  return s.str();
}

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
        for (std::uint64_t id = 0; id < items; ++id)
          CHECK_MSG(c.counts[id] == static_cast<std::uint32_t>(echo),
                    describe(run) << ": id " << id << " delivered " << c.counts[id] << " times");
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
  std::uint64_t delivered = 0;
  // Echo 1.5: each id once or twice, about half of them twice.
  for (auto [producers, capacity, batch] :
       {std::tuple{4u, std::size_t{64}, std::size_t{16}}, std::tuple{8u, std::size_t{7}, std::size_t{3}}}) {
    const std::uint64_t n = capacity < 16 ? items / 10 : items;
    const BufferRun run{producers, capacity, batch, 1.5, false, n, run_seed(2000 + capacity)};
    const Consumer c = run_buffer(run);
    std::uint64_t twice = 0;
    for (std::uint64_t id = 0; id < n; ++id) {
      CHECK_MSG(c.counts[id] == 1 || c.counts[id] == 2,
                describe(run) << ": id " << id << " delivered " << c.counts[id] << " times");
      twice += c.counts[id] == 2;
    }
    // The mean echo is 1 + Binomial(n, 0.5) / n: six standard deviations of slack.
    const double mean = 1.0 + static_cast<double>(twice) / static_cast<double>(n);
    CHECK_MSG(std::fabs(mean - 1.5) < 3.0 / std::sqrt(static_cast<double>(n)), describe(run)
                                                                                   << ": mean echo " << mean);
    delivered += c.rows;
  }
  // drop_last: no short batch, each id at most e times, fewer than a batch of echoes dropped.
  for (auto [producers, capacity, batch, echo] : {std::tuple{4u, std::size_t{64}, std::size_t{16}, 2.0},
                                                  std::tuple{1u, std::size_t{7}, std::size_t{3}, 1.5},
                                                  std::tuple{8u, std::size_t{1024}, std::size_t{100}, 1.0}}) {
    const std::uint64_t n = items / 4 + 7;  // not a multiple of the batch
    const BufferRun run{producers, capacity, batch, echo, true, n, run_seed(3000 + capacity)};
    const Consumer c = run_buffer(run);
    const auto most = static_cast<std::uint32_t>(std::ceil(echo));
    std::uint64_t missing = 0;  // ids never delivered: each lost all its echoes to the drop
    for (std::uint64_t id = 0; id < n; ++id) {
      CHECK_MSG(c.counts[id] <= most, describe(run)
                                          << ": id " << id << " delivered " << c.counts[id] << " times");
      missing += c.counts[id] == 0;
    }
    CHECK_MSG(missing <= c.stats.dropped, describe(run) << ": " << missing << " ids never delivered, "
                                                        << c.stats.dropped << " echoes dropped");
    if (echo == std::floor(echo))
      CHECK(c.rows + c.stats.dropped == n * most);
    else
      CHECK(c.rows + c.stats.dropped >= n && c.rows + c.stats.dropped <= n * most);
    CHECK(c.rows % batch == 0);
    delivered += c.rows;
  }
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

// Deterministic intake with several producers, and resume: a buffer restored
// from a snapshot taken after batch k (its resident examples put again by
// sequence number) yields exactly what the uninterrupted buffer yielded after k.
namespace snapshot_test {

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

Status put_seq(ShuffleBuffer& buf, std::uint64_t id) {
  std::uint8_t payload[kPayload];
  payload_of(id, payload);
  const void* fields[] = {&id, payload};
  return buf.producer().put(fields, Deadline::never(), id);  // the id is the sequence number
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

// Four producers claim ids from `next` up to the end and put them; the last closes.
void produce(Threads& threads, ShuffleBuffer& buf, std::atomic<std::uint64_t>& next, std::uint64_t end,
             std::atomic<int>& running, Gate* gate = nullptr) {
  for (int p = 0; p < 4; ++p)
    threads.spawn([&buf, &next, &running, end, gate] {  // `end` by value: this function returns first
      for (;;) {
        // relaxed: the counter only hands out distinct ids.
        const std::uint64_t id = next.fetch_add(1, std::memory_order_relaxed);
        if (id >= end) break;
        if (gate != nullptr) gate->pass(id);
        if (put_seq(buf, id) != Status::kOk) break;
      }
      if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) buf.close();
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
  std::atomic<std::uint64_t> next{0};
  std::atomic<int> running{4};
  Gate gate;
  if (starve_at > 0) gate.limit = starve_at;
  Threads threads([&] {
    gate.open();
    buf.stop();
  });
  produce(threads, buf, next, plan.items, running, &gate);
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
  threads.join();
  return consumer.order;
}

std::vector<std::uint64_t> resume(const Plan& plan, const Snapshot& snapshot) {
  BufferConfig config = config_of(plan);
  config.restore = std::make_shared<const Snapshot>(snapshot);
  ShuffleBuffer buf(id_layout(plan.batch), config);
  Consumer consumer(buf, plan.items);
  for (const std::vector<std::uint64_t>& rows : snapshot.queued)  // assembled before: yielded first
    consumer.order.insert(consumer.order.end(), rows.begin(), rows.end());
  if (snapshot.ended) return consumer.order;
  for (std::uint64_t seq : snapshot.seqs) CHECK(put_seq(buf, seq) == Status::kOk);
  std::atomic<std::uint64_t> next{snapshot.next_seq};
  std::atomic<int> running{4};
  Threads threads([&] { buf.stop(); });
  produce(threads, buf, next, plan.items, running);
  consumer.drain(buf, true);
  threads.join();
  return consumer.order;
}

}  // namespace snapshot_test

std::string test_buffer_snapshot() {
  using namespace snapshot_test;
  const std::uint64_t n = std::max<std::uint64_t>(2000, g_options.items / 400);
  const Plan plans[] = {{64, 8, 1.5, n, run_seed(4100)}, {7, 3, 2.0, n, run_seed(4101)},
                        {256, 32, 1.0, n, run_seed(4102)}};
  std::size_t resumes = 0;
  for (const Plan& plan : plans) {
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
  }
  // Snapshots while the assembler waits for input part-way through filling for
  // a batch: served there (not only between batches), and as good.
  std::size_t starved = 0;
  for (const Plan& plan : plans) {
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
  }
  std::ostringstream s;
  s << "4 producers, deterministic order; " << resumes << " resumes from snapshots between batches and " << starved
    << " taken while waiting for input, each equal to the uninterrupted run";
  return s.str();
}

// In order (deterministic intake, echo 1, FIFO draws): four producers racing,
// and the batches still hold 0, 1, 2, ... in order, the last one short; a
// resume from a snapshot at any batch goes on in order.
std::string test_buffer_in_order() {
  using namespace snapshot_test;
  const std::uint64_t n = std::max<std::uint64_t>(2001, g_options.items / 400 + 1);
  const Plan plans[] = {{64, 8, 1.0, n, run_seed(4200), true}, {6, 3, 1.0, n, run_seed(4201), true},
                        {256, 100, 1.0, n, run_seed(4202), true}};
  std::vector<std::uint64_t> expected(n);
  for (std::uint64_t i = 0; i < n; ++i) expected[i] = i;
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
  s << "4 producers, " << n << " items in order in 3 configurations (short last batch), " << resumes
    << " resumes in order";
  return s.str();
}

// Map-style intake as dataecho's producers run it: threads claim ranges of a
// shuffled order (claim_range) and put_each rows gathered by pointer from a
// source table. Every position is claimed once and every row arrives intact;
// with in-order intake, in the order's sequence.
// A producer: claims ranges of positions until none are left, and puts row
// order[position] of `table` for each, tagged with its position; with `hold`,
// two rows in three by reference (owner = row + 1), the rest copied.
void put_claimed(ShuffleBuffer& buf, const Rows& table, const std::vector<std::uint64_t>& order, std::uint32_t p,
                 std::uint64_t seed, bool hold, Errors& errors) {
  Rng rng(seed ^ (0x9E37ull * (p + 1)));
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
    if (st != Status::kOk || done != count) {
      errors.add("producer " + std::to_string(p) + ": status " + std::to_string(static_cast<int>(st)));
      return;
    }
  }
}

std::string test_buffer_put_each() {
  const std::uint64_t n = std::max<std::uint64_t>(5000, g_options.items / 200);
  std::vector<std::uint64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = i;
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
    Errors errors;
    std::atomic<std::uint32_t> running{kProducers};
    {
      Threads producers([&] { buf.stop(); });
      for (std::uint32_t p = 0; p < kProducers; ++p)
        producers.spawn([&, p] {
          put_claimed(buf, table, order, p, run_seed(4302), false, errors);
          if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) buf.close();
        });
      consumer.drain(buf, true);
      producers.join();
    }
    CHECK_MSG(errors.count() == 0, errors.summary());
    for (std::uint64_t i = 0; i < n; ++i) CHECK_MSG(consumer.counts[i] == 1, "id " << i << " came " << consumer.counts[i] << " times");
    if (in_order) CHECK_MSG(consumer.order == order, "in-order intake: not in the order's sequence");
  }
  std::ostringstream s;
  s << kProducers << " producers claiming ranges, " << n << " rows put by pointer, each once; in order when asked";
  return s.str();
}

// Held values: the payload field is holdable; two rows in three are handed
// over by reference (owner = id + 1), the rest copied. Every owner comes back
// exactly once, with or after the batch of its example's last echo: the
// consumer then overwrites the row it was held from, so a gather from it after
// that would show as a corrupt payload (and as a race under TSan).
std::string test_buffer_held() {
  const std::uint64_t n = std::max<std::uint64_t>(6000, g_options.items / 200);
  std::vector<std::uint64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = i;
  Rows table(ids);
  constexpr std::uint32_t kProducers = 4;
  for (const double echo : {1.0, 2.0, 1.5}) {
    for (std::uint64_t i = 0; i < n; ++i) payload_of(i, &table.payloads[i * kPayload]);
    BufferConfig config = make_config(128, 16, echo, run_seed(4400) + static_cast<std::uint64_t>(echo * 2));
    ShuffleBuffer buf(ExampleLayout({8, kPayload}, 16, {}, kPayload), config);
    CHECK(buf.layout().holdable_fields() == std::vector<std::size_t>{1});
    buf.set_index_range(0, n);
    Consumer consumer(buf, n);
    std::vector<std::uint32_t> returned(n, 0), delivered_then(n, 0);
    std::uint64_t held = 0;
    Errors errors;
    std::atomic<std::uint32_t> running{kProducers};
    {
      Threads producers([&] { buf.stop(); });
      for (std::uint32_t p = 0; p < kProducers; ++p)
        producers.spawn([&, p] {
          put_claimed(buf, table, ids, p, run_seed(4401), true, errors);
          if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) buf.close();
        });
      Batch batch;
      for (;;) {
        const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
        if (st == Status::kClosed) break;
        CHECK_MSG(st == Status::kOk, "next() returned status " << static_cast<int>(st));
        consumer.take(batch, false);
        for (const std::uint64_t owner : batch.unheld) {
          CHECK_MSG(owner >= 1 && owner <= n && (owner - 1) % 3 != 0, "unexpected owner " << owner);
          ++returned[owner - 1];
          delivered_then[owner - 1] = consumer.counts[owner - 1];
          std::memset(&table.payloads[(owner - 1) * kPayload], 0xDB, kPayload);  // no longer read by anyone
          ++held;
        }
      }
      producers.join();
    }
    CHECK_MSG(errors.count() == 0, errors.summary());
    for (std::uint64_t i = 0; i < n; ++i) {
      CHECK_MSG(consumer.counts[i] >= 1, "id " << i << " never came");
      if (echo == static_cast<double>(static_cast<std::uint32_t>(echo)))
        CHECK_MSG(consumer.counts[i] == static_cast<std::uint32_t>(echo), "id " << i << " came " << consumer.counts[i] << " times");
      if (i % 3 == 0) continue;
      CHECK_MSG(returned[i] == 1, "owner of id " << i << " came back " << returned[i] << " times");
      CHECK_MSG(delivered_then[i] == consumer.counts[i], "id " << i << " delivered after its owner came back");
    }
    CHECK(buf.free_slots() == 128);
    CHECK_MSG(held == n - (n + 2) / 3, held << " owners came back");
  }
  std::ostringstream s;
  s << kProducers << " producers, " << n << " ids, two in three held by reference, echo 1, 2, 1.5: each owner back once, after its last echo";
  return s.str();
}

// Deadlines: next() on an empty open buffer times out; a put on a full buffer
// times out and put_many resumes where it stopped.
std::string test_buffer_timeouts() {
  {
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
    for (std::uint64_t id = 0; id < 5; ++id) CHECK(c.counts[id] == 1);
    CHECK(buf.next(batch, Deadline::never()) == Status::kClosed);  // the end is sticky
    CHECK(buf.free_slots() == 64);
  }
  {
    BufferConfig config = make_config(4, 2, 1.0, run_seed(5001));
    config.prefetch = 1;
    ShuffleBuffer buf(id_layout(2), config);
    std::vector<std::uint64_t> ids(100);
    for (std::uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
    const Rows rows(ids);
    std::size_t done = 0;
    // No consumer: slots run out, and the put gives up at its deadline.
    const auto start = Clock::now();
    CHECK(rows.put(buf, done, Deadline::after_seconds(0.05)) == Status::kTimeout);
    CHECK(seconds_since(start) >= 0.05);
    CHECK_MSG(done >= 1 && done < ids.size(), "done " << done);
    CHECK(buf.stats().producer_wait_s > 0);
    CHECK(put_id(buf, 1000, Deadline::now()) == Status::kTimeout);
    Consumer c(buf, ids.size());
    {
      Threads consumer([&] { buf.stop(); });
      consumer.spawn([&] {
        try {
          c.drain(buf);
        } catch (const TestFailure&) {  // reported already; the checks below fail too
        }
      });
      CHECK(rows.put(buf, done, Deadline::after_seconds(g_options.timeout_s)) == Status::kOk);
      CHECK(done == ids.size());
      buf.close();
    }
    for (std::uint64_t id = 0; id < ids.size(); ++id)
      CHECK_MSG(c.counts[id] == 1, "id " << id << ": " << c.counts[id]);
    CHECK(buf.free_slots() == 4);
  }
  return "next() times out on an empty/underfilled open buffer; put times out; put_many resumes";
}

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

// Producers that put fresh ids until a put fails; they report the failing status.
struct Flood {
  Flood(ShuffleBuffer& buf, std::uint32_t producers)
      : statuses(producers, Status::kOk), last_id(producers, 0), threads([&buf] { buf.stop(); }) {
    for (std::uint32_t p = 0; p < producers; ++p)
      threads.spawn([this, &buf, p, producers] {
        for (std::uint64_t id = p;; id += producers) {
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
  // Upper bound on the ids accepted (valid after join).
  std::uint64_t id_limit() const { return *std::max_element(last_id.begin(), last_id.end()) + 1; }

  std::vector<Status> statuses;
  std::vector<std::uint64_t> last_id;  // per producer: the last id accepted
  std::atomic<std::uint64_t> accepted{0};
  Threads threads;  // last: joined before the members above are destroyed
};

std::string test_buffer_close() {
  // close() with producers blocked on a full buffer: each gets kClosed, and what
  // was accepted is still delivered, echoes included.
  for (std::uint32_t producers : {1u, 4u}) {
    BufferConfig config = make_config(8, 4, 2.0, run_seed(6000 + producers));
    config.prefetch = 1;
    ShuffleBuffer buf(id_layout(4), config);
    Flood flood(buf, producers);
    wait_until_blocked(buf, flood.accepted);
    buf.close();
    flood.threads.join();
    for (Status st : flood.statuses)
      CHECK_MSG(st == Status::kClosed, "blocked producer got status " << static_cast<int>(st));
    CHECK(buf.closed());
    Consumer c(buf, flood.id_limit());
    c.drain(buf);
    const std::uint64_t accepted = flood.accepted.load();
    std::uint64_t ids = 0;
    for (auto n : c.counts) {
      CHECK_MSG(n == 0 || n == 2, "an accepted id was delivered " << n << " times");
      ids += n == 2;
    }
    CHECK_MSG(ids == accepted, "delivered " << ids << " distinct ids, accepted " << accepted);
    CHECK(buf.free_slots() == 8);
  }
  return "blocked producers get kClosed; everything accepted is delivered after close";
}

std::string test_buffer_stop() {
  // Producers blocked on a full buffer (no consumer): stop() releases them.
  {
    BufferConfig config = make_config(8, 4, 1.0, run_seed(7000));
    config.prefetch = 1;
    ShuffleBuffer buf(id_layout(4), config);
    Flood flood(buf, 8);
    wait_until_blocked(buf, flood.accepted);
    buf.stop();
    flood.threads.join();
    for (Status st : flood.statuses) CHECK(st == Status::kClosed);
    Batch batch;
    CHECK(buf.next(batch, Deadline::never()) == Status::kClosed);  // queued batches are dropped
  }
  // A consumer blocked on an empty open buffer: stop() releases it. (Producers
  // and the consumer cannot both be blocked at once: with no free slot and no
  // batch, every slot would be resident, and then a batch can be made.)
  {
    ShuffleBuffer buf(id_layout(16), make_config(64, 16, 1.0, run_seed(7001)));
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
  // each repeatedly blocking on the other, all return.
  const int rounds = 12;
  Rng rng(run_seed(7002));
  std::uint64_t moved = 0;
  for (int round = 0; round < rounds; ++round) {
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
    flood.threads.join();
    for (Status st : flood.statuses) CHECK(st == Status::kClosed);
    CHECK(consumer_status.load() == static_cast<int>(Status::kClosed));
    moved += consumed.load();
  }
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
      flood.threads.join();
      for (Status st : flood.statuses) CHECK(st == Status::kClosed);
      accepted = flood.accepted.load();
    }
    CHECK(accepted > 0);
    // Destroyed with a batch queued, slots resident and committed, and (after
    // close) a stream that still had echoes to deliver.
    buf.reset();
    ++destroyed;
    held_reader.take(held, false);  // payloads intact: the lease outlived the buffer
  }
  // Destroyed with a consumer that was released by stop() and joined.
  {
    auto buf = std::make_unique<ShuffleBuffer>(id_layout(4), make_config(16, 4, 1.0, run_seed(8002)));
    Threads consumer([&] { buf->stop(); });
    std::atomic<int> status{-1};
    consumer.spawn([&] {
      Batch batch;
      status.store(static_cast<int>(buf->next(batch, Deadline::never())), std::memory_order_release);
    });
    sleep_ms(10);
    buf->stop();
    consumer.join();
    CHECK(status.load() == static_cast<int>(Status::kClosed));
    buf.reset();
    ++destroyed;
  }
  // Created and destroyed at once, and mid-stream with nobody inside a call:
  // the assembler thread starts and stops cleanly.
  Rng rng(run_seed(8003));
  for (int i = 0; i < 200; ++i) {
    auto buf = std::make_unique<ShuffleBuffer>(id_layout(2), make_config(4, 2, 1.5, rng.next()));
    for (std::uint64_t id = 0; id < rng.below(4); ++id)
      CHECK(put_id(*buf, id, Deadline::never()) == Status::kOk);
    if (i % 3 == 0) buf->close();
    buf.reset();
    ++destroyed;
  }
  std::ostringstream s;
  s << destroyed << " buffers destroyed after close/stop + join; held batches outlive their buffer";
  return s.str();
}

// ---------------------------------------------------------------------------
// 5. Ragged fields: the page heap, and buffers whose examples hold ragged values
// ---------------------------------------------------------------------------

namespace ragged_test {

using dataecho::kNoPage;
using dataecho::PageHeap;
using dataecho::PageHeapState;

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

ExampleLayout layout(std::size_t batch) { return ExampleLayout({8, 4, 16}, batch, {false, true, true}); }

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
  std::vector<std::uint32_t> counts;
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
    CHECK_MSG(id < run.items, "unknown id " << id << " in row " << row);
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
    ++out.counts[id];
    if (run.deterministic) out.order.push_back(id);
  }
  CHECK(batch.lease->values_used(0) == static_cast<std::size_t>(offsets[0][batch.rows]) * 4);
  out.rows += batch.rows;
  ++out.batches;
}

// Producers put ids p, p + P, ... one at a time or in put_each chunks; the last closes.
Outcome run_buffer(const Run& run) {
  BufferConfig config = make_config(run.capacity, run.batch, run.echo == 0 ? 1.0 : run.echo, run.seed);
  config.auto_echo = run.echo == 0;
  config.max_echo = 3;
  config.pages = run.pages;
  config.page_bytes = run.page_bytes;
  config.deterministic = run.deterministic;
  ShuffleBuffer buf(layout(run.batch), config);
  Outcome out;
  out.counts.assign(run.items, 0);
  Errors errors;
  std::atomic<std::uint32_t> running{run.producers};
  {
    Threads producers([&] { buf.stop(); });
    for (std::uint32_t p = 0; p < run.producers; ++p)
      producers.spawn([&, p] {
        Rng rng(run.seed ^ (0x5A5A5A5Aull + p));
        std::uint64_t id = p;
        while (id < run.items) {
          const std::size_t chunk = rng.below(2) == 0 ? 1 : 1 + rng.below(12);
          std::vector<Example> examples;
          for (; examples.size() < chunk && id < run.items; id += run.producers) examples.emplace_back(id, run.longest);
          std::vector<const void*> pointers;
          std::vector<std::uint64_t> lengths;
          for (const Example& e : examples) {
            pointers.insert(pointers.end(), {&e.id, e.tokens.data(), e.boxes.data()});
            lengths.insert(lengths.end(), {e.rows[0], e.rows[1]});
          }
          std::size_t done = 0;
          Status st;
          if (examples.size() == 1 && !run.deterministic) {
            st = buf.put(pointers.data(), Deadline::never(), lengths.data());
            done = st == Status::kOk;
          } else {
            // Deterministic: one at a time, numbered by id (put_each numbers consecutively).
            st = Status::kOk;
            for (std::size_t i = 0; i < examples.size() && st == Status::kOk; ++i) {
              std::size_t one = 0;
              st = run.deterministic ? buf.producer().put_each(pointers.data() + 3 * i, 1, one, Deadline::never(),
                                                               examples[i].id, lengths.data() + 2 * i)
                                     : buf.producer().put_each(pointers.data() + 3 * i, 1, one, Deadline::never(),
                                                               0, lengths.data() + 2 * i);
              done += one;
            }
          }
          if (st != Status::kOk || done != examples.size()) {
            errors.add("producer " + std::to_string(p) + ": status " + std::to_string(static_cast<int>(st)));
            break;
          }
        }
        if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) buf.close();
      });
    Batch batch;
    for (;;) {
      const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
      if (st == Status::kClosed) break;
      CHECK_MSG(st == Status::kOk, describe(run) << ": next() returned " << static_cast<int>(st));
      take(buf.layout(), batch, run, out);
    }
    producers.join();
  }
  CHECK_MSG(errors.count() == 0, errors.summary());
  out.stats = buf.stats();
  CHECK_MSG(out.stats.pages_in_use == 0, describe(run) << ": " << out.stats.pages_in_use << " pages still held");
  CHECK_MSG(buf.free_slots() == run.capacity, describe(run) << ": free slots " << buf.free_slots());
  CHECK(out.stats.fresh == run.items && out.stats.delivered == out.rows);
  return out;
}

// Pages taken and given back as chains by 8 threads: a page is never held by
// two at once, chains are whole, and every page is free at the end.
std::string test_page_heap() {
  const std::size_t pages = 1000;
  const std::size_t page_bytes = 64;
  std::vector<std::byte> data(pages * page_bytes);
  std::vector<std::atomic<std::uint32_t>> next(pages);
  std::vector<std::atomic<std::uint8_t>> held(pages);
  PageHeapState state(false);
  const PageHeap heap(&state, next.data(), data.data(), pages, page_bytes);
  heap.format();
  Errors errors;
  std::atomic<std::uint64_t> moved{0};
  const std::uint64_t rounds = std::max<std::uint64_t>(2000, g_options.items / 200);
  {
    Threads threads;
    for (int t = 0; t < 8; ++t)
      threads.spawn([&, t] {
        Rng rng(run_seed(7000 + static_cast<std::uint64_t>(t)));
        for (std::uint64_t round = 0; round < rounds; ++round) {
          const std::size_t count = 1 + rng.below(rng.below(4) == 0 ? 300 : 8);
          std::uint32_t first, last;
          const Status st = heap.pop_blocking(count, first, last, Deadline::never(), [] { return false; }, [] {});
          if (st != Status::kOk) return errors.add("pop_blocking failed");
          std::uint32_t page = first;
          for (std::size_t i = 0; i < count; ++i) {
            if (page >= pages || held[page].exchange(1) != 0)
              return errors.add("page " + std::to_string(page) + " taken twice (or out of range)");
            std::memset(heap.page(page), t, page_bytes);
            if (i + 1 < count) page = heap.next(page);
          }
          if (page != last) return errors.add("the chain does not end at its last page");
          page = first;
          for (std::size_t i = 0; i < count; ++i) {
            if (static_cast<int>(heap.page(page)[page_bytes - 1]) != t) errors.add("a page was written by another");
            held[page].store(0);
            if (i + 1 < count) page = heap.next(page);
          }
          heap.push(first, last, count);
          moved.fetch_add(count, std::memory_order_relaxed);
        }
      });
  }
  CHECK_MSG(errors.count() == 0, errors.summary());
  CHECK(heap.in_use() == 0);
  std::uint32_t first, last;
  CHECK_MSG(heap.try_pop(pages, first, last), "not every page is free at the end");
  std::ostringstream s;
  s << "8 threads, " << moved.load() << " pages taken and given back in chains of 1 to 300; none held twice";
  return s.str();
}

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
        const std::size_t biggest = (shape.longest * 4 + shape.page_bytes - 1) / shape.page_bytes +
                                    (6 * 16 + shape.page_bytes - 1) / shape.page_bytes;
        const std::size_t pages = shape.tight ? 2 * biggest : shape.capacity * biggest;
        const Run run{producers, shape.capacity, shape.batch, echo, items, shape.longest,
                      pages, shape.page_bytes, run_seed(8000 + static_cast<std::uint64_t>(runs))};
        const Outcome out = run_buffer(run);
        for (std::uint64_t id = 0; id < items; ++id) {
          const bool ok = echo == 1.5 ? (out.counts[id] == 1 || out.counts[id] == 2)
                                      : out.counts[id] == static_cast<std::uint32_t>(echo);
          CHECK_MSG(ok, describe(run) << ": id " << id << " delivered " << out.counts[id] << " times");
        }
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
    const Outcome out = run_buffer(run);
    for (std::uint64_t id = 0; id < items; ++id)
      CHECK_MSG(out.counts[id] >= 1 && out.counts[id] <= 3,
                describe(run) << ": id " << id << " delivered " << out.counts[id] << " times");
  }
  // Deterministic: the same order with 1 and 4 producers, when the budget holds the buffer.
  Run run{1, 64, 16, 2.0, items, 300, 64 * 25, 64, run_seed(8600), true};
  const Outcome one = run_buffer(run);
  run.producers = 4;
  const Outcome four = run_buffer(run);
  CHECK_MSG(one.order == four.order, "deterministic order differs between 1 and 4 producers");
  for (std::uint64_t id = 0; id < items; ++id) CHECK(one.counts[id] == 2);
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
  ShuffleBuffer buf(layout(1), config);
  Example full(0, 0);
  full.tokens.assign(64, 7);
  full.rows[0] = 64;
  full.rows[1] = 0;
  const void* fields[] = {&full.id, full.tokens.data(), full.boxes.data()};
  CHECK(buf.put(fields, Deadline::never(), full.rows) == Status::kOk);   // batch 0: the ready queue is full
  CHECK(buf.put(fields, Deadline::never(), full.rows) == Status::kOk);   // resident; holds every page
  const Status timed = buf.put(fields, Deadline::after_seconds(0.05), full.rows);
  CHECK_MSG(timed == Status::kTimeout, "a put without pages returned " << static_cast<int>(timed));
  CHECK_MSG(buf.free_slots() == 7, "free slots " << buf.free_slots() << ": the timed-out put kept its slot");
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

}  // namespace ragged_test

// ---------------------------------------------------------------------------
// Batch pool and blocks
// ---------------------------------------------------------------------------

std::string test_batch_pool() {
  // Blocks of every size class (heap, mapped, mapped and huge) are aligned as
  // asked and writable to their last byte (ASan checks the bounds).
  for (std::size_t size : {std::size_t{100}, Block::kMapFrom - 1, Block::kMapFrom, std::size_t{3} << 20,
                           Block::kHugePageFrom + 12345}) {
    for (std::size_t align : {std::size_t{64}, std::size_t{4096}}) {
      Block block = Block::allocate(size, align);
      const std::size_t want = size >= Block::kHugePageFrom ? Block::kHugePage : align;
      CHECK_MSG(reinterpret_cast<std::uintptr_t>(block.data()) % want == 0,
                "block of " << size << " bytes not aligned to " << want);
      CHECK(block.size() == size);
      std::memset(block.data(), 0xAB, size);
      CHECK(static_cast<unsigned char>(block.data()[size - 1]) == 0xAB);
    }
  }
  // The pool keeps at most keep_free given-back blocks and frees the rest.
  const std::size_t keep_free = 3;
  auto pool = BatchPool::create(Block::kMapFrom, 64, keep_free);
  std::vector<std::shared_ptr<BatchPool::Lease>> held;
  for (int i = 0; i < 40; ++i) held.push_back(pool->lease());
  CHECK(pool->allocated() == 40);
  held.clear();
  CHECK_MSG(pool->allocated() == keep_free, "allocated " << pool->allocated() << " after all were given back");
  // Reuse before allocating: a steady consumer allocates nothing new.
  for (int round = 0; round < 100; ++round) {
    auto a = pool->lease();
    auto b = pool->lease();
    CHECK(a->data() != b->data());
  }
  CHECK(pool->allocated() == keep_free);
  return "blocks aligned and whole in every size class; the pool frees what it does not keep";
}

// ---------------------------------------------------------------------------
// Runner
// ---------------------------------------------------------------------------

struct Test {
  const char* name;
  std::string (*run)();
};

const Test kTests[] = {
    {"rng", test_rng},
    {"reservoir", test_reservoir},
    {"ring_basic", test_ring_basic},
    {"ring_blocking", test_ring_blocking},
    {"ring_stress", test_ring_stress},
    {"batch_pool", test_batch_pool},
    {"buffer_accounting", test_buffer_accounting},
    {"buffer_fractional_drop_last", test_buffer_fractional_and_drop_last},
    {"buffer_deterministic", test_buffer_deterministic},
    {"buffer_in_order", test_buffer_in_order},
    {"buffer_put_each", test_buffer_put_each},
    {"buffer_held", test_buffer_held},
    {"buffer_snapshot", test_buffer_snapshot},
    {"buffer_timeouts", test_buffer_timeouts},
    {"buffer_close", test_buffer_close},
    {"buffer_stop", test_buffer_stop},
    {"buffer_destroy", test_buffer_destroy},
    {"page_heap", ragged_test::test_page_heap},
    {"buffer_ragged", ragged_test::test_buffer_ragged},
    {"buffer_ragged_modes", ragged_test::test_buffer_ragged_modes},
    {"buffer_ragged_blocking", ragged_test::test_buffer_ragged_blocking},
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "dataecho_tests: %s\n"
               "usage: dataecho_tests [--seed N] [--items N] [--timeout-s S] [--only SUBSTRING]\n",
               why);
  std::exit(2);
}

std::uint64_t parse_number(const char* text, const char* option) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 0);
  if (end == text || *end != '\0') usage((std::string("bad value for ") + option).c_str());
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") usage("native tests for the dataecho core");
    if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
    const char* value = argv[++i];
    if (arg == "--seed")
      o.seed = parse_number(value, "--seed");
    else if (arg == "--items")
      o.items = std::max<std::uint64_t>(1, parse_number(value, "--items"));
    else if (arg == "--timeout-s")
      o.timeout_s = static_cast<double>(std::max<std::uint64_t>(1, parse_number(value, "--timeout-s")));
    else if (arg == "--only")
      o.only = value;
    else
      usage(("unknown option " + arg).c_str());
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  g_options = parse(argc, argv);
  std::snprintf(g_seed_text, sizeof g_seed_text, "%llu", static_cast<unsigned long long>(g_options.seed));
  std::signal(SIGABRT, on_fatal_signal);
  std::printf("dataecho_tests: seed %llu, items %llu, %u hardware threads\n",
              static_cast<unsigned long long>(g_options.seed),
              static_cast<unsigned long long>(g_options.items), std::thread::hardware_concurrency());
  std::fflush(stdout);
  Watchdog watchdog;
  int passed = 0, failed = 0;
  const auto start = Clock::now();
  for (const Test& test : kTests) {
    if (!g_options.only.empty() && std::string(test.name).find(g_options.only) == std::string::npos) continue;
    g_test = test.name;
    watchdog.arm(test.name, g_options.timeout_s);
    const auto t0 = Clock::now();
    std::string summary;
    g_first_failure.clear();
    bool ok = true;
    try {
      summary = test.run();
    } catch (const TestFailure&) {
      ok = false;
      summary = g_first_failure;
    } catch (const std::exception& e) {
      ok = false;
      summary = std::string("exception: ") + e.what();
    }
    watchdog.disarm();
    std::printf("%s %-28s %6.2f s  %s\n", ok ? "PASS" : "FAIL", test.name, seconds_since(t0),
                summary.c_str());
    std::fflush(stdout);
    (ok ? passed : failed) += 1;
  }
  std::printf("dataecho_tests: %d passed, %d failed in %.2f s (seed %llu)\n", passed, failed,
              seconds_since(start), static_cast<unsigned long long>(g_options.seed));
  return failed == 0 && passed > 0 ? 0 : 1;
}
