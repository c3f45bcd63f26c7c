// Field declarations and the arrays a put hands over: conversion and the
// memory-safety checks shared by _core.Buffer and _core.Producer.
//
// A field declared with -1 as its first dimension is ragged: each example has
// its own number of rows of the remaining shape (see layout.hpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dataecho/layout.hpp"
#include "dataecho/producer.hpp"

namespace dataecho::py_binding {

namespace py = pybind11;

using FieldDecl = std::pair<std::vector<py::ssize_t>, py::dtype>;

struct FieldSpec {
  py::dtype dtype;
  std::vector<py::ssize_t> shape;  // a ragged field's row shape (without its first axis)
  std::size_t bytes;               // per example, or per row of a ragged field
  bool ragged;
};

// NumPy's NPY_ITEM_HASOBJECT descriptor flag: the dtype's items are (or hold)
// PyObject pointers. The core copies bytes and takes no reference, so such a
// value, copied in, would point at objects that may be freed before it is read.
constexpr std::uint64_t kItemHasObject = 0x01;

inline bool holds_objects(const py::dtype& dtype) { return (dtype.flags() & kItemHasObject) != 0; }

// Raises TypeError if `dtype` holds Python objects; `name()` names its field
// (made only then: puts check every array they are handed).
template <typename Name>
void refuse_objects(const py::dtype& dtype, const Name& name) {
  if (holds_objects(dtype))
    throw py::type_error(name() + ": dtype " + py::str(dtype).cast<std::string>() +
                         " holds Python objects, which are not copied as bytes; expected a fixed-size dtype");
}

// Field declarations -> specs, with sizes checked against overflow.
inline std::vector<FieldSpec> field_specs(const std::vector<FieldDecl>& fields) {
  if (fields.empty()) throw py::value_error("fields: expected at least one field");
  std::vector<FieldSpec> specs;
  for (std::size_t f = 0; f < fields.size(); ++f) {
    const auto& [declared, dtype] = fields[f];
    refuse_objects(dtype, [f] { return "fields[" + std::to_string(f) + "]"; });
    const bool ragged = !declared.empty() && declared[0] == -1;
    std::vector<py::ssize_t> shape(declared.begin() + (ragged ? 1 : 0), declared.end());
    std::size_t n = static_cast<std::size_t>(dtype.itemsize());
    for (py::ssize_t d : shape) {
      if (d <= 0) throw py::value_error("fields: dimensions must be positive (-1 first: ragged)");
      if (n > SIZE_MAX / static_cast<std::size_t>(d)) throw py::value_error("fields: size overflows");
      n *= static_cast<std::size_t>(d);
    }
    if (n == 0) throw py::value_error("fields: zero-size field");
    specs.push_back({dtype, shape, n, ragged});
  }
  return specs;
}

inline ExampleLayout example_layout(const std::vector<FieldSpec>& specs, std::size_t batch_size,
                                    std::size_t hold_min_bytes = 0) {
  std::vector<std::size_t> bytes;
  std::vector<bool> ragged;
  for (const FieldSpec& spec : specs) {
    bytes.push_back(spec.bytes);
    ragged.push_back(spec.ragged);
  }
  return ExampleLayout(std::move(bytes), batch_size, std::move(ragged), hold_min_bytes);
}

inline std::size_t ragged_count(const std::vector<FieldSpec>& specs) {
  std::size_t n = 0;
  for (const FieldSpec& spec : specs) n += spec.ragged ? 1 : 0;
  return n;
}

// What a put hands the core: a pointer per (row, field), row-major, and the
// row count per (row, ragged field).
struct Rows {
  std::vector<const void*> pointers;
  std::vector<std::uint64_t> lengths;
};

// Checks that every example of `rows` (n of them) fits the producer's page
// heap, before anything is put: a put stores all of its rows or fails whole.
inline void check_fit(const Producer& producer, const Rows& rows, std::size_t n, std::size_t ragged) {
  for (std::size_t i = 0; i < n && ragged > 0; ++i) {
    if (producer.fits(rows.lengths.data() + i * ragged)) continue;
    const PageHeap& heap = producer.region().heap;
    std::size_t bytes = 0;
    for (std::size_t r = 0; r < ragged; ++r)
      bytes += static_cast<std::size_t>(rows.lengths[i * ragged + r]) *
               producer.layout().field_bytes(producer.layout().ragged_fields()[r]);
    throw py::value_error("example " + std::to_string(i) + ": its ragged values take " + std::to_string(bytes) +
                          " bytes, more than the whole memory budget for them (ragged_bytes: " +
                          std::to_string(heap.pages() * heap.page_bytes()) + " bytes in pages of " +
                          std::to_string(heap.page_bytes()) + "); raise ragged_bytes");
  }
}

// The data of `item` after checking that it is a C-contiguous array of
// exactly `bytes` bytes, or of `rows` such rows stacked along its first axis;
// errors name it as `<kind> <field>` ("example: field 2", "column 0").
inline const void* checked_data(py::handle item, std::size_t bytes, std::optional<std::size_t> rows,
                                const char* kind, std::size_t field) {
  const auto name = [&] { return std::string(kind) + " " + std::to_string(field); };
  if (!py::isinstance<py::array>(item)) throw py::type_error(name() + " is not an array");
  const auto a = py::reinterpret_borrow<py::array>(item);
  refuse_objects(a.dtype(), name);
  if (!(a.flags() & py::array::c_style) || static_cast<std::size_t>(a.nbytes()) != bytes * rows.value_or(1) ||
      (rows && (a.ndim() < 1 || static_cast<std::size_t>(a.shape(0)) != *rows)))
    throw py::value_error(name() + " is not C-contiguous of the declared size");
  return a.data();
}

// A ragged field's value for one example: a C-contiguous array of whole rows
// of `row` bytes; returns its data and sets `rows`.
inline const void* ragged_data(py::handle item, std::size_t row, std::uint64_t& rows, const char* kind,
                               std::size_t field) {
  const auto name = [&] { return std::string(kind) + " " + std::to_string(field); };
  if (!py::isinstance<py::array>(item)) throw py::type_error(name() + " is not an array");
  const auto a = py::reinterpret_borrow<py::array>(item);
  refuse_objects(a.dtype(), name);
  const auto nbytes = static_cast<std::size_t>(a.nbytes());
  if (!(a.flags() & py::array::c_style) || a.ndim() < 1 || nbytes % row != 0 ||
      nbytes / row != static_cast<std::size_t>(a.shape(0)))
    throw py::value_error(name() + " is not C-contiguous rows of the declared shape");
  rows = nbytes / row;
  return a.data();
}

// One pointer per field of `arrays` (a list), each checked by checked_data
// (`rows` for stacked arrays; not with ragged fields), with each ragged
// field's row count. The temporaries it makes are gone when it returns, so the
// caller's frame holds only borrowed references (see blocking.hpp).
inline Rows field_pointers(const std::vector<FieldSpec>& specs, py::handle arrays, std::optional<std::size_t> rows) {
  if (!PyList_Check(arrays.ptr())) throw py::type_error("arrays: expected a list of arrays, one per field");
  const auto items = py::reinterpret_borrow<py::list>(arrays);
  if (items.size() != specs.size())
    throw py::value_error("example: expected " + std::to_string(specs.size()) + " fields, got " +
                          std::to_string(items.size()));
  if (rows && ragged_count(specs) != 0) throw py::value_error("arrays: stacked puts take no ragged field");
  Rows out;
  out.pointers.reserve(items.size());
  for (std::size_t f = 0; f < items.size(); ++f) {
    if (specs[f].ragged) {
      out.lengths.push_back(0);
      out.pointers.push_back(ragged_data(items[f], specs[f].bytes, out.lengths.back(), "example: field", f));
    } else {
      out.pointers.push_back(checked_data(items[f], specs[f].bytes, rows, "example: field", f));
    }
  }
  return out;
}

// Whether `a` holds exactly one value of `spec` (its dtype and shape, any
// number of rows for a ragged field), C-contiguous.
inline bool matches(const FieldSpec& spec, const py::array& a) {
  const std::size_t lead = spec.ragged ? 1 : 0;
  if (!(a.flags() & py::array::c_style) || a.ndim() != static_cast<py::ssize_t>(spec.shape.size() + lead)) return false;
  for (std::size_t d = 0; d < spec.shape.size(); ++d)
    if (a.shape(static_cast<py::ssize_t>(d + lead)) != spec.shape[d]) return false;
  return a.dtype().equal(spec.dtype);
}

// How many leading items of `values` (a list) are arrays that match `spec`
// exactly: those can be put as they are. GIL: the items are borrowed, valid only
// while no other thread can change the list, which the GIL held here ensures.
inline std::size_t exact_rows(const FieldSpec& spec, py::handle values) {
  if (!PyList_Check(values.ptr())) throw py::type_error("values: expected a list");
  const auto items = py::reinterpret_borrow<py::list>(values);
  std::size_t i = 0;
  for (; i < items.size(); ++i) {
    py::handle item = items[i];
    if (!py::isinstance<py::array>(item) || !matches(spec, py::reinterpret_borrow<py::array>(item))) break;
  }
  return i;
}

// Row pointers of one column given as (array, indices): row `indices[i]` of an
// array whose rows are C-contiguous and `bytes` long, each index in bounds.
inline void gathered_rows(py::handle column, std::size_t bytes, std::size_t n, std::size_t field,
                          std::size_t fields, std::vector<const void*>& out) {
  const auto pair = py::reinterpret_borrow<py::tuple>(column);
  if (pair.size() != 2 || !py::isinstance<py::array>(pair[0]) ||
      !py::isinstance<py::array_t<std::int64_t>>(pair[1]))
    throw py::type_error("column " + std::to_string(field) + ": expected (array, int64 indices)");
  const auto source = py::reinterpret_borrow<py::array>(pair[0]);
  const auto indices = py::reinterpret_borrow<py::array_t<std::int64_t>>(pair[1]);
  refuse_objects(source.dtype(), [field] { return "column " + std::to_string(field); });
  if (indices.ndim() != 1 || static_cast<std::size_t>(indices.shape(0)) != n || !(indices.flags() & py::array::c_style))
    throw py::value_error("column " + std::to_string(field) + ": expected " + std::to_string(n) + " indices");
  // The rows' own bytes must be C-contiguous; the rows may be strided.
  std::size_t row = static_cast<std::size_t>(source.itemsize());
  for (py::ssize_t d = source.ndim() - 1; d >= 1; --d) {
    if (source.shape(d) != 1 && source.strides(d) != static_cast<py::ssize_t>(row))
      throw py::value_error("column " + std::to_string(field) + ": rows are not C-contiguous");
    row *= static_cast<std::size_t>(source.shape(d));
  }
  if (source.ndim() < 1 || row != bytes)
    throw py::value_error("column " + std::to_string(field) + ": rows are not of the declared size");
  const auto* base = static_cast<const std::byte*>(source.data());
  const std::int64_t length = source.shape(0);
  const std::int64_t* index = indices.data();
  for (std::size_t i = 0; i < n; ++i) {
    if (index[i] < 0 || index[i] >= length)
      throw py::index_error("column " + std::to_string(field) + ": index " + std::to_string(index[i]) +
                            " out of range for " + std::to_string(length) + " rows");
    out[i * fields + field] = base + index[i] * source.strides(0);
  }
}

// A ragged column given packed, as (values, offsets): row i is rows
// [offsets[i], offsets[i + 1]) of `values`, a C-contiguous array of rows of
// `row` bytes; offsets are n + 1 non-decreasing int64 within it.
inline void packed_rows(py::handle column, std::size_t row, std::size_t n, std::size_t field, std::size_t fields,
                        std::size_t r, std::size_t ragged, Rows& out) {
  const auto name = "column " + std::to_string(field);
  const auto pair = py::reinterpret_borrow<py::tuple>(column);
  if (pair.size() != 2 || !py::isinstance<py::array>(pair[0]) || !py::isinstance<py::array_t<std::int64_t>>(pair[1]))
    throw py::type_error(name + ": expected (values, int64 offsets)");
  const auto values = py::reinterpret_borrow<py::array>(pair[0]);
  const auto offsets = py::reinterpret_borrow<py::array_t<std::int64_t>>(pair[1]);
  refuse_objects(values.dtype(), [&name] { return name; });
  if (offsets.ndim() != 1 || static_cast<std::size_t>(offsets.shape(0)) != n + 1 ||
      !(offsets.flags() & py::array::c_style))
    throw py::value_error(name + ": expected " + std::to_string(n + 1) + " offsets");
  const auto nbytes = static_cast<std::size_t>(values.nbytes());
  if (!(values.flags() & py::array::c_style) || nbytes % row != 0)
    throw py::value_error(name + ": values are not C-contiguous rows of the declared shape");
  const std::int64_t* at = offsets.data();
  const auto* base = static_cast<const std::byte*>(values.data());
  for (std::size_t i = 0; i < n; ++i) {
    if (at[i] < 0 || at[i + 1] < at[i] || static_cast<std::size_t>(at[i + 1]) > nbytes / row)
      throw py::value_error(name + ": offsets are not non-decreasing within the values");
    out.pointers[i * fields + field] = base + static_cast<std::size_t>(at[i]) * row;
    out.lengths[i * ragged + r] = static_cast<std::uint64_t>(at[i + 1] - at[i]);
  }
}

// One pointer per field per row for Producer::put_each, row-major, from
// `columns` (a list, one entry per field), each entry either a C-contiguous
// array of n stacked rows, a list of n C-contiguous arrays of the field's byte
// count, or (array, indices) (see `gathered_rows`); a ragged field's entry is
// a list of n arrays of whole rows, or (values, offsets) (see `packed_rows`).
// Borrowed, as field_pointers: the caller's objects keep every array alive.
inline Rows row_pointers(const std::vector<FieldSpec>& specs, py::handle columns, std::size_t n) {
  if (!PyList_Check(columns.ptr())) throw py::type_error("columns: expected a list, one entry per field");
  const auto items = py::reinterpret_borrow<py::list>(columns);
  const std::size_t fields = specs.size();
  if (items.size() != fields)
    throw py::value_error("columns: expected " + std::to_string(fields) + " fields, got " +
                          std::to_string(items.size()));
  const std::size_t ragged = ragged_count(specs);
  Rows out;
  out.pointers.resize(n * fields);
  out.lengths.resize(n * ragged);
  std::vector<const void*>& rows = out.pointers;
  for (std::size_t f = 0, r = 0; f < fields; ++f) {
    py::handle column = items[f];
    if (specs[f].ragged) {
      if (PyTuple_Check(column.ptr())) {
        packed_rows(column, specs[f].bytes, n, f, fields, r, ragged, out);
      } else {
        if (!PyList_Check(column.ptr()) || PyList_GET_SIZE(column.ptr()) != static_cast<py::ssize_t>(n))
          throw py::value_error("column " + std::to_string(f) + ": expected a list of " + std::to_string(n) +
                                " arrays, or (values, offsets)");
        for (std::size_t i = 0; i < n; ++i)
          rows[i * fields + f] = ragged_data(PyList_GET_ITEM(column.ptr(), i), specs[f].bytes,
                                             out.lengths[i * ragged + r], "column", f);
      }
      ++r;
      continue;
    }
    if (PyTuple_Check(column.ptr())) {
      gathered_rows(column, specs[f].bytes, n, f, fields, rows);
    } else if (PyList_Check(column.ptr())) {
      // Memory safety needs the byte count only: the caller converted the values.
      if (PyList_GET_SIZE(column.ptr()) != static_cast<py::ssize_t>(n))
        throw py::value_error("column " + std::to_string(f) + ": expected " + std::to_string(n) + " arrays");
      for (std::size_t i = 0; i < n; ++i)
        rows[i * fields + f] =
            checked_data(PyList_GET_ITEM(column.ptr(), i), specs[f].bytes, std::nullopt, "column", f);
    } else {
      const auto* base = static_cast<const std::byte*>(checked_data(column, specs[f].bytes, n, "column", f));
      for (std::size_t i = 0; i < n; ++i) rows[i * fields + f] = base + i * specs[f].bytes;
    }
  }
  return out;
}

}  // namespace dataecho::py_binding
