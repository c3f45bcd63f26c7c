// Binds dataecho::Producer over a shared region as _core.Producer: what a worker
// process uses to put examples straight into the slots of its parent's buffer.
// Type conversion, GIL policy and lifetimes only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "blocking.hpp"
#include "dataecho/producer.hpp"
#include "dataecho/shared_memory.hpp"
#include "fields.hpp"

namespace dataecho::py_binding {

namespace {

class PyProducer {
 public:
  PyProducer(const std::string& region, const std::vector<FieldDecl>& fields)
      : specs_(field_specs(fields)), memory_(SharedMemory::attach(region)) {
    ExampleLayout layout = example_layout(specs_, 1);
    RegionView view;
    if (!RegionView::attach(memory_.data(), memory_.size(), layout, view))
      throw py::value_error("region: " + region + " is not a dataecho buffer with these fields");
    producer_.emplace(std::move(layout), view);
  }

  // `arrays` is borrowed (see blocking.hpp): the caller's list keeps it alive.
  py::object put(py::handle arrays, std::optional<double> timeout_s, std::uint64_t seq) {
    const Rows rows = field_pointers(specs_, arrays, std::nullopt);
    check_fit(*producer_, rows, 1, ragged_count(specs_));
    return status_object(call_blocking(
        [&](Deadline d) { return producer_->put(rows.pointers.data(), d, seq, rows.lengths.data()); }, timeout_s));
  }

  std::pair<py::object, std::size_t> put_many(py::handle arrays, std::size_t n, std::optional<double> timeout_s,
                                       std::uint64_t first_seq) {
    const Rows rows = field_pointers(specs_, arrays, n);
    std::size_t done = 0;
    const Status status = call_blocking(
        [&](Deadline d) { return producer_->put_many(rows.pointers.data(), n, done, d, first_seq); }, timeout_s);
    return {status_object(status), done};
  }

  // Rows [done, n) of `columns` (see row_pointers), row i tagged first_seq + i.
  std::pair<py::object, std::size_t> put_each(py::handle columns, std::size_t n, std::optional<double> timeout_s,
                                              std::uint64_t first_seq, std::size_t done) {
    const Rows rows = row_pointers(specs_, columns, n);
    if (done > n) throw py::value_error("done: more than rows");
    check_fit(*producer_, rows, n, ragged_count(specs_));
    const Status status = call_blocking(
        [&](Deadline d) { return producer_->put_each(rows.pointers.data(), n, done, d, first_seq, rows.lengths.data()); },
        timeout_s);
    return {status_object(status), done};
  }

  Producer& producer() { return *producer_; }

 private:
  std::vector<FieldSpec> specs_;
  SharedMemory memory_;  // the mapping; outlives producer_, which points into it
  std::optional<Producer> producer_;
};

}  // namespace

void register_producer(py::module_& m) {
  py::class_<PyProducer>(m, "Producer", "Puts examples into a buffer's shared region from another process.")
      .def(py::init<const std::string&, const std::vector<FieldDecl>&>(), py::arg("region"), py::arg("fields"))
      .def("put", &PyProducer::put, py::arg("arrays"), py::arg("timeout_s"), py::arg("seq") = 0)
      .def("put_many", &PyProducer::put_many, py::arg("arrays"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0)
      .def("put_each", &PyProducer::put_each, py::arg("columns"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0, py::arg("done") = 0)
      .def("claim_range", [](PyProducer& p, std::uint64_t count) { return p.producer().claim_range(count); },
           py::arg("count"))
      .def("record", [](PyProducer& p, std::size_t worker, std::uint64_t produced, std::uint64_t busy_ns) {
        p.producer().record(worker, produced, busy_ns);
      }, py::arg("worker"), py::arg("produced"), py::arg("busy_ns"))
      .def_property_readonly("closed", [](PyProducer& p) { return p.producer().closed(); });
}

}  // namespace dataecho::py_binding
