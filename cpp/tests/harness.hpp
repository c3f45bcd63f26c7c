// The harness every native test file shares: options, CHECK and failure
// reporting, worker-thread plumbing (Errors, Threads), the watchdog, the test
// registry entry, and small statistics helpers.
//
// No framework: a failed CHECK prints file:line, the test and the seed, then
// throws TestFailure; main.cpp reports the test FAIL and the program exits
// non-zero at the end. Worker threads never CHECK: they record into Errors and
// the test thread checks after joining them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dataecho/rng.hpp"

namespace dataecho_test {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Options and the test registry
// ---------------------------------------------------------------------------

struct Options {
  std::uint64_t seed = 20240611;
  std::uint64_t items = 2'000'000;  // scales every stress size
  double timeout_s = 60;
  std::string only;
};

// Set once by main() before any test runs; read-only afterwards.
inline Options g_options;

// A test returns a one-line summary of what it checked, or throws TestFailure.
struct Test {
  const char* name;
  std::string (*run)();
};

// ---------------------------------------------------------------------------
// Failure reporting and CHECK
// ---------------------------------------------------------------------------

inline const char* volatile g_test = "";  // volatile: the abort handler reads it
inline std::string g_first_failure;       // of the current test, for its FAIL line

struct TestFailure : std::exception {};

[[noreturn]] inline void check_failed(const char* expr, const char* file, unsigned line,
                                      const std::string& detail) {
  std::ostringstream where;
  where << file << ":" << line << ": " << expr << (detail.empty() ? "" : ": ") << detail;
  std::fprintf(stderr, "  CHECK failed at %s (test %s, seed %llu)\n", where.str().c_str(), g_test,
               static_cast<unsigned long long>(g_options.seed));
  std::fflush(stderr);
  if (g_first_failure.empty()) g_first_failure = where.str();
  throw TestFailure{};
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

// ---------------------------------------------------------------------------
// Time and seeds
// ---------------------------------------------------------------------------

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// A distinct, reproducible seed for each run of a test.
inline std::uint64_t run_seed(std::uint64_t salt) {
  return dataecho::Rng(g_options.seed ^ (salt * 0x9E3779B97F4A7C15ull)).next();
}

// ---------------------------------------------------------------------------
// Worker threads
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------

// Kills the process if one test runs past its time: a hang (a lost wake-up) is a
// failure too, and must not become a hung CI job.
class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
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
  std::thread thread_;  // last: starts once the members above exist
};

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

// Pearson's statistic against a uniform expectation.
inline double chi_square(const std::vector<std::uint64_t>& observed) {
  std::uint64_t total = 0;
  for (auto o : observed) total += o;
  const double expected = static_cast<double>(total) / static_cast<double>(observed.size());
  double chi = 0;
  for (auto o : observed)
    chi += (static_cast<double>(o) - expected) * (static_cast<double>(o) - expected) / expected;
  return chi;
}

// A loose bound for chi_square: mean k plus six standard deviations plus a
// margin (p < 1e-6 for the k used here), so a seed never fails by bad luck.
inline double chi_square_bound(std::size_t cells) {
  const double k = static_cast<double>(cells - 1);
  return k + 6 * std::sqrt(2 * k) + 10;
}

}  // namespace dataecho_test
