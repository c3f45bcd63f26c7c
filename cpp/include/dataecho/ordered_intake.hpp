// Deterministic intake: committed examples wait here and enter the reservoir
// one at a time, in the order of their sequence numbers, so that how many are
// resident at each draw depends on counts alone, not on producer timing.
//
// Producers may run at most `window` numbers ahead of the next one admitted
// (RegionHeader::window, enforced in producer.hpp), so at most window - 1
// examples wait here. Owned by the assembler thread; it publishes its position
// to producers through the region header.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>

#include "dataecho/region.hpp"

namespace dataecho {

// Echo counts for a factor e: floor(e), plus one more either at random
// (Bernoulli(e - floor(e))) or by sequence number, spread evenly so that
// exactly floor(n * f) of the first n numbers get it (a Beatty sequence) and
// the number of deliveries of n examples is known in advance.
class EchoCounts {
 public:
  explicit EchoCounts(double factor) noexcept
      : base_(static_cast<std::uint32_t>(std::floor(factor))), fraction_(factor - std::floor(factor)) {}

  template <class Rng>
  std::uint32_t drawn(Rng& rng) const noexcept {
    return base_ + (fraction_ > 0 && rng.bernoulli(fraction_) ? 1 : 0);
  }

  std::uint32_t by_seq(std::uint64_t seq) const noexcept {
    const auto step = static_cast<std::uint32_t>(std::floor(static_cast<double>(seq + 1) * fraction_) -
                                                 std::floor(static_cast<double>(seq) * fraction_));
    return base_ + step;
  }

 private:
  std::uint32_t base_;
  double fraction_;
};

class OrderedIntake {
 public:
  // The next number to admit; every number below it was admitted (or skipped).
  std::uint64_t next_seq() const noexcept { return next_seq_; }

  // A committed slot holding example number `seq`, to be admitted in order.
  void hold(std::uint64_t seq, std::uint32_t slot) { pending_.emplace(seq, slot); }

  // Takes the next example to admit: the one numbered next_seq() if it has come,
  // or, once the input is over, the lowest held (skipping a number whose put
  // failed). False if there is none yet.
  bool next(bool input_over, std::uint64_t& seq, std::uint32_t& slot) {
    if (pending_.empty()) return false;
    const auto first = pending_.begin();
    if (first->first > next_seq_ && !input_over) return false;
    seq = first->first;
    slot = first->second;
    next_seq_ = std::max(next_seq_, seq + 1);
    pending_.erase(first);
    return true;
  }

  // Resume: numbers below `next_seq` were taken in before the checkpoint.
  void restart(std::uint64_t next_seq) noexcept { next_seq_ = next_seq; }

  // Tells producers waiting on the window that intake has advanced.
  void publish(RegionHeader& header) const noexcept {
    // seq_cst: the condition store for producers waiting on the window
    // (Producer::wait_for_window); the notify below pairs with their re-check.
    header.intake_seq.store(next_seq_, std::memory_order_seq_cst);
    header.intake_advanced.notify_all();
  }

 private:
  std::multimap<std::uint64_t, std::uint32_t> pending_;  // seq -> slot, all >= next_seq_
  std::uint64_t next_seq_ = 0;
};

}  // namespace dataecho
