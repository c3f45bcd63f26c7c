// Binds the delivery ledger (ledger.hpp): the consumer's thread adds each
// batch's positions; the Python layer reads the histograms, folds the counts
// into its totals across epochs, and saves and restores the ledger with a
// checkpoint. Conversions only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "dataecho/ledger.hpp"

namespace dataecho::py_binding {

namespace py = pybind11;

namespace {

using Positions = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>;

template <class T, std::size_t N>
py::array_t<std::uint64_t> copied(const std::array<T, N>& values) {
  return py::array_t<std::uint64_t>(static_cast<py::ssize_t>(N), values.data());
}

void add(DeliveryLedger& ledger, const Positions& positions) {
  if (positions.ndim() != 1) throw py::value_error("positions: expected a one-dimensional array");
  ledger.add(positions.data(), static_cast<std::size_t>(positions.size()));
}

void fold(const DeliveryLedger& ledger, py::array_t<std::uint8_t> totals, py::object index) {
  if (totals.ndim() != 1 || !(totals.flags() & py::array::c_style) || !totals.writeable())
    throw py::value_error("totals: expected a writable one-dimensional uint8 array");
  const std::size_t n = static_cast<std::size_t>(totals.size());
  if (index.is_none()) {
    for (std::size_t p = n; p < ledger.counts().size(); ++p)
      if (ledger.counts()[p] != 0) throw py::value_error("totals: shorter than the positions delivered");
    ledger.fold(totals.mutable_data(), nullptr, n);
    return;
  }
  auto order = py::cast<py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>>(index);
  if (order.ndim() != 1) throw py::value_error("index: expected a one-dimensional array");
  const auto& counts = ledger.counts();
  for (std::size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] == 0) continue;
    if (p >= static_cast<std::size_t>(order.size()) || order.data()[p] < 0 ||
        static_cast<std::size_t>(order.data()[p]) >= n)
      throw py::value_error("index: a delivered position has no example index within totals");
  }
  ledger.fold(totals.mutable_data(), order.data(), n);
}

void restore(DeliveryLedger& ledger, const py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>& counts,
             const py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast>& last, std::uint64_t batches,
             std::uint64_t delivered, const Positions& gaps) {
  if (counts.ndim() != 1 || last.ndim() != 1 || counts.size() != last.size())
    throw py::value_error("counts, last: expected one-dimensional arrays of one length");
  if (gaps.ndim() != 1 || gaps.size() != static_cast<py::ssize_t>(DeliveryLedger::kGapBuckets))
    throw py::value_error("gaps: expected one count per bucket");
  std::array<std::uint64_t, DeliveryLedger::kGapBuckets> buckets{};
  std::copy(gaps.data(), gaps.data() + gaps.size(), buckets.begin());
  ledger.restore(std::vector<std::uint8_t>(counts.data(), counts.data() + counts.size()),
                 std::vector<std::uint32_t>(last.data(), last.data() + last.size()), batches, delivered, buckets);
}

}  // namespace

void register_ledger(py::module_& m) {
  py::class_<DeliveryLedger>(m, "DeliveryLedger", "Deliveries per position and gaps between repeats (ledger.hpp).")
      .def(py::init<>())
      .def("add", &add, py::arg("positions"))
      .def_property_readonly("delivered", &DeliveryLedger::delivered)
      .def_property_readonly("distinct", &DeliveryLedger::distinct)
      .def_property_readonly("batches", &DeliveryLedger::batches)
      .def_property_readonly("by_count", [](const DeliveryLedger& l) { return copied(l.by_count()); })
      .def_property_readonly("gaps", [](const DeliveryLedger& l) { return copied(l.gaps()); })
      .def_property_readonly("counts", [](const DeliveryLedger& l) {
        return py::array_t<std::uint8_t>(static_cast<py::ssize_t>(l.counts().size()), l.counts().data());
      })
      .def_property_readonly("last", [](const DeliveryLedger& l) {
        return py::array_t<std::uint32_t>(static_cast<py::ssize_t>(l.last().size()), l.last().data());
      })
      .def("restore", &restore, py::arg("counts"), py::arg("last"), py::arg("batches"), py::arg("delivered"),
           py::arg("gaps"))
      .def_static("lower_bound", &DeliveryLedger::lower_bound, py::arg("bucket"))
      .def_readonly_static("max_count", &DeliveryLedger::kMaxCount)
      .def("fold", &fold, py::arg("totals"), py::arg("index") = py::none());
}

}  // namespace dataecho::py_binding
