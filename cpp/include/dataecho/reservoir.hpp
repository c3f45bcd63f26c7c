// The reservoir: the set of resident examples and their remaining echo counts,
// sampled uniformly, without replacement within a batch. Owned by one thread
// (the assembler), so it holds no atomics.
//
// Invariants, with n = size() and a = available():
//   slots_[0, a)   resident and not yet drawn in the current batch;
//   slots_[a, n)   resident and already drawn in the current batch;
//   echoes_[s] >= 1 for every resident slot s, and echoes_left() is their sum.
// A draw picks uniformly in [0, a) and moves the pick to the drawn side, so a
// batch repeats an example only once every resident one has been drawn, which
// can only happen when fewer than batch_size examples are resident.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "dataecho/config.hpp"
#include "dataecho/rng.hpp"

namespace dataecho {

class Reservoir {
 public:
  explicit Reservoir(std::size_t capacity) : slots_(capacity), echoes_(capacity, 0) {}

  std::size_t size() const noexcept { return size_; }
  std::size_t available() const noexcept { return available_; }
  std::uint64_t echoes_left() const noexcept { return echoes_left_; }

  // A new example, drawable from the current batch on.
  void add(std::uint32_t slot, std::uint32_t echoes) noexcept {
    DATAECHO_CHECK(size_ < slots_.size() && slot < echoes_.size() && echoes >= 1 && echoes_[slot] == 0);
    slots_[size_] = slots_[available_];
    slots_[available_] = slot;
    ++available_;
    ++size_;
    echoes_[slot] = echoes;
    echoes_left_ += echoes;
  }

  // Makes every resident example drawable again.
  void begin_batch() noexcept { available_ = size_; }

  struct Draw {
    std::uint32_t slot;
    bool last;  // its final echo: the caller frees the slot after copying it out
  };

  Draw draw(Rng& rng) noexcept {
    DATAECHO_CHECK(size_ > 0);
    if (available_ == 0) available_ = size_;  // fewer residents than draws: repeat
    const std::size_t pick = rng.below(available_);
    --available_;
    std::swap(slots_[pick], slots_[available_]);
    const std::uint32_t slot = slots_[available_];
    --echoes_left_;
    if (--echoes_[slot] > 0) return {slot, false};
    // Out of echoes: fill its place with the last drawn one; [a, n) stays "drawn".
    slots_[available_] = slots_[size_ - 1];
    --size_;
    return {slot, true};
  }

 private:
  std::vector<std::uint32_t> slots_;
  std::vector<std::uint32_t> echoes_;  // indexed by slot
  std::size_t size_ = 0;
  std::size_t available_ = 0;
  std::uint64_t echoes_left_ = 0;
};

}  // namespace dataecho
