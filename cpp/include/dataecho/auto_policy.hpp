// Assembly with echo_factor="auto": every example may be delivered up to its
// budget (drawn from max_echo: at most ceil(max_echo) times), fresh ones first.
// A batch is completed with repeats only when no fresh example is at hand and
// the consumer has drained the ready queue, i.e. is about to wait (paced: is
// blocked in next(), see BufferConfig::paced); otherwise the assembler waits
// for fresh examples. So a fast upstream yields an echo
// factor near 1 and a slow one near max_echo.
//
// Fresh examples wait in the reservoir; once delivered, an example with echoes
// left moves to the DeliveredPool, which spreads the repeats evenly (the
// least-delivered first, each at least echo_gap batches after its last
// delivery; see delivered_pool.hpp). Delivered examples keep their slot until
// the budget is spent or producers run short of free slots (then a
// most-delivered one is evicted). When the input ends, the fresh ones left are
// delivered and nothing more is repeated. Never deterministic (it depends on
// timing by design), so it never serves snapshots.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dataecho/assembler.hpp"

namespace dataecho {

// Frees delivered examples (the most-delivered first) until producers have a
// batch's worth of free slots or no delivered example is left; while a
// producer waits for pages of the heap, up to a batch's worth more.
inline void make_room(Assembler& a) {
  DeliveredPool& delivered = a.delivered();
  const RegionView& region = a.region();
  std::uint64_t evicted = 0;
  std::size_t for_pages = a.starved() ? a.config().batch_size : 0;
  while (delivered.size() > 0 &&
         (region.free->size_approx() < a.config().batch_size || (for_pages > 0 && a.starved()))) {
    if (for_pages > 0) --for_pages;
    const auto [slot, echoes] = delivered.evict(a.rng());
    evicted += echoes;
    a.release_slot(slot);
  }
  if (evicted == 0) return;
  a.count_evicted(evicted);
  region.free->not_empty().notify_all();
}

// Whether the consumer waits: it drained the ready queue, so is about to; paced,
// it is blocked in next() too (size() first: see ReadyQueue::waiting).
inline bool consumer_waits(const Assembler& a) {
  return a.ready().size() == 0 && (!a.config().paced || a.ready().waiting() > 0);
}

// A fresh example's first delivery, into row `row`; kept for repeats if its budget allows.
inline void deliver_fresh(Assembler& a, Batch& batch, std::size_t row, std::uint64_t k) {
  const auto [slot, budget] = a.reservoir().remove_fresh(a.rng());
  a.gather_row({slot, budget == 1}, batch, row);
  if (budget > 1) a.delivered().add(slot, 1, budget - 1, k);
}

// Assembles batch number k.
inline Step assemble_auto(Assembler& a, std::uint64_t k) {
  const BufferConfig& config = a.config();
  const RegionView& region = a.region();
  Reservoir& reservoir = a.reservoir();
  DeliveredPool& delivered = a.delivered();
  bool more_input = true;
  if (k == 0) more_input = a.fill(std::max(config.initial, config.batch_size)) != Step::kEnd;  // or kStarved
  if (a.stopped()) return Step::kEnd;
  delivered.begin_batch(k);
  make_room(a);
  Batch batch = a.new_batch(0);
  std::size_t row = 0;
  std::uint32_t slot;
  bool got = false;
  while (row < config.batch_size) {
    if (reservoir.fresh() > 0) {
      deliver_fresh(a, batch, row++, k);
      continue;
    }
    if (got || region.committed->try_pop(slot)) {
      a.take_in(slot);
      got = false;
      continue;
    }
    if (more_input && a.input_finished(slot, got)) more_input = false;
    if (got) continue;
    if (!more_input) break;
    // The consumer is waiting, or a producer waits for pages that only draws
    // free: echo.
    if (delivered.drawable() > 0 && (consumer_waits(a) || a.starved())) {
      a.gather_row(delivered.draw(a.rng(), k), batch, row++);
      continue;
    }
    if (delivered.size() > 0 && a.starved()) {  // all cooling, and only their pages let a producer on
      const auto [evicted, echoes] = delivered.evict(a.rng());
      a.count_evicted(echoes);
      a.release_slot(evicted);
      region.free->not_empty().notify_all();
      continue;
    }
    block_until(region.committed->not_empty(), Deadline::never(), [&] {
      if (region.committed->try_pop(slot)) return got = true;
      if (a.stop_requested()) return true;
      if (delivered.drawable() > 0 && consumer_waits(a)) return true;  // pairs with ReadyQueue::pop
      if (delivered.size() > 0 && a.starved()) return true;  // re-check; pairs with PageHeap::pop_blocking
      return a.input_finished(slot, got) || got;
    });
    if (a.stopped()) return Step::kEnd;
  }
  if (row == 0 || (row < config.batch_size && config.drop_last)) {
    a.count_dropped(row);  // only never-delivered examples count as dropped
    return a.finish();
  }
  batch.rows = row;
  a.push(std::move(batch));
  if (!more_input && reservoir.fresh() == 0) return a.finish();
  return Step::kBatch;
}

}  // namespace dataecho
