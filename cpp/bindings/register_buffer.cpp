// Binds dataecho::ShuffleBuffer as _core.Buffer. Type conversion, GIL policy and
// lifetimes only: arguments are validated, with messages that name them, in
// Python (dataecho/buffer.py, dataecho/config.py); the core's own checks are the
// backstop, and the array checks here keep a misuse of the private module from
// touching memory it should not.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "blocking.hpp"
#include "dataecho/shuffle_buffer.hpp"
#include "fields.hpp"

namespace dataecho::py_binding {

namespace {

class PyBuffer {
 public:
  PyBuffer(const std::vector<FieldDecl>& fields, BufferConfig config, std::optional<Snapshot> restore,
           std::shared_ptr<BlockCache> cache)
      : specs_(field_specs(fields)) {
    if (restore) config.restore = std::make_shared<const Snapshot>(std::move(*restore));
    core_ = std::make_unique<ShuffleBuffer>(ExampleLayout(field_bytes(specs_), config.batch_size), config,
                                            std::move(cache));
  }

  // `arrays` is borrowed (see blocking.hpp): the caller's list keeps it alive.
  py::object put(py::handle arrays, std::optional<double> timeout_s, std::uint64_t seq) {
    ShuffleBuffer& core = live();
    const auto pointers = field_pointers(specs_, arrays, std::nullopt);
    return status_object(
        call_blocking([&](Deadline d) { return core.producer().put(pointers.data(), d, seq); }, timeout_s));
  }

  std::pair<py::object, std::size_t> put_many(py::handle arrays, std::size_t n, std::optional<double> timeout_s,
                                          std::uint64_t first_seq) {
    ShuffleBuffer& core = live();
    const auto pointers = field_pointers(specs_, arrays, n);
    std::size_t done = 0;
    const Status status = call_blocking(
        [&](Deadline d) { return core.producer().put_many(pointers.data(), n, done, d, first_seq); }, timeout_s);
    return {status_object(status), done};
  }

  // Rows [done, n) of `columns` (see row_pointers), row i tagged first_seq + i.
  std::pair<py::object, std::size_t> put_each(py::handle columns, std::size_t n, std::optional<double> timeout_s,
                                              std::uint64_t first_seq, std::size_t done) {
    ShuffleBuffer& core = live();
    const auto rows = row_pointers(specs_, columns, n);
    if (done > n) throw py::value_error("done: more than rows");
    const Status status = call_blocking(
        [&](Deadline d) { return core.producer().put_each(rows.data(), n, done, d, first_seq); }, timeout_s);
    return {status_object(status), done};
  }

  // Returns (status, arrays): one array per field, each a view of the batch's
  // memory whose base owns the lease on it.
  std::pair<py::object, py::object> next(std::optional<double> timeout_s) {
    ShuffleBuffer& core = live();
    Batch batch;
    const Status status = call_blocking([&](Deadline d) { return core.next(batch, d); }, timeout_s);
    if (status != Status::kOk) return {status_object(status), py::none()};
    last_seqs_ = std::move(batch.seqs);
    return {status_object(status), batch_arrays(batch.lease, batch.rows)};
  }

  // A copy of `arrays` (a list: one C-contiguous array per field, `rows` of
  // them) in a block of this buffer's batch pool, as arrays like next()'s.
  py::tuple copy_batch(py::handle arrays, std::size_t rows) {
    ShuffleBuffer& core = live();
    if (rows == 0 || rows > core.layout().batch_size()) throw py::value_error("rows: out of range");
    const auto pointers = field_pointers(specs_, arrays, rows);
    std::shared_ptr<BatchPool::Lease> lease = core.lease_batch();
    const ExampleLayout& layout = core.layout();
    without_gil([&] {
      for (std::size_t f = 0; f < specs_.size(); ++f)
        std::memcpy(lease->data() + layout.batch_offset(f), pointers[f], rows * specs_[f].bytes);
    });
    return batch_arrays(lease, rows);
  }

  // Deterministic buffers: the rows' sequence numbers of the batch next() returned last.
  py::array_t<std::uint64_t> last_seqs() const { return py::array_t<std::uint64_t>(last_seqs_.size(), last_seqs_.data()); }

  // Deterministic buffers: waits for the assembler to reach a point where its
  // state can be taken (see checkpoint.hpp).
  std::pair<py::object, std::optional<Snapshot>> snapshot(std::optional<double> timeout_s) {
    ShuffleBuffer& core = live();
    Snapshot s;
    const Status status = call_blocking([&](Deadline d) { return core.snapshot(s, d); }, timeout_s);
    if (status != Status::kOk) return {status_object(status), std::nullopt};
    return {status_object(status), std::move(s)};
  }

  const ShuffleBuffer& core() const { return live(); }
  ShuffleBuffer& core() { return live(); }

  // (produced, busy_ns) of each of the first `workers` worker processes.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> worker_counters(std::size_t workers) const {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> counters;
    for (std::size_t w = 0; w < std::min(workers, kMaxWorkers); ++w) counters.push_back(live().worker_counters(w));
    return counters;
  }

  // Hands `nbytes` at `address` to the batch pool; `owner` (a page-locked torch
  // tensor, say) is kept alive until the pool, which may outlive this buffer
  // while batches are alive, lets go of the block.
  void add_batch_memory(std::uintptr_t address, std::size_t nbytes, py::object owner) {
    ShuffleBuffer& core = live();
    if (address == 0 || address % kSlotAlign != 0)
      throw py::value_error("batch memory: address must be non-null and 64-byte aligned");
    if (nbytes < core.layout().batch_bytes())
      throw py::value_error("batch memory: " + std::to_string(nbytes) + " bytes is less than a batch (" +
                            std::to_string(core.layout().batch_bytes()) + ")");
    PyObject* reference = owner.release().ptr();
    core.adopt_batch_memory(
        Block::adopt(reinterpret_cast<void*>(address), nbytes, &drop_reference, reference));
  }

  // In a forked child the assembler thread does not exist and the core's locks
  // may be in any state: leak the core (its memory is the child's private copy)
  // so that nothing joins a thread or takes a lock that cannot be released.
  void abandon_after_fork() noexcept { (void)core_.release(); }

 private:
  // One array per field over the batch block of `lease`, whose Python owner is
  // every array's base: the block returns to the pool when the last one dies.
  py::tuple batch_arrays(const std::shared_ptr<BatchPool::Lease>& lease, std::size_t rows) const {
    py::object owner = py::cast(lease);
    const ExampleLayout& layout = live().layout();
    py::tuple arrays(specs_.size());
    for (std::size_t f = 0; f < specs_.size(); ++f) {
      std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(rows)};
      shape.insert(shape.end(), specs_[f].shape.begin(), specs_[f].shape.end());
      arrays[f] = py::array(specs_[f].dtype, shape, lease->data() + layout.batch_offset(f), owner);
    }
    return arrays;
  }

  // Releases a block's owner. Blocks die with the pool, normally under the GIL
  // (a batch's arrays or the buffer being deallocated); at interpreter exit the
  // reference is left alone rather than touch a finalizing interpreter.
  static void drop_reference(void* object) noexcept {
    if (!Py_IsInitialized() || interpreter_finalizing()) return;
    const PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(static_cast<PyObject*>(object));
    PyGILState_Release(state);
  }

  ShuffleBuffer& live() const {
    if (!core_) throw std::runtime_error("this buffer belongs to the parent process");
    return *core_;
  }

  std::vector<FieldSpec> specs_;
  std::vector<std::uint64_t> last_seqs_;
  std::unique_ptr<ShuffleBuffer> core_;  // destroyed (stopped and joined) first
};

}  // namespace

void register_buffer(py::module_& m) {
  py::class_<BatchPool::Lease, std::shared_ptr<BatchPool::Lease>>(
      m, "BatchLease", "Owns one batch's memory; arrays of the batch keep it alive.");

  py::class_<BlockCache, std::shared_ptr<BlockCache>>(
      m, "BlockCache", "Keeps a freed buffer's memory for the next buffer of the same size (see memory.hpp).")
      .def(py::init<>())
      .def("clear", &BlockCache::clear)
      .def_property_readonly("kept_bytes", &BlockCache::kept_bytes);

  py::class_<PyBuffer>(m, "Buffer", "The native shuffle buffer (see shuffle_buffer.hpp).")
      .def(py::init<const std::vector<FieldDecl>&, BufferConfig, std::optional<Snapshot>,
                    std::shared_ptr<BlockCache>>(),
           py::arg("fields"), py::arg("config"), py::arg("restore") = py::none(), py::arg("cache") = nullptr)
      .def("put", &PyBuffer::put, py::arg("arrays"), py::arg("timeout_s"), py::arg("seq") = 0)
      .def("put_many", &PyBuffer::put_many, py::arg("arrays"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0)
      .def("next", &PyBuffer::next, py::arg("timeout_s"))
      .def_property_readonly("last_seqs", &PyBuffer::last_seqs)
      .def("copy_batch", &PyBuffer::copy_batch, py::arg("arrays"), py::arg("rows"))
      .def("snapshot", &PyBuffer::snapshot, py::arg("timeout_s"))
      .def("close", [](PyBuffer& b) { b.core().close(); })
      .def("stop", [](PyBuffer& b) { b.core().stop(); })  // quick: flags and wake-ups only
      .def("stats", [](const PyBuffer& b) { return b.core().stats(); })
      .def("put_each", &PyBuffer::put_each, py::arg("columns"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0, py::arg("done") = 0)
      .def("claim_range", [](PyBuffer& b, std::uint64_t count) { return b.core().producer().claim_range(count); },
           py::arg("count"))
      .def("set_index_range",
           [](PyBuffer& b, std::uint64_t begin, std::uint64_t end) { b.core().set_index_range(begin, end); },
           py::arg("begin"), py::arg("end"))
      .def_property_readonly("region_name", [](const PyBuffer& b) { return b.core().region_name(); })
      .def("unlink_region", [](PyBuffer& b) { b.core().unlink_region(); })
      .def("worker_counters", &PyBuffer::worker_counters, py::arg("workers"))
      .def("add_batch_memory", &PyBuffer::add_batch_memory, py::arg("address"), py::arg("nbytes"),
           py::arg("owner"))
      .def("abandon_after_fork", &PyBuffer::abandon_after_fork)
      .def_property_readonly("initial", [](const PyBuffer& b) { return b.core().config().initial; })
      .def_property_readonly("slot_stride", [](const PyBuffer& b) { return b.core().layout().slot_stride(); })
      .def_property_readonly("batch_bytes", [](const PyBuffer& b) { return b.core().layout().batch_bytes(); })
      .def_property_readonly("batch_blocks_adopted",
                             [](const PyBuffer& b) { return b.core().batch_blocks_adopted(); });
}

}  // namespace dataecho::py_binding
