// Native tests for the dataecho core: the generator, the reservoir, the ring,
// the batch pool, the page heap and the shuffle buffer, with exact per-item
// accounting under contention. This file parses the command line and runs the
// tests in the order listed below; the tests live in test_*.cpp by header
// family, sharing harness.hpp, deliveries.hpp, examples.hpp and producers.hpp.
//
// A watchdog bounds every test in time (a lost wake-up shows as a TIMEOUT,
// not a hung CI job).
//
// Usage: dataecho_tests [--seed N] [--items N] [--timeout-s S] [--only SUBSTRING]
//   --items scales every stress size; the default moves about 2 million values
//   through the ring tests and runs in a few seconds in a Release build.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "harness.hpp"
#include "tests.hpp"

namespace {

using dataecho_test::Clock;
using dataecho_test::g_options;
using dataecho_test::Options;
using dataecho_test::Test;

// The order is part of the contract: tests/test_native.py checks these names.
const Test kTests[] = {
    {"rng", dataecho_test::test_rng},
    {"reservoir", dataecho_test::test_reservoir},
    {"ring_basic", dataecho_test::test_ring_basic},
    {"ring_blocking", dataecho_test::test_ring_blocking},
    {"ring_stress", dataecho_test::test_ring_stress},
    {"batch_pool", dataecho_test::test_batch_pool},
    {"buffer_accounting", dataecho_test::test_buffer_accounting},
    {"buffer_fractional_drop_last", dataecho_test::test_buffer_fractional_and_drop_last},
    {"buffer_deterministic", dataecho_test::test_buffer_deterministic},
    {"buffer_in_order", dataecho_test::test_buffer_in_order},
    {"buffer_put_each", dataecho_test::test_buffer_put_each},
    {"buffer_put_into", dataecho_test::test_buffer_put_into},
    {"buffer_held", dataecho_test::test_buffer_held},
    {"buffer_snapshot", dataecho_test::test_buffer_snapshot},
    {"buffer_timeouts", dataecho_test::test_buffer_timeouts},
    {"buffer_close", dataecho_test::test_buffer_close},
    {"buffer_stop", dataecho_test::test_buffer_stop},
    {"buffer_destroy", dataecho_test::test_buffer_destroy},
    {"page_heap", dataecho_test::test_page_heap},
    {"buffer_ragged", dataecho_test::test_buffer_ragged},
    {"buffer_ragged_modes", dataecho_test::test_buffer_ragged_modes},
    {"buffer_ragged_blocking", dataecho_test::test_buffer_ragged_blocking},
    {"spread", dataecho_test::test_spread},
};

// ---------------------------------------------------------------------------
// Aborts
// ---------------------------------------------------------------------------

// The core's own invariant checks (DATAECHO_CHECK) abort the process: name the
// test and the seed first, with async-signal-safe calls only (hence the seed
// formatted in advance).
char g_seed_text[32];

void write_text(const char* text) {
  std::size_t n = 0;
  while (text[n] != '\0') ++n;
  (void)!::write(2, text, n);
}

void on_fatal_signal(int signo) {
  write_text("FATAL signal in test ");
  write_text(dataecho_test::g_test);
  write_text(" (seed ");
  write_text(g_seed_text);
  write_text(")\n");
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Running
// ---------------------------------------------------------------------------

// Runs one test under the watchdog and prints its PASS/FAIL line.
bool run_one(const Test& test, dataecho_test::Watchdog& watchdog) {
  dataecho_test::g_test = test.name;
  watchdog.arm(test.name, g_options.timeout_s);
  const auto t0 = Clock::now();
  std::string summary;
  dataecho_test::g_first_failure.clear();
  bool ok = true;
  try {
    summary = test.run();
  } catch (const dataecho_test::TestFailure&) {
    ok = false;
    summary = dataecho_test::g_first_failure;
  } catch (const std::exception& e) {
    ok = false;
    summary = std::string("exception: ") + e.what();
  }
  watchdog.disarm();
  std::printf("%s %-28s %6.2f s  %s\n", ok ? "PASS" : "FAIL", test.name, dataecho_test::seconds_since(t0),
              summary.c_str());
  std::fflush(stdout);
  return ok;
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
  dataecho_test::Watchdog watchdog;
  int passed = 0, failed = 0;
  const auto start = Clock::now();
  for (const Test& test : kTests) {
    if (!g_options.only.empty() && std::string(test.name).find(g_options.only) == std::string::npos) continue;
    (run_one(test, watchdog) ? passed : failed) += 1;
  }
  std::printf("dataecho_tests: %d passed, %d failed in %.2f s (seed %llu)\n", passed, failed,
              dataecho_test::seconds_since(start), static_cast<unsigned long long>(g_options.seed));
  return failed == 0 && passed > 0 ? 0 : 1;
}
