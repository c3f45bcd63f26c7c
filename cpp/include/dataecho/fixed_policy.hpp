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
  if (config.in_order) {
    for (std::size_t row = 0; row < rows; ++row) a.gather_row(reservoir.draw_first(), batch, row);
  } else {
    for (std::size_t row = 0; row < rows; ++row) a.gather_row(reservoir.draw(a.rng()), batch, row);
  }
  a.push(std::move(batch));
  return Step::kBatch;
}

}  // namespace dataecho
