// Binds dataecho::ShuffleBuffer as _core.Buffer. Type conversion, GIL policy and
// lifetimes only: arguments are validated, with messages that name them, in
// Python (dataecho/buffer.py, dataecho/config/); the core's own checks are the
// backstop, and the array checks here keep a misuse of the private module from
// touching memory it should not.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "blocking.hpp"
#include "dataecho/shuffle_buffer.hpp"
#include "fields.hpp"
#include "held.hpp"

namespace dataecho::py_binding {

namespace {

class PyBuffer {
 public:
  PyBuffer(const std::vector<FieldDecl>& fields, BufferConfig config, std::optional<Snapshot> restore,
           std::shared_ptr<BlockCache> cache)
      : specs_(field_specs(fields)) {
    if (restore) config.restore = std::make_shared<const Snapshot>(std::move(*restore));
    if (config.shared && config.hold_min_bytes != 0)  // pointers into this process mean nothing to workers
      throw py::value_error("config: a shared buffer holds nothing (hold_min_bytes 0)");
    ExampleLayout layout = example_layout(specs_, config.batch_size, config.hold_min_bytes);
    if (!layout.ragged_fields().empty() && config.pages == 0)
      throw py::value_error("config: ragged fields need a page heap (pages, page_bytes)");
    if (config.pages != 0 && (layout.ragged_fields().empty() || !std::has_single_bit(config.page_bytes) ||
                              config.page_bytes < kMinPageBytes || config.page_bytes > kMaxPageBytes))
      throw py::value_error("config: a page heap needs ragged fields and a power-of-two page_bytes");
    if (config.key_field >= 0 &&
        (static_cast<std::size_t>(config.key_field) >= specs_.size() || specs_[config.key_field].ragged ||
         specs_[config.key_field].bytes != sizeof(std::uint64_t)))
      throw py::value_error("config: key_field must name a fixed 8-byte field");
    core_ = std::make_unique<ShuffleBuffer>(std::move(layout), config, std::move(cache));
  }

  // `arrays` is borrowed (see blocking.hpp): the caller's list keeps it alive.
  // `hold`: which values of holdable fields are held by reference (layout.hpp),
  // their arrays kept alive until their last echo is gathered (see take_holds).
  py::object put(py::handle arrays, std::optional<double> timeout_s, std::uint64_t seq, py::handle hold) {
    ShuffleBuffer& core = live();
    const Rows rows = field_pointers(specs_, arrays, std::nullopt);
    check_fit(core.producer(), rows, 1, ragged_count(specs_));
    const std::vector<std::uint64_t> owners = take_holds(arrays, hold, 1, 0, true);
    const Status status = call_blocking(
        [&](Deadline d) {
          return core.producer().put(rows.pointers.data(), d, seq, rows.lengths.data(), held_or_null(owners));
        },
        timeout_s);
    if (status != Status::kOk) give_back_holds(owners, 1, 0);  // not put: nothing holds them
    return status_object(status);
  }

  std::pair<py::object, std::size_t> put_many(py::handle arrays, std::size_t n, std::optional<double> timeout_s,
                                              std::uint64_t first_seq, py::handle hold) {
    ShuffleBuffer& core = live();
    const Rows rows = field_pointers(specs_, arrays, n);
    // Stacked: every row's handles are row 0's, which are all the core reads.
    const std::vector<std::uint64_t> owners = take_holds(arrays, hold, n, 0, false);
    std::size_t done = 0;
    const Status status = call_blocking(
        [&](Deadline d) {
          return core.producer().put_many(rows.pointers.data(), n, done, d, first_seq, held_or_null(owners));
        },
        timeout_s);
    give_back_holds(owners, n, done);
    return {status_object(status), done};
  }

  // Rows [done, n) of `columns` (see row_pointers), row i tagged first_seq + i;
  // `hold`: as put()'s.
  std::pair<py::object, std::size_t> put_each(py::handle columns, std::size_t n, std::optional<double> timeout_s,
                                              std::uint64_t first_seq, std::size_t done, py::handle hold) {
    ShuffleBuffer& core = live();
    const Rows rows = row_pointers(specs_, columns, n);
    if (done > n) throw py::value_error("done: more than rows");
    check_fit(core.producer(), rows, n, ragged_count(specs_));
    const std::size_t first = done;
    const std::vector<std::uint64_t> owners = take_holds(columns, hold, n, first, false);
    const Status status = call_blocking(
        [&](Deadline d) {
          return core.producer().put_each(rows.pointers.data(), n, done, d, first_seq, rows.lengths.data(),
                                          held_or_null(owners));
        },
        timeout_s);
    give_back_holds(owners, n, done);
    return {status_object(status), done};
  }

  // Write-into: rows [done, rows), row i numbered first_seq + i, each written
  // by `write(i, views)` straight into its slot: `views`, one writable array
  // per field over the slot's memory (fixed fields only; none held). A
  // write that keeps a view (or anything made from one) past its return would
  // see the slot's memory change once the slot is reused: the row is then
  // not committed, its slot never reused, and a ValueError says so (the views'
  // base keeps this buffer alive). Waits without the GIL; writes with it.
  std::pair<py::object, std::size_t> put_into(std::size_t n, std::uint64_t first_seq, py::function write,
                                              std::optional<double> timeout_s, std::size_t done) {
    ShuffleBuffer& core = live();
    if (ragged_count(specs_) != 0) throw py::value_error("put_into: fixed fields only");
    Producer& producer = core.producer();
    const ExampleLayout& layout = core.layout();
    py::object owner = py::cast(this, py::return_value_policy::reference);
    producer.begin();
    struct End {
      Producer& p;
      ~End() { p.end(); }
    } end{producer};
    Status status = Status::kOk;
    while (done < n) {
      const std::uint64_t seq = first_seq + done;
      std::uint32_t slot = 0;
      status = call_blocking([&](Deadline d) { return producer.reserve(seq, slot, d); }, timeout_s);
      if (status != Status::kOk) break;
      std::byte* data = producer.slot_data(slot);
      py::list views(specs_.size());
      for (std::size_t f = 0; f < specs_.size(); ++f)
        views[f] = py::array(specs_[f].dtype, specs_[f].shape, data + layout.slot_offset(f), owner);
      try {
        write(done, views);
      } catch (...) {
        producer.cancel(slot);
        throw;
      }
      for (std::size_t f = 0; f < specs_.size(); ++f) {
        // Ours alone (the list's reference): nothing the write made from the view outlives it.
        if (Py_REFCNT(PyList_GET_ITEM(views.ptr(), static_cast<py::ssize_t>(f))) != 1)
          throw py::value_error("read_into: kept its out array (or a view of it) after it returned; "
                                "it must write out's values and keep no reference to out");
      }
      producer.commit(slot, seq);
      ++done;
    }
    return {status_object(status), done};
  }

  // Returns (status, arrays): one array per field, each a view of the batch's
  // memory whose base owns the lease on it.
  std::pair<py::object, py::object> next(std::optional<double> timeout_s) {
    ShuffleBuffer& core = live();
    Batch batch;
    const Status status = call_blocking([&](Deadline d) { return core.next(batch, d); }, timeout_s);
    // GIL: retaken by call_blocking; the releases (decrefs, writeable flags) run on
    // the consumer's thread under it, while producers' puts may take holds on theirs.
    holdings_.release_all(batch.unheld);  // their last echoes are in this batch or an earlier one, or never come
    if (status != Status::kOk) return {status_object(status), py::none()};
    last_seqs_ = std::move(batch.seqs);
    last_released_ = std::move(batch.released);
    return {status_object(status), batch_arrays(batch.lease, batch.rows)};
  }

  // A copy of `arrays` (a list: one C-contiguous array per field, `rows` of
  // them; a ragged field as (values, offsets) from 0) in a block of this
  // buffer's batch pool, as arrays like next()'s.
  py::tuple copy_batch(py::handle arrays, std::size_t rows) {
    ShuffleBuffer& core = live();
    const ExampleLayout& layout = core.layout();
    if (rows == 0 || rows > layout.batch_size()) throw py::value_error("rows: out of range");
    if (!PyList_Check(arrays.ptr()) || PyList_GET_SIZE(arrays.ptr()) != static_cast<py::ssize_t>(specs_.size()))
      throw py::type_error("arrays: expected a list, one entry per field");
    std::vector<const void*> from(specs_.size());
    std::vector<const std::int64_t*> offsets_from(specs_.size(), nullptr);  // taken with the GIL, read without
    std::vector<std::size_t> bytes(specs_.size());
    for (std::size_t f = 0; f < specs_.size(); ++f) {
      py::handle item = PyList_GET_ITEM(arrays.ptr(), f);
      if (!specs_[f].ragged) {
        from[f] = checked_data(item, specs_[f].bytes, rows, "batch: field", f);
        bytes[f] = rows * specs_[f].bytes;
        continue;
      }
      Rows packed;
      packed.pointers.resize(rows);
      packed.lengths.resize(rows);
      if (!PyTuple_Check(item.ptr()))
        throw py::type_error("batch: field " + std::to_string(f) + ": expected (values, offsets)");
      packed_rows(item, specs_[f].bytes, rows, 0, 1, 0, 1, packed);
      const auto offsets = py::reinterpret_borrow<py::array_t<std::int64_t>>(PyTuple_GET_ITEM(item.ptr(), 1));
      if (offsets.data()[0] != 0) throw py::value_error("batch: field " + std::to_string(f) + ": offsets start at 0");
      from[f] = PyArray_DATA_of(PyTuple_GET_ITEM(item.ptr(), 0));
      offsets_from[f] = offsets.data();
      bytes[f] = static_cast<std::size_t>(offsets.data()[rows]) * specs_[f].bytes;
    }
    std::shared_ptr<BatchPool::Lease> lease = core.lease_batch();
    for (std::size_t r = 0; r < layout.ragged_fields().size(); ++r)
      lease->reserve_values(r, bytes[layout.ragged_fields()[r]]);
    without_gil([&] {
      for (std::size_t f = 0, r = 0; f < specs_.size(); ++f) {
        if (!specs_[f].ragged) {
          std::memcpy(lease->data() + layout.batch_offset(f), from[f], bytes[f]);
          continue;
        }
        std::memcpy(layout.offsets(lease->data(), f), offsets_from[f], (rows + 1) * sizeof(std::int64_t));
        if (bytes[f] > 0) std::memcpy(lease->values(r), from[f], bytes[f]);
        lease->set_values_used(r, bytes[f]);
        ++r;
      }
    });
    return batch_arrays(lease, rows);
  }

  // The rows' sequence numbers of the batch next() returned last.
  py::array_t<std::uint64_t> last_seqs() const { return py::array_t<std::uint64_t>(last_seqs_.size(), last_seqs_.data()); }

  // With a key field: the keys of the examples freed while the last batch was assembled.
  // Object leaves: the core carries only these keys; their objects' references are
  // dropped in Python (dataecho/examples/objects.py) on the consumer's thread, under
  // the GIL, which also orders them against the producers' puts of new keys.
  py::array_t<std::uint64_t> last_released() const {
    return py::array_t<std::uint64_t>(last_released_.size(), last_released_.data());
  }

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
  const Holdings& holdings() const noexcept { return holdings_; }
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
  // Holds for rows [first, n) of a put's holdable fields, row-major (H per
  // row), as Python's hold policy decided them (`hold`: None, or per holdable
  // field False, True, or for a list column one bool per row; see
  // dataecho/native/hold.py). The owner of a held value is always taken from
  // the column itself, so that it is what owns the memory the core will read:
  // the value of a single put, an item of a list column, else the column's
  // array (stacked rows, or the source of (array, indices)). All but a source
  // are lent: read-only while held (see Holdings). Entries of rows before
  // `first` and of values copied are 0. GIL: the lists are read through borrowed
  // items (PyList_GET_ITEM) and the holds taken while it is held, so that no other
  // thread changes them, or the counts, meanwhile.
  std::vector<std::uint64_t> take_holds(py::handle columns, py::handle hold, std::size_t n, std::size_t first,
                                        bool single) {
    if (hold.is_none()) return {};
    const auto& holdable = live().layout().holdable_fields();
    if (!PyList_Check(hold.ptr()) || PyList_GET_SIZE(hold.ptr()) != static_cast<py::ssize_t>(holdable.size()))
      throw py::type_error("hold: expected None or a list, one entry per holdable field");
    std::vector<std::uint64_t> owners(n * holdable.size(), 0);
    for (std::size_t h = 0; h < holdable.size(); ++h) {
      PyObject* column = PyList_GET_ITEM(columns.ptr(), holdable[h]);
      PyObject* decided = PyList_GET_ITEM(hold.ptr(), h);
      if (PyList_Check(column) || single) {
        const bool each = PyList_Check(decided);
        if (each && PyList_GET_SIZE(decided) != static_cast<py::ssize_t>(n))
          throw py::value_error("hold: a list column's decisions must be one per row");
        for (std::size_t i = first; i < n; ++i) {
          if (!truthy(each ? PyList_GET_ITEM(decided, i) : decided)) continue;
          PyObject* item = single ? column : PyList_GET_ITEM(column, i);
          owners[i * holdable.size() + h] = holdings_.hold(item, 1, true);
        }
        continue;
      }
      if (!truthy(decided)) continue;
      const bool source = PyTuple_Check(column);
      PyObject* owner = source ? PyTuple_GET_ITEM(column, 0) : column;
      const std::uint64_t handle = holdings_.hold(owner, n - first, !source);
      for (std::size_t i = first; i < n; ++i) owners[i * holdable.size() + h] = handle;
    }
    return owners;
  }

  static bool truthy(PyObject* value) {
    const int result = PyObject_IsTrue(value);
    if (result < 0) throw py::error_already_set();
    return result == 1;
  }

  // Gives back the holds of rows [done, n): those the put did not store.
  void give_back_holds(const std::vector<std::uint64_t>& owners, std::size_t n, std::size_t done) {
    if (owners.empty()) return;
    const std::size_t per_row = owners.size() / n;
    for (std::size_t i = done * per_row; i < owners.size(); ++i)
      if (owners[i] != 0) holdings_.release(owners[i]);
  }

  static const std::uint64_t* held_or_null(const std::vector<std::uint64_t>& owners) {
    return owners.empty() ? nullptr : owners.data();
  }

  // One array per field over the batch block of `lease`, whose Python owner is
  // every array's base: the block returns to the pool when the last one dies.
  // A ragged field gives (values, offsets): its packed rows, over the lease's
  // value block, and rows + 1 int64 offsets into them.
  py::tuple batch_arrays(const std::shared_ptr<BatchPool::Lease>& lease, std::size_t rows) const {
    py::object owner = py::cast(lease);
    const ExampleLayout& layout = live().layout();
    py::tuple arrays(specs_.size());
    for (std::size_t f = 0, r = 0; f < specs_.size(); ++f) {
      std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(rows)};
      std::byte* data = lease->data() + layout.batch_offset(f);
      if (specs_[f].ragged) {
        const std::int64_t total = layout.offsets(lease->data(), f)[rows];
        std::byte* values = lease->values(r++);
        shape[0] = static_cast<py::ssize_t>(total);
        shape.insert(shape.end(), specs_[f].shape.begin(), specs_[f].shape.end());
        // No value block when every row is empty: the array has no bytes to view.
        py::array packed(specs_[f].dtype, shape, values != nullptr ? values : data, owner);
        py::array offsets(py::dtype::of<std::int64_t>(), {static_cast<py::ssize_t>(rows + 1)}, data, owner);
        arrays[f] = py::make_tuple(packed, offsets);
        continue;
      }
      shape.insert(shape.end(), specs_[f].shape.begin(), specs_[f].shape.end());
      arrays[f] = py::array(specs_[f].dtype, shape, data, owner);
    }
    return arrays;
  }

  static const void* PyArray_DATA_of(py::handle array) {
    return py::reinterpret_borrow<py::array>(array).data();
  }

  // Releases a block's owner. Blocks die with the pool, normally under the GIL
  // (a batch's arrays or the buffer being deallocated); at interpreter exit the
  // reference is left alone rather than touch a finalizing interpreter. GIL: taken
  // here (PyGILState_Ensure) whether or not the caller holds it, so that the decref
  // is safe on whichever thread drops the last lease.
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
  // GIL: next() writes these and the last_* getters read them; the GIL keeps the
  // two apart when different Python threads call them (the loader calls both on one).
  std::vector<std::uint64_t> last_seqs_;
  std::vector<std::uint64_t> last_released_;
  Holdings holdings_;                    // after core_ is gone: nothing reads held values then
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
      .def("put", &PyBuffer::put, py::arg("arrays"), py::arg("timeout_s"), py::arg("seq") = 0,
           py::arg("hold") = py::none())
      .def("put_many", &PyBuffer::put_many, py::arg("arrays"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0, py::arg("hold") = py::none())
      .def("next", &PyBuffer::next, py::arg("timeout_s"))
      .def_property_readonly("last_seqs", &PyBuffer::last_seqs)
      .def_property_readonly("last_released", &PyBuffer::last_released)
      .def("copy_batch", &PyBuffer::copy_batch, py::arg("arrays"), py::arg("rows"))
      .def("snapshot", &PyBuffer::snapshot, py::arg("timeout_s"))
      .def("close", [](PyBuffer& b) { b.core().close(); })
      .def("stop", [](PyBuffer& b) { b.core().stop(); })  // quick: flags and wake-ups only
      .def("stats", [](const PyBuffer& b) { return b.core().stats(); })
      .def("put_each", &PyBuffer::put_each, py::arg("columns"), py::arg("rows"), py::arg("timeout_s"),
           py::arg("first_seq") = 0, py::arg("done") = 0, py::arg("hold") = py::none())
      .def("put_into", &PyBuffer::put_into, py::arg("rows"), py::arg("first_seq"), py::arg("write"),
           py::arg("timeout_s"), py::arg("done") = 0)
      .def_property_readonly("held_values", [](const PyBuffer& b) { return b.holdings().values(); })
      .def_property_readonly("held_owners", [](const PyBuffer& b) { return b.holdings().owners(); })
      .def_property_readonly("holdable_fields",
                             [](const PyBuffer& b) { return b.core().layout().holdable_fields(); })
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
      .def_property_readonly("region_bytes",
                             [](const PyBuffer& b) {
                               const auto& c = b.core().config();
                               return RegionLayout(b.core().layout(), c.capacity, {c.pages, c.page_bytes}).total_bytes;
                             })
      .def_property_readonly("batch_blocks_adopted",
                             [](const PyBuffer& b) { return b.core().batch_blocks_adopted(); });
}

}  // namespace dataecho::py_binding
