// A seeded, counter-based random generator (SplitMix64).
//
// The state is a single 64-bit counter advanced by a fixed odd constant, and each
// output is a bijective mix of it; so the generator's full state is (seed, draws),
// small enough to checkpoint, and any position can be reached without replaying.
#pragma once

#include <cstdint>

namespace dataecho {

class Rng {
 public:
  explicit Rng(std::uint64_t seed = 0) noexcept : state_(mix(seed)) {}

  std::uint64_t next() noexcept {
    state_ += kGamma;
    return mix(state_);
  }

  // Uniform integer in [0, n), n >= 1, without modulo bias (Lemire's method).
  std::uint64_t below(std::uint64_t n) noexcept {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    auto low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

  // Uniform double in [0, 1) with 53 random bits.
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  bool bernoulli(double p) noexcept { return uniform() < p; }

  std::uint64_t state() const noexcept { return state_; }
  void set_state(std::uint64_t state) noexcept { state_ = state; }

 private:
  static constexpr std::uint64_t kGamma = 0x9E3779B97F4A7C15ull;

  static std::uint64_t mix(std::uint64_t z) noexcept {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  std::uint64_t state_;
};

}  // namespace dataecho
