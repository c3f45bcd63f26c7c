// Tests of rng.hpp and reservoir.hpp, single-threaded: the generator's
// determinism, range and uniformity, and the reservoir's draws against a model
// (sizes, echo counts, `last`, without-replacement batches, in-order FIFO).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "dataecho/reservoir.hpp"
#include "dataecho/rng.hpp"
#include "harness.hpp"
#include "tests.hpp"

namespace dataecho_test {
namespace {

using dataecho::Reservoir;
using dataecho::Rng;

// ---------------------------------------------------------------------------
// Rng
// ---------------------------------------------------------------------------

// Same seed, same stream; the next seed, a different one; a saved state replays.
// Leaves `a` with its state advanced, for the checks that follow.
void check_rng_determinism(Rng& a, std::uint64_t seed) {
  Rng b(seed), c(seed + 1);
  int differ = 0;
  for (int i = 0; i < 1000; ++i) {
    const auto x = a.next();
    CHECK_MSG(x == b.next(), "same seed, different output at draw " << i);
    differ += x != c.next();
  }
  CHECK_MSG(differ > 990,
            "seeds " << seed << " and " << seed + 1 << " agree on " << 1000 - differ << " draws");

  // The state is a counter: saving and restoring it replays the same draws.
  const std::uint64_t saved = a.state();
  std::vector<std::uint64_t> first;
  for (int i = 0; i < 100; ++i) first.push_back(a.below(1000));
  a.set_state(saved);
  for (int i = 0; i < 100; ++i) CHECK(a.below(1000) == first[static_cast<std::size_t>(i)]);
}

// below(n) stays below n and reaches the top of its range, for awkward n too.
void check_below_range(Rng& a) {
  const std::uint64_t bounds[] = {
      1, 2, 3, 7, 10, 1000, (1ull << 32) - 1, (1ull << 32) + 15, (1ull << 63) + 1, UINT64_MAX};
  for (std::uint64_t n : bounds) {
    std::uint64_t top = 0;
    for (int i = 0; i < 20000; ++i) {
      const std::uint64_t v = a.below(n);
      CHECK_MSG(v < n, "below(" << n << ") returned " << v);
      top = std::max(top, v);
    }
    // The largest of 20000 uniform draws lies in the top 0.1% of the range.
    if (n > 1)
      CHECK_MSG(static_cast<double>(top) >= 0.999 * static_cast<double>(n - 1) || n <= 1000,
                "below(" << n << "): max of 20000 draws is " << top);
  }
}

// Returns the number of histogram cells checked.
std::size_t check_below_uniform(Rng& a) {
  std::size_t cells_checked = 0;
  for (std::uint64_t n : {2ull, 3ull, 7ull, 10ull, 100ull}) {
    std::vector<std::uint64_t> hist(n, 0);
    const std::uint64_t draws = 2000 * n;
    for (std::uint64_t i = 0; i < draws; ++i) ++hist[a.below(n)];
    const double chi = chi_square(hist);
    CHECK_MSG(chi < chi_square_bound(n),
              "below(" << n << ") chi-square " << chi << " over " << draws << " draws");
    cells_checked += n;
  }
  return cells_checked;
}

void check_uniform_and_bernoulli(Rng& a) {
  double sum = 0;
  int heads = 0;
  const int draws = 100000;
  for (int i = 0; i < draws; ++i) {
    const double u = a.uniform();
    CHECK(u >= 0.0 && u < 1.0);
    sum += u;
    heads += a.bernoulli(0.25);
  }
  CHECK_MSG(std::fabs(sum / draws - 0.5) < 0.01, "uniform() mean " << sum / draws);
  CHECK_MSG(std::fabs(static_cast<double>(heads) / draws - 0.25) < 0.01, "bernoulli(0.25) rate " << heads);
}

// ---------------------------------------------------------------------------
// Reservoir
// ---------------------------------------------------------------------------

// What a reservoir should hold, kept by hand: echoes left per slot, which
// slots were drawn since the batch began, and the free slots.
class ReservoirModel {
 public:
  explicit ReservoirModel(std::uint32_t capacity) : echoes_(capacity, 0), drawn_(capacity, false) {
    for (std::uint32_t s = 0; s < capacity; ++s) free_slots_.push_back(capacity - 1 - s);
  }

  bool can_add() const { return !free_slots_.empty(); }
  std::size_t size() const { return size_; }

  void begin_batch(Reservoir& r) {
    r.begin_batch();
    std::fill(drawn_.begin(), drawn_.end(), false);
  }

  // Adds a random free slot with 1 to 5 echoes.
  void add(Reservoir& r, Rng& rng) {
    const std::size_t at = rng.below(free_slots_.size());
    const std::uint32_t slot = free_slots_[at];
    free_slots_.erase(free_slots_.begin() + static_cast<std::ptrdiff_t>(at));
    const auto e = static_cast<std::uint32_t>(1 + rng.below(5));
    r.add(slot, e);
    echoes_[slot] = e;
    drawn_[slot] = false;
    left_ += e;
    ++size_;
  }

  // Draws one echo: a resident, not drawn before in this batch unless every
  // resident was, with `last` exactly on its final echo.
  void draw(Reservoir& r, Rng& rng) {
    const bool was_exhausted = r.available() == 0;
    const auto d = r.draw(rng);
    CHECK_MSG(d.slot < echoes_.size() && echoes_[d.slot] > 0, "draw returned non-resident slot " << d.slot);
    if (was_exhausted) {
      std::fill(drawn_.begin(), drawn_.end(), false);  // every resident drawn: a new round
    } else {
      CHECK_MSG(!drawn_[d.slot], "slot " << d.slot << " drawn twice in a batch with " << r.available() + 1
                                         << " undrawn residents left");
    }
    drawn_[d.slot] = true;
    --echoes_[d.slot];
    --left_;
    CHECK_MSG(d.last == (echoes_[d.slot] == 0),
              "slot " << d.slot << " last=" << d.last << " with " << echoes_[d.slot] << " echoes left");
    if (d.last) {
      --size_;
      free_slots_.push_back(d.slot);
    }
  }

  void check_matches(const Reservoir& r) const {
    CHECK_MSG(r.size() == size_, "size " << r.size() << ", model " << size_);
    CHECK_MSG(r.echoes_left() == left_, "echoes_left " << r.echoes_left() << ", model " << left_);
    CHECK(r.available() <= r.size());
  }

 private:
  std::vector<std::uint32_t> echoes_;  // indexed by slot
  std::vector<bool> drawn_;            // drawn since the batch began
  std::vector<std::uint32_t> free_slots_;
  std::uint64_t left_ = 0;
  std::size_t size_ = 0;
};

// (a) A random walk of begin_batch/add/draw against the model. Returns draws checked.
std::uint64_t check_reservoir_random_walk(Rng& rng) {
  const std::uint32_t capacity = 64;
  Reservoir r(capacity);
  ReservoirModel model(capacity);
  std::uint64_t draws = 0;
  const std::uint64_t steps = std::max<std::uint64_t>(20000, g_options.items / 10);
  for (std::uint64_t step = 0; step < steps; ++step) {
    const auto op = rng.below(16);
    if (op == 0) {
      model.begin_batch(r);
    } else if (model.can_add() && (op < 7 || model.size() == 0)) {
      model.add(r, rng);
    } else if (model.size() > 0) {
      model.draw(r, rng);
      ++draws;
    }
    model.check_matches(r);
  }
  return draws;
}

// (b) Without replacement: a batch of size() draws gives each resident once,
// and a resident added mid-batch is drawable in that batch.
std::uint64_t check_reservoir_without_replacement(Rng& rng) {
  const std::uint32_t n = 50;
  std::uint64_t draws = 0;
  Reservoir r(n + 1);
  for (std::uint32_t s = 0; s < n; ++s) r.add(s, 1000);
  for (int batch = 0; batch < 200; ++batch) {
    r.begin_batch();
    CHECK(r.available() == n);
    std::vector<int> seen(n + 1, 0);
    for (std::uint32_t i = 0; i < n; ++i) {
      const auto d = r.draw(rng);
      CHECK(!d.last);
      ++seen[d.slot];
    }
    CHECK(r.available() == 0);
    for (std::uint32_t s = 0; s < n; ++s) CHECK_MSG(seen[s] == 1, "slot " << s << " drawn " << seen[s] << " times");
    draws += n;
  }
  r.begin_batch();
  std::vector<int> seen(n + 1, 0);
  for (int i = 0; i < 10; ++i) ++seen[r.draw(rng).slot];
  r.add(n, 1);
  CHECK(r.available() == n - 10 + 1);
  bool new_one_drawn = false;
  for (std::uint32_t i = 0; i < n - 10 + 1; ++i) {
    const auto d = r.draw(rng);
    CHECK(seen[d.slot] == 0);
    ++seen[d.slot];
    if (d.slot == n) {
      CHECK(d.last);
      new_one_drawn = true;
    }
  }
  CHECK(new_one_drawn && r.size() == n);
  return draws + n + 1;
}

// (c) draw.last exactly on the final echo; more draws than residents repeat
// only after every resident was drawn.
void check_reservoir_last_echo(Rng& rng) {
  Reservoir r(3);
  r.add(0, 3);
  r.begin_batch();
  CHECK(!r.draw(rng).last);
  CHECK(!r.draw(rng).last);  // available was 0: a new round over the one resident
  const auto d = r.draw(rng);
  CHECK(d.slot == 0 && d.last && r.size() == 0 && r.echoes_left() == 0);
  r.add(0, 2);
  r.add(1, 2);
  r.add(2, 2);
  r.begin_batch();
  std::vector<int> seen(3, 0);
  for (int i = 0; i < 3; ++i) ++seen[r.draw(rng).slot];
  CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1);
  for (int i = 0; i < 3; ++i) CHECK(r.draw(rng).last);  // second round: each one's last echo
  CHECK(r.size() == 0 && r.echoes_left() == 0);
}

// (c2) In order: a FIFO over a ring that wraps many times, against a model
// queue; contents() lists the residents oldest first, and a restore keeps that.
std::uint64_t check_reservoir_in_order(Rng& rng) {
  const std::uint32_t capacity = 7;
  std::uint64_t draws = 0;
  Reservoir r(capacity, /*in_order=*/true);
  std::vector<std::uint32_t> model;  // resident slots, oldest first
  std::uint32_t next_slot = 0;
  for (int step = 0; step < 20000; ++step) {
    if (model.size() < capacity && (rng.below(2) == 0 || model.empty())) {
      const std::uint32_t slot = next_slot++ % 1000 % capacity;  // a slot no resident holds
      if (std::find(model.begin(), model.end(), slot) != model.end()) continue;
      r.add(slot, 1);
      model.push_back(slot);
    } else {
      const auto d = r.draw_first();
      CHECK_MSG(d.slot == model.front() && d.last, "drew " << d.slot << ", the oldest is " << model.front());
      model.erase(model.begin());
      ++draws;
    }
    CHECK(r.size() == model.size() && r.available() == r.size() && r.echoes_left() == model.size());
  }
  const auto contents = r.contents();
  CHECK(contents.size() == model.size());
  for (std::size_t i = 0; i < model.size(); ++i) CHECK(contents[i].first == model[i]);
  Reservoir restored(capacity, /*in_order=*/true);
  restored.restore(contents, contents.size());
  for (std::uint32_t slot : model) CHECK(restored.draw_first().slot == slot);
  return draws;
}

// (d) Uniformity of the first draw of a batch over 10 residents.
std::uint64_t check_reservoir_first_draw_uniform(Rng& rng) {
  Reservoir r(10);
  for (std::uint32_t s = 0; s < 10; ++s) r.add(s, 4'000'000'000u);
  std::vector<std::uint64_t> first(10, 0);
  const int trials = 100000;
  for (int t = 0; t < trials; ++t) {
    r.begin_batch();
    ++first[r.draw(rng).slot];
    r.draw(rng);  // stir the order
  }
  const double chi = chi_square(first);
  CHECK_MSG(chi < chi_square_bound(10), "first draw over 10 residents: chi-square " << chi);
  return 2 * trials;
}

// (d2) Uniformity of a full batch's order over 3 residents: all 6 permutations.
std::uint64_t check_reservoir_batch_order_uniform(Rng& rng) {
  Reservoir r(3);
  for (std::uint32_t s = 0; s < 3; ++s) r.add(s, 4'000'000'000u);
  std::vector<std::uint64_t> perms(9, 0);  // index a*3+b: the first two draws fix the permutation
  const int trials = 60000;
  for (int t = 0; t < trials; ++t) {
    r.begin_batch();
    const auto x = r.draw(rng).slot, y = r.draw(rng).slot, z = r.draw(rng).slot;
    CHECK(x != y && y != z && x != z);
    ++perms[x * 3 + y];
  }
  std::vector<std::uint64_t> six;
  for (std::uint32_t i = 0; i < 9; ++i)
    if (i / 3 != i % 3) six.push_back(perms[i]);
  const double chi = chi_square(six);
  CHECK_MSG(chi < chi_square_bound(6), "batch order over 3 residents: chi-square " << chi);
  return 3 * trials;
}

}  // namespace

std::string test_rng() {
  const std::uint64_t seed = run_seed(1);
  Rng a(seed);
  check_rng_determinism(a, seed);
  check_below_range(a);
  const std::size_t cells_checked = check_below_uniform(a);
  check_uniform_and_bernoulli(a);
  std::ostringstream s;
  s << "determinism, state replay, below() range for 10 bounds, chi-square over " << cells_checked
    << " cells";
  return s.str();
}

// The steps share one generator, in this order, so a seed replays the whole test.
std::string test_reservoir() {
  Rng rng(run_seed(2));
  std::uint64_t draws_checked = check_reservoir_random_walk(rng);
  draws_checked += check_reservoir_without_replacement(rng);
  check_reservoir_last_echo(rng);
  draws_checked += check_reservoir_in_order(rng);
  draws_checked += check_reservoir_first_draw_uniform(rng);
  draws_checked += check_reservoir_batch_order_uniform(rng);
  std::ostringstream s;
  s << draws_checked << " draws checked against a model; without-replacement, last, uniformity";
  return s.str();
}

}  // namespace dataecho_test
