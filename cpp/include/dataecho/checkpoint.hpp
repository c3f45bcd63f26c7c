// Checkpoints of a deterministic buffer: capturing the assembler's state
// between two batches (or while it waits for input), and rebuilding it.
//
// In deterministic mode what the buffer yields from batch k on depends only on
// the examples resident before it (in reservoir order, with their remaining
// echo counts), the RNG's counter, the next sequence number to take in, and k
// (see snapshot.hpp). Examples are named by sequence number, not stored: on
// resume they are read again and put with the same numbers.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dataecho/assembler.hpp"
#include "dataecho/snapshot.hpp"

namespace dataecho {

// The state before batch k. Between batches, or part-way through filling for
// batch k (fill takes examples in by sequence number and draws nothing, so
// resuming it from here fills to the same target). Examples waiting out of
// order are not part of it: their numbers are >= next_seq, and they are re-read
// on resume.
inline Snapshot capture(const Assembler& a, std::uint64_t k) {
  Snapshot s;
  s.batches = k;
  s.rng_state = a.rng().state();
  s.next_seq = a.ordered().next_seq();
  s.available = a.reservoir().available();
  for (const auto& [slot, echoes] : a.reservoir().contents()) {
    s.seqs.push_back(a.region().slot_seq[slot]);
    s.echoes.push_back(echoes);
  }
  s.queued = a.ready().queued_seqs();
  return s;
}

// Takes in committed examples until every resident one of `s` has come (later
// numbers wait in the ordered intake as usual), then rebuilds the reservoir in
// its order, the RNG and the intake position. False if stopped first; throws
// (ending the stream with the error) if the input cannot satisfy `s`.
inline bool restore(Assembler& a, const Snapshot& s) {
  std::unordered_map<std::uint64_t, std::uint32_t> slot_of;
  while (slot_of.size() < s.seqs.size()) {
    std::uint32_t slot;
    const Assembler::Committed got = a.next_committed(slot, /*serve_snapshots=*/false);
    if (a.stopped()) return false;
    if (got != Assembler::Committed::kSlot)
      throw std::runtime_error("resume: the input ended before every resident example was put again");
    const std::uint64_t seq = a.region().slot_seq[slot];
    if (seq >= s.next_seq) {
      a.ordered().hold(seq, slot);
    } else if (!slot_of.emplace(seq, slot).second) {
      throw std::runtime_error("resume: example " + std::to_string(seq) + " was put twice");
    }
  }
  std::vector<std::pair<std::uint32_t, std::uint32_t>> contents;
  for (std::size_t i = 0; i < s.seqs.size(); ++i) {
    const auto found = slot_of.find(s.seqs[i]);
    if (found == slot_of.end())
      throw std::runtime_error("resume: example " + std::to_string(s.seqs[i]) + " was not put again");
    contents.emplace_back(found->second, s.echoes[i]);
  }
  a.reservoir().restore(contents, s.available);
  a.rng().set_state(s.rng_state);
  a.ordered().restart(s.next_seq);
  a.ordered().publish(*a.region().header);
  a.publish_resident();
  return true;
}

}  // namespace dataecho
