// Assembly with a fixed echo factor: fill the reservoir to its target, then
// draw a batch uniformly among the resident examples, without replacement
// within the batch (or, in order, the oldest resident ones: a FIFO).
//
// Fill policy. Before batch k the assembler takes in committed examples until
// min(full, max(initial, batch_size) + k * batch_size) are resident: the first
// batch needs only `initial`, and the reservoir then grows by one example per
// example delivered (as in WebDataset's shuffle) until it is full (see
// Assembler::full()). It never takes in more than the target, so with one
// producer the output order depends only on the seed and the input, not on
// thread timing. After close() and once every in-flight put has landed, the
// rest drains.
//
// Memory budget: when producers wait for pages of the heap (ragged values),
// fill stops short and the batch is drawn from what is resident; should that
// run out mid-batch, the rows drawn so far have freed pages, and more is taken
// in before the next draw. Under that pressure the order depends on timing.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dataecho/assembler.hpp"

namespace dataecho {

// Assembles batch number k.
inline Step assemble_fixed(Assembler& a, std::uint64_t k) {
  const BufferConfig& config = a.config();
  const std::size_t target =
      std::min<std::uint64_t>(a.full(), std::max(config.initial, config.batch_size) + k * config.batch_size);
  const Step filled = a.fill(target);
  if (filled == Step::kSnapshot) return filled;
  if (a.stopped()) return Step::kEnd;
  Reservoir& reservoir = a.reservoir();
  std::size_t rows = config.batch_size;
  if (filled == Step::kEnd && reservoir.echoes_left() < rows) {
    rows = static_cast<std::size_t>(reservoir.echoes_left());
    if (rows == 0 || config.drop_last) return a.finish();
  }
  Batch batch = a.new_batch(rows);
  reservoir.begin_batch();
  for (std::size_t row = 0; row < rows; ++row) {
    if (reservoir.size() == 0 && a.fill(1, /*serve_snapshots=*/false) != Step::kBatch) {
      if (a.stopped()) return Step::kEnd;
      // The input ended mid-batch (starved only): this batch is the last, short.
      if (row == 0 || config.drop_last) {
        a.count_dropped(row);
        return a.finish();
      }
      batch.rows = row;
      break;
    }
    a.gather_row(config.in_order ? reservoir.draw_first() : reservoir.draw(a.rng()), batch, row);
  }
  a.push(std::move(batch));
  return Step::kBatch;
}

}  // namespace dataecho
