// Checking deliveries: exact per-item accounting of what consumers saw. Every
// stress test numbers its items (ring values, example ids, held owners), counts
// how many times each one arrived, and checks every count against what the
// configuration allows (exactly once, echo times, 1 or 2 times for echo 1.5,
// ...). A failure names the first wrong item and how many were lost,
// delivered too few times or too many times.
#pragma once

#include <cstdint>
#include <limits>
#include <source_location>
#include <sstream>
#include <string>
#include <vector>

#include "harness.hpp"

namespace dataecho_test {

// How many times each item may arrive: from `least` to `most` times, or not
// at all when `none_ok` (an id a producer never got accepted, say).
struct Times {
  static constexpr std::uint32_t kUnbounded = std::numeric_limits<std::uint32_t>::max();

  std::uint32_t least = 0;
  std::uint32_t most = kUnbounded;
  bool none_ok = false;

  static constexpr Times exactly(std::uint32_t n) { return {n, n}; }
  static constexpr Times between(std::uint32_t least, std::uint32_t most) { return {least, most}; }
  static constexpr Times at_least(std::uint32_t n) { return {n, kUnbounded}; }
  static constexpr Times at_most(std::uint32_t n) { return {0, n}; }
  constexpr Times or_none() const { return {least, most, true}; }

  constexpr bool allows(std::uint32_t n) const { return (n >= least && n <= most) || (none_ok && n == 0); }

  std::string describe() const {
    std::ostringstream s;
    if (least == most)
      s << least;
    else if (most == kUnbounded)
      s << "at least " << least;
    else
      s << least << " to " << most;
    s << (none_ok && least > 0 ? " times or never" : " times");
    return s.str();
  }
};

// The items whose count a Times does not allow, by kind.
struct Tally {
  static constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();

  std::uint64_t lost = 0;      // never arrived
  std::uint64_t too_few = 0;   // arrived, but fewer times than allowed
  std::uint64_t too_many = 0;  // arrived more times than allowed: duplicated, for exactly(1)
  std::uint64_t first_wrong = kNone;
  std::uint32_t first_count = 0;  // how many times first_wrong arrived

  bool ok() const { return first_wrong == kNone; }
};

// How many times each of items [0, n) arrived. Not thread-safe: each consumer
// thread keeps its own and the test thread adds them up after joining.
class Deliveries {
 public:
  explicit Deliveries(std::uint64_t items = 0) : counts_(items, 0) {}

  std::uint64_t items() const { return counts_.size(); }
  bool known(std::uint64_t item) const { return item < counts_.size(); }
  // The caller checks known(item) first: an unknown item is a failure of its own.
  void record(std::uint64_t item) { ++counts_[item]; }
  std::uint32_t operator[](std::uint64_t item) const { return counts_[item]; }

  // Adds another consumer's counts over the same items.
  void add(const Deliveries& other) {
    CHECK(other.counts_.size() == counts_.size());
    for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  }

  // How many items arrived exactly `times` times.
  std::uint64_t items_arrived(std::uint32_t times) const {
    std::uint64_t n = 0;
    for (const std::uint32_t c : counts_) n += c == times;
    return n;
  }

  std::uint64_t total() const {
    std::uint64_t n = 0;
    for (const std::uint32_t c : counts_) n += c;
    return n;
  }

  Tally tally(Times allowed) const {
    Tally t;
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      const std::uint32_t c = counts_[i];
      if (allowed.allows(c)) continue;
      if (c == 0)
        ++t.lost;
      else if (c < allowed.least)
        ++t.too_few;
      else
        ++t.too_many;
      if (t.first_wrong == Tally::kNone) {
        t.first_wrong = i;
        t.first_count = c;
      }
    }
    return t;
  }

  // CHECKs every item's count against `allowed`. The failure is reported at the
  // caller's line, prefixed by `context` (the run's configuration).
  void expect(Times allowed, const std::string& context = {},
              std::source_location where = std::source_location::current()) const {
    const Tally t = tally(allowed);
    if (t.ok()) return;
    std::ostringstream detail;
    if (!context.empty()) detail << context << ": ";
    detail << "item " << t.first_wrong << " arrived " << t.first_count << " times, allowed "
           << allowed.describe() << "; of " << counts_.size() << " items " << t.lost << " lost, " << t.too_few
           << " too few times, " << t.too_many << " too many times";
    check_failed("every item arrived as allowed", where.file_name(), where.line(), detail.str());
  }

 private:
  std::vector<std::uint32_t> counts_;
};

}  // namespace dataecho_test
