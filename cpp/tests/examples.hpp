// The fixed-size examples the shuffle buffer tests move: an 8-byte id and a
// payload derived from it, so that a torn, misplaced or recycled row shows as
// a wrong payload. Also the buffer configuration shorthand, the put helpers
// and the Consumer that reads batches back into a Deliveries count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dataecho/layout.hpp"
#include "dataecho/shuffle_buffer.hpp"
#include "dataecho/wait.hpp"
#include "deliveries.hpp"
#include "harness.hpp"

namespace dataecho_test {

using dataecho::Batch;
using dataecho::BufferConfig;
using dataecho::Deadline;
using dataecho::ExampleLayout;
using dataecho::ShuffleBuffer;
using dataecho::Status;

inline constexpr std::size_t kPayload = 24;  // bytes of id-derived payload; the id field is 8 bytes

inline void payload_of(std::uint64_t id, std::uint8_t* out) {
  for (std::size_t j = 0; j < kPayload; ++j) out[j] = static_cast<std::uint8_t>((id * 31 + j * 7) % 251);
}

inline ExampleLayout id_layout(std::size_t batch_size) { return ExampleLayout({8, kPayload}, batch_size); }

inline BufferConfig make_config(std::size_t capacity, std::size_t batch, double echo, std::uint64_t seed) {
  BufferConfig config;
  config.capacity = capacity;
  config.batch_size = batch;
  config.echo_factor = echo;
  config.seed = seed;
  return config;
}

// One example by put() (two field pointers).
inline Status put_id(ShuffleBuffer& buf, std::uint64_t id, Deadline deadline) {
  std::uint8_t payload[kPayload];
  payload_of(id, payload);
  const void* fields[] = {&id, payload};
  return buf.put(fields, deadline);
}

// One example tagged with its id as sequence number, for deterministic intake.
inline Status put_seq(ShuffleBuffer& buf, std::uint64_t id) {
  std::uint8_t payload[kPayload];
  payload_of(id, payload);
  const void* fields[] = {&id, payload};
  return buf.producer().put(fields, Deadline::never(), id);
}

// Stacked ids and payloads for put_many(), or a source table to gather from.
struct Rows {
  explicit Rows(const std::vector<std::uint64_t>& ids_in) : ids(ids_in), payloads(ids.size() * kPayload) {
    for (std::size_t i = 0; i < ids.size(); ++i) payload_of(ids[i], &payloads[i * kPayload]);
  }
  Status put(ShuffleBuffer& buf, std::size_t& done, Deadline deadline) const {
    const void* fields[] = {ids.data(), payloads.data()};
    return buf.put_many(fields, ids.size(), done, deadline);
  }
  std::vector<std::uint64_t> ids;
  std::vector<std::uint8_t> payloads;
};

// 0, 1, ..., n - 1.
inline std::vector<std::uint64_t> iota_ids(std::uint64_t n) {
  std::vector<std::uint64_t> ids(n);
  for (std::uint64_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

// Reads batches as the consumer: checks shapes and payloads, counts ids.
struct Consumer {
  // Keeps a copy of the layout: batches stay readable after the buffer is gone.
  Consumer(const ShuffleBuffer& buf, std::uint64_t id_limit) : layout(buf.layout()), deliveries(id_limit) {}

  // Checks one batch; "only the last batch is short" is checked as batches come.
  void take(const Batch& batch, bool record_order) {
    CHECK_MSG(batch.rows >= 1 && batch.rows <= layout.batch_size(),
              "batch of " << batch.rows << " rows, batch_size " << layout.batch_size());
    CHECK_MSG(!short_seen, "a batch followed a short batch");
    if (batch.rows < layout.batch_size()) short_seen = true;
    const std::byte* base = batch.lease->data();
    for (std::size_t row = 0; row < batch.rows; ++row) {
      std::uint64_t id = 0;
      std::memcpy(&id, base + layout.batch_offset(0) + row * 8, 8);
      CHECK_MSG(deliveries.known(id), "unknown id " << id << " in row " << row);
      std::uint8_t want[kPayload];
      payload_of(id, want);
      CHECK_MSG(std::memcmp(want, base + layout.batch_offset(1) + row * kPayload, kPayload) == 0,
                "payload of id " << id << " corrupted (row " << row << ")");
      deliveries.record(id);
      if (record_order) order.push_back(id);
    }
    rows += batch.rows;
    ++batches;
  }

  // Takes batches until the end of the stream; each wait is bounded.
  void drain(ShuffleBuffer& buf, bool record_order = false) {
    Batch batch;
    for (;;) {
      const Status st = buf.next(batch, Deadline::after_seconds(g_options.timeout_s));
      if (st == Status::kClosed) return;
      CHECK_MSG(st == Status::kOk, "next() returned status " << static_cast<int>(st));
      take(batch, record_order);
    }
  }

  ExampleLayout layout;
  Deliveries deliveries;
  std::vector<std::uint64_t> order;
  std::uint64_t rows = 0;
  std::uint64_t batches = 0;
  bool short_seen = false;
  dataecho::BufferStats stats{};  // the buffer's, once a run is over
};

}  // namespace dataecho_test
