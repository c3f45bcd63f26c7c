// Binds the core's value types: the buffer's configuration, its counters, a
// checkpoint snapshot, the status of a blocking call, and the limits that the
// Python layer validates arguments against (exported once, here).
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "blocking.hpp"
#include "dataecho/buffer_config.hpp"
#include "dataecho/producer.hpp"
#include "dataecho/region.hpp"
#include "dataecho/snapshot.hpp"
#include "fields.hpp"

namespace dataecho::py_binding {

namespace py = pybind11;

namespace {

template <class T>
py::array_t<T> to_array(const std::vector<T>& values) {
  return py::array_t<T>(static_cast<py::ssize_t>(values.size()), values.data());
}

template <class T>
std::vector<T> from_array(const py::array_t<T, py::array::c_style | py::array::forcecast>& array) {
  if (array.ndim() != 1) throw py::value_error("expected a one-dimensional array");
  return std::vector<T>(array.data(), array.data() + array.size());
}

void register_config(py::module_& m) {
  py::class_<BufferConfig>(m, "BufferConfig", "A buffer's configuration (see buffer_config.hpp).")
      .def(py::init<>())
      .def_readwrite("capacity", &BufferConfig::capacity)
      .def_readwrite("batch_size", &BufferConfig::batch_size)
      .def_readwrite("echo_factor", &BufferConfig::echo_factor)
      .def_readwrite("auto_echo", &BufferConfig::auto_echo)
      .def_readwrite("max_echo", &BufferConfig::max_echo)
      .def_readwrite("echo_gap", &BufferConfig::echo_gap)
      .def_readwrite("paced", &BufferConfig::paced)
      .def_readwrite("seed", &BufferConfig::seed)
      .def_readwrite("drop_last", &BufferConfig::drop_last)
      .def_readwrite("prefetch", &BufferConfig::prefetch)
      .def_readwrite("initial", &BufferConfig::initial)
      .def_readwrite("window", &BufferConfig::window)
      .def_readwrite("shared", &BufferConfig::shared)
      .def_readwrite("deterministic", &BufferConfig::deterministic)
      .def_readwrite("exact_echo", &BufferConfig::exact_echo)
      .def_readwrite("in_order", &BufferConfig::in_order)
      .def_readwrite("pages", &BufferConfig::pages)
      .def_readwrite("page_bytes", &BufferConfig::page_bytes)
      .def_readwrite("key_field", &BufferConfig::key_field)
      .def_readwrite("hold_min_bytes", &BufferConfig::hold_min_bytes);
}

void register_stats(py::module_& m) {
  py::class_<BufferStats>(m, "BufferStats", "A buffer's counters (see buffer_config.hpp).")
      .def_readonly("fresh", &BufferStats::fresh)
      .def_readonly("delivered", &BufferStats::delivered)
      .def_readonly("batches", &BufferStats::batches)
      .def_readonly("dropped", &BufferStats::dropped)
      .def_readonly("evicted", &BufferStats::evicted)
      .def_readonly("resident", &BufferStats::resident)
      .def_readonly("free_slots", &BufferStats::free_slots)
      .def_readonly("batch_blocks", &BufferStats::batch_blocks)
      .def_readonly("pages", &BufferStats::pages)
      .def_readonly("pages_in_use", &BufferStats::pages_in_use)
      .def_readonly("starved", &BufferStats::starved)
      .def_readonly("producer_wait_s", &BufferStats::producer_wait_s)
      .def_readonly("consumer_wait_s", &BufferStats::consumer_wait_s);
}

void register_snapshot(py::module_& m) {
  py::class_<Snapshot>(m, "Snapshot", "A deterministic buffer's state before a batch (see snapshot.hpp).")
      .def(py::init<>())
      .def_readwrite("batches", &Snapshot::batches)
      .def_readwrite("rng_state", &Snapshot::rng_state)
      .def_readwrite("next_seq", &Snapshot::next_seq)
      .def_readwrite("available", &Snapshot::available)
      .def_readwrite("ended", &Snapshot::ended)
      .def_property(
          "seqs", [](const Snapshot& s) { return to_array(s.seqs); },
          [](Snapshot& s, const py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>& a) {
            s.seqs = from_array(a);
          })
      .def_property(
          "echoes", [](const Snapshot& s) { return to_array(s.echoes); },
          [](Snapshot& s, const py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast>& a) {
            s.echoes = from_array(a);
          })
      .def_property(
          "queued",
          [](const Snapshot& s) {
            py::list out;
            for (const auto& rows : s.queued) out.append(to_array(rows));
            return out;
          },
          [](Snapshot& s, const std::vector<py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>>& q) {
            s.queued.clear();
            for (const auto& rows : q) s.queued.push_back(from_array(rows));
          });
}

}  // namespace

void register_types(py::module_& m) {
  m.def("exact_rows", [](py::handle values, const FieldDecl& field) { return exact_rows(field_specs({field})[0], values); },
        py::arg("values"), py::arg("field"),
        "How many leading items of a list are C-contiguous arrays of the field's (shape, dtype) exactly.");
  py::native_enum<Status>(m, "Status", "enum.IntEnum", "The outcome of a blocking call.")
      .value("OK", Status::kOk)
      .value("CLOSED", Status::kClosed)
      .value("TIMEOUT", Status::kTimeout)
      .finalize();
  const py::object members = m.attr("Status");
  for (const char* name : {"OK", "CLOSED", "TIMEOUT"}) {
    py::object member = members.attr(name);
    const int value = member.cast<int>();
    g_status_objects[value] = member.release();
  }
  register_config(m);
  register_stats(m);
  register_snapshot(m);
  m.attr("MAX_CAPACITY") = kMaxCapacity;
  m.attr("MAX_ECHO") = kMaxEcho;
  m.attr("MAX_WORKERS") = kMaxWorkers;
  m.attr("MAX_PAGES") = kMaxPages;
  m.attr("MIN_PAGE_BYTES") = kMinPageBytes;
  m.attr("MAX_PAGE_BYTES") = kMaxPageBytes;
  m.def("default_initial", &default_initial, py::arg("capacity"), py::arg("batch_size"),
        "Resident examples needed before the first batch when `initial` is not given.");
}

}  // namespace dataecho::py_binding
