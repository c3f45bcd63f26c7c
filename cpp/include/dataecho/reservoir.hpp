// The reservoir: the set of resident examples and their remaining echo counts,
// sampled uniformly, without replacement within a batch. Owned by one thread
// (the assembler), so it holds no atomics.
//
// Invariants, with f = fresh(), a = available(), n = size():
//   slots_[0, f)   auto echo: resident, never delivered (then f == a == n: the
//                  delivered ones live in a DeliveredPool); fixed echo: f stays 0;
//   slots_[f, a)   fixed echo: resident, not drawn in this batch;
//   slots_[a, n)   fixed echo: resident and already drawn in the current batch;
//   echoes_[s] >= 1 for every resident slot s, and echoes_left() is their sum.
// A draw picks uniformly in its region and moves the pick to the drawn side, so a
// batch repeats an example only once every resident one has been drawn, which
// can only happen when fewer than batch_size examples are resident.
//
// In order (every example delivered once): a FIFO instead. slots_ is a ring
// whose oldest entry is at head_, every draw takes the oldest, and nothing is
// ever "drawn in this batch" (available() == size()). head_ is 0 otherwise.
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
  explicit Reservoir(std::size_t capacity, bool in_order = false)
      : slots_(capacity), echoes_(capacity, 0), in_order_(in_order) {}

  std::size_t size() const noexcept { return size_; }
  std::size_t available() const noexcept { return available_; }
  std::size_t fresh() const noexcept { return fresh_; }
  std::uint64_t echoes_left() const noexcept { return echoes_left_; }

  // A new example, drawable from the current batch on, among the "seen" ones
  // (fixed echo: every example is drawn uniformly among all).
  void add(std::uint32_t slot, std::uint32_t echoes) noexcept {
    admit(slot, echoes);
    if (in_order_) {
      DATAECHO_CHECK(echoes == 1);
      slots_[ring(size_)] = slot;
      ++available_;
      ++size_;
      return;
    }
    slots_[size_] = slots_[available_];
    slots_[available_] = slot;
    ++available_;
    ++size_;
  }

  // A new example, until its first delivery (auto echo: see remove_fresh()).
  void add_fresh(std::uint32_t slot, std::uint32_t echoes) noexcept {
    DATAECHO_CHECK(!in_order_);
    admit(slot, echoes);
    slots_[size_] = slots_[available_];
    slots_[available_] = slots_[fresh_];
    slots_[fresh_] = slot;
    ++fresh_;
    ++available_;
    ++size_;
  }

  // Makes every resident example drawable again.
  void begin_batch() noexcept { available_ = size_; }

  struct Draw {
    std::uint32_t slot;
    bool last;  // its final echo: the caller frees the slot after copying it out
  };

  // Uniform among all drawable examples (fixed echo: there are no fresh ones).
  Draw draw(Rng& rng) noexcept {
    DATAECHO_CHECK(size_ > 0 && fresh_ == 0 && !in_order_);
    if (available_ == 0) available_ = size_;  // fewer residents than draws: repeat
    return take(rng.below(available_));
  }

  // In order: the oldest resident example, its only delivery.
  Draw draw_first() noexcept {
    DATAECHO_CHECK(in_order_ && size_ > 0);
    const std::uint32_t slot = slots_[head_];
    head_ = ring(1);
    --size_;
    --available_;
    echoes_[slot] = 0;
    --echoes_left_;
    return {slot, true};
  }

  // Auto echo, where every resident example is fresh (the delivered ones live
  // in a DeliveredPool): takes a uniformly chosen one out for its first
  // delivery. Returns its slot and its whole budget of echoes.
  std::pair<std::uint32_t, std::uint32_t> remove_fresh(Rng& rng) noexcept {
    DATAECHO_CHECK(fresh_ > 0 && fresh_ == size_ && !in_order_);
    const std::size_t pick = rng.below(fresh_);
    const std::uint32_t slot = slots_[pick];
    slots_[pick] = slots_[size_ - 1];
    --fresh_;
    --size_;
    available_ = size_;
    const std::uint32_t echoes = std::exchange(echoes_[slot], 0);
    echoes_left_ -= echoes;
    return {slot, echoes};
  }

  // The resident slots in array order (draws depend on it) with their echo counts.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> contents() const {
    std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
    for (std::size_t i = 0; i < size_; ++i) out.emplace_back(slots_[ring(i)], echoes_[slots_[ring(i)]]);
    return out;
  }

  // Rebuilds an empty reservoir from contents() (with new slot numbers) and the
  // available() it had; fixed echo only (nothing is fresh).
  void restore(const std::vector<std::pair<std::uint32_t, std::uint32_t>>& contents, std::size_t available) {
    DATAECHO_CHECK(size_ == 0 && contents.size() <= slots_.size() && available <= contents.size());
    head_ = 0;
    for (const auto& [slot, echoes] : contents) {
      admit(slot, echoes);
      slots_[size_++] = slot;
    }
    available_ = available;
  }

  // Empties the reservoir, handing every resident slot to `on_slot`.
  template <class OnSlot>
  void clear(OnSlot&& on_slot) {
    for (std::size_t i = 0; i < size_; ++i) {
      echoes_[slots_[ring(i)]] = 0;
      on_slot(slots_[ring(i)]);
    }
    size_ = available_ = fresh_ = head_ = 0;
    echoes_left_ = 0;
  }

 private:
  void admit(std::uint32_t slot, std::uint32_t echoes) noexcept {
    DATAECHO_CHECK(size_ < slots_.size() && slot < echoes_.size() && echoes >= 1 && echoes_[slot] == 0);
    echoes_[slot] = echoes;
    echoes_left_ += echoes;
  }

  // The i-th oldest entry's index in slots_ (in order; i itself otherwise, as head_ is 0).
  std::size_t ring(std::size_t i) const noexcept {
    i += head_;
    return i >= slots_.size() ? i - slots_.size() : i;
  }

  // Draws the example at `pick`, which is in [fresh_, available_) or was just
  // moved to available_ - 1: it moves to the drawn side.
  Draw take(std::size_t pick) noexcept {
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

  std::vector<std::uint32_t> slots_;
  std::vector<std::uint32_t> echoes_;  // indexed by slot
  std::size_t size_ = 0;
  std::size_t available_ = 0;
  std::size_t fresh_ = 0;
  std::uint64_t echoes_left_ = 0;
  bool in_order_;
  std::size_t head_ = 0;  // in order: the ring's oldest entry
};

}  // namespace dataecho
