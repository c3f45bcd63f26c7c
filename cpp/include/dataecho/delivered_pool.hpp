// Auto echo's delivered examples: those delivered at least once that have
// echoes left, which the assembler repeats while the consumer would wait
// (auto_policy.hpp). Repeats are spread evenly:
//
//   - a repeat takes, among the drawable examples, one delivered the fewest
//     times so far, so the examples resident are repeated in turn rather than
//     some many times and others never; among those, the longer-ago delivered
//     of two drawn at random (by the seeded RNG), which keeps the order random
//     while leaning to longer gaps (the fewest-delivered are mostly the ones
//     delivered first just now);
//   - an example delivered in batch k is drawable again from batch k + gap on
//     ("cooling" until then), so its repeats are at least `gap` batches apart;
//   - making room for fresh examples evicts the most-delivered drawable one
//     (uniformly among those), else the one cooling longest.
//
// Counts above kBuckets - 1 share the last bucket. Owned by one thread (the
// assembler), so it holds no atomics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "dataecho/config.hpp"
#include "dataecho/reservoir.hpp"
#include "dataecho/rng.hpp"

namespace dataecho {

class DeliveredPool {
 public:
  static constexpr std::size_t kBuckets = 64;

  using Draw = Reservoir::Draw;

  DeliveredPool(std::size_t capacity, std::uint64_t gap)
      : by_times_(kBuckets), times_(capacity, 0), left_(capacity, 0), last_(capacity, 0), gap_(gap) {}

  std::size_t size() const noexcept { return drawable_ + cooling_.size(); }
  std::size_t drawable() const noexcept { return drawable_; }
  std::uint64_t echoes_left() const noexcept { return echoes_left_; }

  // An example just delivered (for the `times`-th time) in batch `batch`,
  // with `left` echoes still to give; it cools until batch + gap.
  void add(std::uint32_t slot, std::uint32_t times, std::uint32_t left, std::uint64_t batch) {
    DATAECHO_CHECK(slot < times_.size() && left >= 1 && times >= 1);
    times_[slot] = times;
    left_[slot] = left;
    last_[slot] = batch;
    echoes_left_ += left;
    cooling_.emplace_back(batch, slot);
  }

  // Batch `batch` begins: examples that have cooled long enough become drawable.
  void begin_batch(std::uint64_t batch) {
    while (!cooling_.empty() && cooling_.front().first + gap_ <= batch) {
      insert(cooling_.front().second);
      cooling_.pop_front();
    }
  }

  // A repeat in batch `batch`: a least-delivered drawable example; requires drawable() > 0.
  Draw draw(Rng& rng, std::uint64_t batch) {
    DATAECHO_CHECK(drawable_ > 0);
    std::size_t b = 0;
    while (by_times_[b].empty()) ++b;
    const std::vector<std::uint32_t>& bucket = by_times_[b];
    std::size_t pick = rng.below(bucket.size());
    const std::size_t other = rng.below(bucket.size());
    if (last_[bucket[other]] < last_[bucket[pick]]) pick = other;
    const std::uint32_t slot = remove(b, pick);
    --echoes_left_;
    ++times_[slot];
    last_[slot] = batch;
    if (--left_[slot] == 0) return {slot, true};
    cooling_.emplace_back(batch, slot);
    return {slot, false};
  }

  // Gives up a most-delivered drawable example (else the one cooling longest)
  // to make room; requires size() > 0. Returns its slot and the echoes it had left.
  std::pair<std::uint32_t, std::uint32_t> evict(Rng& rng) {
    DATAECHO_CHECK(size() > 0);
    std::uint32_t slot;
    if (drawable_ > 0) {
      std::size_t b = kBuckets - 1;
      while (by_times_[b].empty()) --b;
      slot = remove(b, rng.below(by_times_[b].size()));
    } else {
      slot = cooling_.front().second;
      cooling_.pop_front();
    }
    const std::uint32_t left = std::exchange(left_[slot], 0);
    echoes_left_ -= left;
    return {slot, left};
  }

  // Empties the pool, handing every slot to `on_slot`.
  template <class OnSlot>
  void clear(OnSlot&& on_slot) {
    for (auto& bucket : by_times_) {
      for (std::uint32_t slot : bucket) on_slot(slot);
      bucket.clear();
    }
    for (const auto& [batch, slot] : cooling_) on_slot(slot);
    cooling_.clear();
    drawable_ = 0;
    echoes_left_ = 0;
  }

 private:
  static std::size_t bucket_of(std::uint32_t times) noexcept { return times < kBuckets ? times : kBuckets - 1; }

  void insert(std::uint32_t slot) {
    std::vector<std::uint32_t>& bucket = by_times_[bucket_of(times_[slot])];
    bucket.push_back(slot);
    ++drawable_;
  }

  // Takes the i-th slot of bucket b out (the bucket's last one fills its place).
  std::uint32_t remove(std::size_t b, std::size_t i) {
    std::vector<std::uint32_t>& bucket = by_times_[b];
    const std::uint32_t slot = bucket[i];
    bucket[i] = bucket.back();
    bucket.pop_back();
    --drawable_;
    return slot;
  }

  std::vector<std::vector<std::uint32_t>> by_times_;  // drawable slots by deliveries so far
  std::vector<std::uint32_t> times_;                   // slot -> deliveries so far
  std::vector<std::uint32_t> left_;                    // slot -> echoes left
  std::vector<std::uint64_t> last_;                    // slot -> the batch it was last delivered in
  std::deque<std::pair<std::uint64_t, std::uint32_t>> cooling_;  // (batch last delivered, slot), oldest first
  std::size_t drawable_ = 0;
  std::uint64_t echoes_left_ = 0;
  const std::uint64_t gap_;
};

}  // namespace dataecho
