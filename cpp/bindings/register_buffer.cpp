// Binds dataecho::ShuffleBuffer as _core.Buffer. Type conversion, GIL policy and
// lifetimes only: argument validation with friendly messages lives in Python
// (dataecho/buffer.py); the checks here only keep a misuse of the private module
// from touching memory it should not.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
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
  PyBuffer(const std::vector<FieldDecl>& fields, std::size_t capacity, std::size_t batch_size,
           double echo_factor, bool auto_echo, double max_echo, std::uint64_t seed, bool drop_last,
           std::size_t prefetch, std::size_t initial, bool shared, bool deterministic, bool exact_echo,
           std::optional<py::dict> restore)
      : specs_(field_specs(fields)) {
    if (capacity == 0 || capacity > Ring::kMaxCapacity) throw py::value_error("capacity: out of range");
    if (batch_size == 0 || batch_size > capacity) throw py::value_error("batch_size: out of range");
    if (!(echo_factor >= 1.0 && echo_factor < 4294967296.0))
      throw py::value_error("echo_factor: out of range");
    if (!(max_echo >= 1.0 && max_echo < 4294967296.0)) throw py::value_error("max_echo: out of range");
    if (prefetch == 0) throw py::value_error("prefetch: must be positive");
    BufferConfig config;
    config.capacity = capacity;
    config.batch_size = batch_size;
    config.echo_factor = echo_factor;
    config.auto_echo = auto_echo;
    config.max_echo = max_echo;
    config.seed = seed;
    config.drop_last = drop_last;
    config.prefetch = prefetch;
    config.initial = initial;
    config.shared = shared;
    if ((deterministic || exact_echo) && auto_echo)
      throw py::value_error("deterministic: not with echo_factor='auto'");
    config.deterministic = deterministic;
    config.exact_echo = exact_echo;
    if (restore) config.restore = std::make_shared<const Snapshot>(snapshot_from(*restore, config));
    core_ = std::make_unique<ShuffleBuffer>(ExampleLayout(field_bytes(specs_), batch_size), config);
  }

  // `arrays` is borrowed (see blocking.hpp): the caller's list keeps it alive.
  int put(py::handle arrays, std::optional<double> timeout_s, std::uint64_t seq) {
    ShuffleBuffer& core = live();
    const auto pointers = field_pointers(specs_, arrays, std::nullopt);
    return static_cast<int>(
        call_blocking([&](Deadline d) { return core.producer().put(pointers.data(), d, seq); }, timeout_s));
  }

  std::pair<int, std::size_t> put_many(py::handle arrays, std::size_t n, std::optional<double> timeout_s,
                                       std::uint64_t first_seq) {
    ShuffleBuffer& core = live();
    const auto pointers = field_pointers(specs_, arrays, n);
    std::size_t done = 0;
    const Status status = call_blocking(
        [&](Deadline d) { return core.producer().put_many(pointers.data(), n, done, d, first_seq); }, timeout_s);
    return {static_cast<int>(status), done};
  }

  // Returns (status, arrays): one array per field, each a view of the batch's
  // memory whose base owns the lease on it.
  std::pair<int, py::object> next(std::optional<double> timeout_s) {
    ShuffleBuffer& core = live();
    Batch batch;
    const Status status = call_blocking([&](Deadline d) { return core.next(batch, d); }, timeout_s);
    if (status != Status::kOk) return {static_cast<int>(status), py::none()};
    last_seqs_ = std::move(batch.seqs);
    py::object owner = py::cast(batch.lease);
    const ExampleLayout& layout = core.layout();
    py::tuple arrays(specs_.size());
    for (std::size_t f = 0; f < specs_.size(); ++f) {
      std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(batch.rows)};
      shape.insert(shape.end(), specs_[f].shape.begin(), specs_[f].shape.end());
      arrays[f] = py::array(specs_[f].dtype, shape, batch.lease->data() + layout.batch_offset(f), owner);
    }
    return {static_cast<int>(status), std::move(arrays)};
  }

  // Deterministic buffers: the rows' sequence numbers of the batch next() returned last.
  py::array_t<std::uint64_t> last_seqs() const { return py::array_t<std::uint64_t>(last_seqs_.size(), last_seqs_.data()); }

  // Deterministic buffers: (status, state) with the state as a dict (see
  // snapshot.hpp); waits for the assembler to finish the batch it is on.
  std::pair<int, py::object> snapshot(std::optional<double> timeout_s) {
    ShuffleBuffer& core = live();
    if (!core.config().deterministic) throw py::value_error("snapshot: the buffer is not deterministic");
    Snapshot s;
    const Status status = call_blocking([&](Deadline d) { return core.snapshot(s, d); }, timeout_s);
    if (status != Status::kOk) return {static_cast<int>(status), py::none()};
    py::dict d;
    d["batches"] = s.batches;
    d["rng_state"] = s.rng_state;
    d["next_seq"] = s.next_seq;
    d["available"] = s.available;
    d["seqs"] = py::array_t<std::uint64_t>(s.seqs.size(), s.seqs.data());
    d["echoes"] = py::array_t<std::uint32_t>(s.echoes.size(), s.echoes.data());
    py::list queued;
    for (const auto& rows : s.queued) queued.append(py::array_t<std::uint64_t>(rows.size(), rows.data()));
    d["queued"] = queued;
    d["ended"] = s.ended;
    return {static_cast<int>(status), std::move(d)};
  }

  void close() { live().close(); }

  void stop() { live().stop(); }  // quick: flags and wake-ups only

  py::dict stats() const {
    const BufferStats s = live().stats();
    py::dict d;
    d["fresh"] = s.fresh;
    d["delivered"] = s.delivered;
    d["batches"] = s.batches;
    d["dropped"] = s.dropped;
    d["evicted"] = s.evicted;
    d["resident"] = s.resident;
    d["producer_wait_s"] = s.producer_wait_s;
    d["consumer_wait_s"] = s.consumer_wait_s;
    return d;
  }

  const ShuffleBuffer& core() const { return live(); }
  ShuffleBuffer& core() { return live(); }

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
  // The state to resume from, checked so that no invariant of the core can fail.
  static Snapshot snapshot_from(const py::dict& d, const BufferConfig& config) {
    if (!config.deterministic) throw py::value_error("restore: only a deterministic buffer resumes");
    Snapshot s;
    s.batches = d["batches"].cast<std::uint64_t>();
    s.rng_state = d["rng_state"].cast<std::uint64_t>();
    s.next_seq = d["next_seq"].cast<std::uint64_t>();
    s.available = d["available"].cast<std::uint64_t>();
    s.seqs = d["seqs"].cast<std::vector<std::uint64_t>>();
    s.echoes = d["echoes"].cast<std::vector<std::uint32_t>>();
    if (s.seqs.size() != s.echoes.size()) throw py::value_error("restore: seqs and echoes differ in length");
    if (s.seqs.size() > config.capacity) throw py::value_error("restore: more resident examples than capacity");
    if (s.available > s.seqs.size()) throw py::value_error("restore: available exceeds the resident examples");
    std::vector<std::uint64_t> sorted = s.seqs;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw py::value_error("restore: a resident example is listed twice");
    if (!sorted.empty() && sorted.back() >= s.next_seq)
      throw py::value_error("restore: a resident example is numbered at or beyond next_seq");
    for (std::uint32_t echoes : s.echoes)
      if (echoes == 0) throw py::value_error("restore: a resident example has no echo left");
    return s;
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

  py::class_<PyBuffer>(m, "Buffer")
      .def(py::init<const std::vector<FieldDecl>&, std::size_t, std::size_t, double, bool, double,
                    std::uint64_t, bool, std::size_t, std::size_t, bool, bool, bool,
                    std::optional<py::dict>>(),
           py::arg("fields"), py::arg("capacity"), py::arg("batch_size"), py::arg("echo_factor"),
           py::arg("auto_echo"), py::arg("max_echo"), py::arg("seed"), py::arg("drop_last"),
           py::arg("prefetch"), py::arg("initial"), py::arg("shared") = false, py::arg("deterministic") = false,
           py::arg("exact_echo") = false, py::arg("restore") = py::none())
      .def("claim_index", [](PyBuffer& b) { return b.core().producer().claim_index(); })
      .def_property_readonly("region_name", [](const PyBuffer& b) { return b.core().region_name(); })
      .def("unlink_region", [](PyBuffer& b) { b.core().unlink_region(); })
      .def("set_index_range",
           [](PyBuffer& b, std::uint64_t begin, std::uint64_t end) { b.core().set_index_range(begin, end); },
           py::arg("begin"), py::arg("end"))
      .def("worker_counters", &PyBuffer::worker_counters, py::arg("workers"))
      .def("add_batch_memory", &PyBuffer::add_batch_memory, py::arg("address"), py::arg("nbytes"),
           py::arg("owner"))
      .def("put", &PyBuffer::put, py::arg("arrays"), py::arg("timeout_s"), py::arg("seq") = 0)
      .def("put_many", &PyBuffer::put_many, py::arg("arrays"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0)
      .def("next", &PyBuffer::next, py::arg("timeout_s"))
      .def("snapshot", &PyBuffer::snapshot, py::arg("timeout_s"))
      .def_property_readonly("last_seqs", &PyBuffer::last_seqs)
      .def("close", &PyBuffer::close)
      .def("stop", &PyBuffer::stop)
      .def("stats", &PyBuffer::stats)
      .def("abandon_after_fork", &PyBuffer::abandon_after_fork)
      .def_property_readonly("initial", [](const PyBuffer& b) { return b.core().config().initial; })
      .def_property_readonly("slot_stride", [](const PyBuffer& b) { return b.core().layout().slot_stride(); })
      .def_property_readonly("batch_bytes", [](const PyBuffer& b) { return b.core().layout().batch_bytes(); })
      .def_property_readonly("free_slots", [](const PyBuffer& b) { return b.core().free_slots(); })
      .def_property_readonly("batch_blocks_allocated",
                             [](const PyBuffer& b) { return b.core().batch_blocks_allocated(); })
      .def_property_readonly("batch_blocks_adopted",
                             [](const PyBuffer& b) { return b.core().batch_blocks_adopted(); });

  m.def("default_initial", &ShuffleBuffer::default_initial, py::arg("capacity"), py::arg("batch_size"));
}

}  // namespace dataecho::py_binding
