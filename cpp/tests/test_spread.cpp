// Tests of delivered_pool.hpp and ledger.hpp, single-threaded: auto echo's
// repeats against a model (least-delivered first, the gap, eviction of the
// most-delivered, budgets), and the delivery ledger's histograms against a
// brute-force count.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dataecho/delivered_pool.hpp"
#include "dataecho/ledger.hpp"
#include "dataecho/rng.hpp"
#include "harness.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::DeliveredPool;
using dataecho::DeliveryLedger;
using dataecho::Rng;

struct Model {
  std::uint32_t times = 0;
  std::uint32_t left = 0;
  std::uint64_t last = 0;  // the batch of its last delivery
};

// Random walks of adds, draws and evictions over batches: every draw takes an
// example delivered the fewest times among those drawable (cooled for `gap`
// batches), and every eviction one delivered the most. Returns the draws checked.
std::uint64_t check_pool_against_model(Rng& rng, std::uint64_t gap) {
  const std::size_t capacity = 64;
  DeliveredPool pool(capacity, gap);
  std::map<std::uint32_t, Model> resident;
  std::vector<std::uint32_t> free_slots;
  for (std::uint32_t s = 0; s < capacity; ++s) free_slots.push_back(s);
  std::uint64_t draws = 0;
  for (std::uint64_t batch = 0; batch < 400; ++batch) {
    pool.begin_batch(batch);
    for (int step = 0; step < 6; ++step) {
      const std::uint64_t op = rng.below(10);
      if (op < 4 && !free_slots.empty()) {  // a fresh example's first delivery, with budget left
        const std::uint32_t slot = free_slots.back();
        free_slots.pop_back();
        const auto left = static_cast<std::uint32_t>(1 + rng.below(4));
        pool.add(slot, 1, left, batch);
        resident[slot] = {1, left, batch};
      } else if (op < 9 && pool.drawable() > 0) {
        std::uint32_t fewest = UINT32_MAX;
        for (const auto& [slot, m] : resident)
          if (m.last + gap <= batch) fewest = std::min(fewest, m.times);
        const auto draw = pool.draw(rng, batch);
        Model& m = resident.at(draw.slot);
        CHECK_MSG(m.last + gap <= batch, "slot " << draw.slot << " drawn at batch " << batch
                                                  << ", last delivered at " << m.last << ", gap " << gap);
        CHECK_MSG(m.times == fewest, "drew an example delivered " << m.times << " times; the fewest was " << fewest);
        ++m.times;
        m.last = batch;
        CHECK(draw.last == (--m.left == 0));
        if (draw.last) {
          resident.erase(draw.slot);
          free_slots.push_back(draw.slot);
        }
        ++draws;
      } else if (op == 9 && pool.size() > 0) {
        std::uint32_t most = 0;
        bool any_drawable = false;
        for (const auto& [slot, m] : resident) {
          if (m.last + gap > batch) continue;
          any_drawable = true;
          most = std::max(most, m.times);
        }
        const auto [slot, left] = pool.evict(rng);
        const Model& m = resident.at(slot);
        if (any_drawable) CHECK_MSG(m.times == most, "evicted one delivered " << m.times << ", the most " << most);
        CHECK(left == m.left);
        resident.erase(slot);
        free_slots.push_back(slot);
      }
      std::uint64_t left = 0;
      for (const auto& [slot, m] : resident) left += m.left;
      CHECK(pool.size() == resident.size() && pool.echoes_left() == left);
    }
  }
  std::size_t cleared = 0;
  pool.clear([&](std::uint32_t slot) {
    CHECK(resident.count(slot) == 1);
    ++cleared;
  });
  CHECK(cleared == resident.size() && pool.size() == 0 && pool.echoes_left() == 0);
  return draws;
}

// Draws among equally delivered examples are uniform: each of 8 examples
// first in about 1/8 of 16,000 trials.
void check_pool_ties_uniform(Rng& rng) {
  std::vector<std::uint64_t> first(8, 0);
  for (int trial = 0; trial < 16000; ++trial) {
    DeliveredPool pool(8, 1);
    for (std::uint32_t s = 0; s < 8; ++s) pool.add(s, 1, 2, 0);
    pool.begin_batch(1);
    ++first[pool.draw(rng, 1).slot];
  }
  for (std::uint64_t n : first) CHECK_MSG(n > 1700 && n < 2300, "a tie drawn first " << n << " times of 16000");
}

// The ledger against a brute-force count of random batches with repeats.
std::uint64_t check_ledger(Rng& rng) {
  DeliveryLedger ledger;
  std::map<std::uint64_t, std::vector<std::uint64_t>> batches_of;  // position -> batches delivered in
  std::uint64_t rows = 0;
  for (std::uint64_t k = 0; k < 300; ++k) {
    std::vector<std::uint64_t> batch;
    const std::size_t n = 1 + rng.below(16);
    for (std::size_t i = 0; i < n; ++i) {
      // Mostly recent positions (repeats a few batches apart), now and then a far one.
      const std::uint64_t p = rng.below(20) == 0 ? rng.below(100000) : k * 4 + rng.below(40);
      batch.push_back(p);
      batches_of[p].push_back(k);
    }
    ledger.add(batch.data(), batch.size());
    rows += n;
  }
  std::vector<std::uint64_t> by_count(DeliveryLedger::kMaxCount + 1, 0);
  std::vector<std::uint64_t> gaps(DeliveryLedger::kGapBuckets, 0);
  for (const auto& [p, ks] : batches_of) {
    ++by_count[std::min<std::size_t>(ks.size(), DeliveryLedger::kMaxCount)];
    for (std::size_t i = 1; i < ks.size(); ++i) {
      std::size_t b = 0;
      while (b + 1 < DeliveryLedger::kGapBuckets && DeliveryLedger::lower_bound(b + 1) <= ks[i] - ks[i - 1]) ++b;
      ++gaps[b];
    }
    CHECK(ledger.counts()[p] == std::min<std::size_t>(ks.size(), DeliveryLedger::kMaxCount));
  }
  CHECK(ledger.delivered() == rows && ledger.distinct() == batches_of.size() && ledger.batches() == 300);
  for (std::size_t c = 1; c <= DeliveryLedger::kMaxCount; ++c)
    CHECK_MSG(ledger.by_count()[c] == by_count[c], "examples delivered " << c << " times");
  for (std::size_t b = 0; b < DeliveryLedger::kGapBuckets; ++b)
    CHECK_MSG(ledger.gaps()[b] == gaps[b], "gap bucket " << b);
  // Far gaps land in power-of-two buckets: 256 in the first, 1,000 in [512, 1024).
  DeliveryLedger far;
  const std::uint64_t one = 7;
  far.add(&one, 1);
  for (int k = 0; k < 999; ++k) far.add(nullptr, 0);
  far.add(&one, 1);
  CHECK(far.gaps()[DeliveryLedger::kExactGaps + 1] == 1 && DeliveryLedger::lower_bound(DeliveryLedger::kExactGaps + 1) == 512);
  // Folding into per-example totals through an order saturates at the top count.
  std::vector<std::uint8_t> totals(10, 250);
  totals[8] = 254;
  const std::int64_t order[8] = {9, 8, 7, 6, 5, 4, 3, 2};
  std::vector<std::uint64_t> twice(2, 1);
  far.add(twice.data(), twice.size());  // position 1: delivered twice in one batch
  far.fold(totals.data(), order, totals.size());
  CHECK(totals[8] == 255 && totals[2] == 252 && totals[9] == 250);  // positions 1 and 7 twice, 0 never
  return rows;
}

}  // namespace

std::string test_spread() {
  Rng rng(run_seed(23));
  std::uint64_t draws = 0;
  for (std::uint64_t gap : {1, 2, 5}) draws += check_pool_against_model(rng, gap);
  check_pool_ties_uniform(rng);
  const std::uint64_t rows = check_ledger(rng);
  std::ostringstream s;
  s << draws << " repeats checked against a model (gaps 1, 2, 5), ties uniform; ledger over " << rows << " rows";
  return s.str();
}

}  // namespace dataecho_test
