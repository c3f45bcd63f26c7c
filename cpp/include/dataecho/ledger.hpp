// The delivery ledger: what repetition did to one epoch's data, counted from
// the batches as they are handed to the training loop. Each row is named by its
// position in the epoch's reading order; the ledger keeps, per position, how
// many times it was delivered and the batch it was last delivered in, and from
// those a histogram of deliveries per example and one of the distances (in
// batches) between an example's consecutive deliveries.
//
// Memory: 5 bytes per position delivered so far this epoch (a count, saturating
// at 255, and the last batch's number). Across epochs, fold() adds the counts
// into one byte per example of the dataset (saturating too).
//
// Owned by one thread at a time (the consumer's, under the epoch's lock), so it
// holds no atomics.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dataecho/config.hpp"

namespace dataecho {

class DeliveryLedger {
 public:
  static constexpr std::size_t kMaxCount = 255;     // counts saturate here ("255 or more")
  static constexpr std::size_t kExactGaps = 256;    // gaps below this are counted one by one
  static constexpr std::size_t kGapBuckets = kExactGaps + 56;  // then one bucket per power of two

  // One delivered batch, its rows named by position; batches are numbered 0, 1, ... as added.
  void add(const std::uint64_t* positions, std::size_t rows) {
    for (std::size_t i = 0; i < rows; ++i) {
      const std::uint64_t p = positions[i];
      if (p >= counts_.size()) grow(p);
      std::uint8_t& count = counts_[p];
      if (count == 0) {
        ++distinct_;
      } else {
        ++gaps_[bucket_of(batches_ - last_[p])];
        --by_count_[count];
      }
      if (count < kMaxCount) ++count;
      ++by_count_[count];
      last_[p] = batches_;
    }
    delivered_ += rows;
    ++batches_;
  }

  std::uint64_t delivered() const noexcept { return delivered_; }
  std::uint64_t distinct() const noexcept { return distinct_; }
  std::uint64_t batches() const noexcept { return batches_; }
  std::size_t positions() const noexcept { return counts_.size(); }  // one past the highest seen (grown)

  // by_count()[c]: positions delivered c times (c >= 1; the last: kMaxCount or more).
  const std::array<std::uint64_t, kMaxCount + 1>& by_count() const noexcept { return by_count_; }
  // gaps()[b]: repeats whose distance from the previous delivery falls in bucket b (see lower_bound()).
  const std::array<std::uint64_t, kGapBuckets>& gaps() const noexcept { return gaps_; }

  // The smallest distance that bucket b holds.
  static std::uint64_t lower_bound(std::size_t b) noexcept {
    return b < kExactGaps ? b : std::uint64_t{kExactGaps} << (b - kExactGaps);
  }

  const std::vector<std::uint8_t>& counts() const noexcept { return counts_; }
  const std::vector<std::uint32_t>& last() const noexcept { return last_; }

  // Rebuilds the ledger of a checkpoint: counts and last batches per position
  // (as counts() and last() gave them), the batches and rows added, and the
  // gaps; the histogram of deliveries is counted again from the counts.
  void restore(std::vector<std::uint8_t> counts, std::vector<std::uint32_t> last, std::uint64_t batches,
               std::uint64_t delivered, const std::array<std::uint64_t, kGapBuckets>& gaps) {
    DATAECHO_CHECK(counts.size() == last.size());
    counts_ = std::move(counts);
    last_ = std::move(last);
    batches_ = batches;
    delivered_ = delivered;
    gaps_ = gaps;
    by_count_.fill(0);
    distinct_ = 0;
    for (std::uint8_t c : counts_) {
      if (c == 0) continue;
      ++by_count_[c];
      ++distinct_;
    }
  }

  // Adds each position's count to totals[index[p]] (index: the epoch's order; none:
  // the position itself), saturating at kMaxCount. Every index must be < n.
  void fold(std::uint8_t* totals, const std::int64_t* index, std::size_t n) const {
    for (std::size_t p = 0; p < counts_.size(); ++p) {
      if (counts_[p] == 0) continue;
      const std::size_t at = index == nullptr ? p : static_cast<std::size_t>(index[p]);
      if (at >= n) continue;  // the caller checked; never written out of bounds
      totals[at] = static_cast<std::uint8_t>(std::min<unsigned>(kMaxCount, unsigned{totals[at]} + counts_[p]));
    }
  }

 private:
  static std::size_t bucket_of(std::uint64_t gap) noexcept {
    if (gap < kExactGaps) return static_cast<std::size_t>(gap);
    std::size_t b = kExactGaps;
    for (std::uint64_t g = gap / kExactGaps; g > 1 && b + 1 < kGapBuckets; g >>= 1) ++b;
    return b;
  }

  void grow(std::uint64_t p) {
    const std::size_t size = std::max<std::size_t>(static_cast<std::size_t>(p) + 1, counts_.size() * 2);
    counts_.resize(size, 0);
    last_.resize(size, 0);
  }

  std::vector<std::uint8_t> counts_;
  std::vector<std::uint32_t> last_;  // batch number of the last delivery (valid where counts_ > 0)
  std::array<std::uint64_t, kMaxCount + 1> by_count_{};
  std::array<std::uint64_t, kGapBuckets> gaps_{};
  std::uint64_t delivered_ = 0;
  std::uint64_t distinct_ = 0;
  std::uint64_t batches_ = 0;
};

}  // namespace dataecho
