// Field declarations and the arrays a put hands over: conversion and the
// memory-safety checks shared by _core.Buffer and _core.Producer.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dataecho::py_binding {

namespace py = pybind11;

using FieldDecl = std::pair<std::vector<py::ssize_t>, py::dtype>;

struct FieldSpec {
  py::dtype dtype;
  std::vector<py::ssize_t> shape;
  std::size_t bytes;
};

// Field declarations -> specs, with sizes checked against overflow.
inline std::vector<FieldSpec> field_specs(const std::vector<FieldDecl>& fields) {
  if (fields.empty()) throw py::value_error("fields: expected at least one field");
  std::vector<FieldSpec> specs;
  for (const auto& [shape, dtype] : fields) {
    std::size_t n = static_cast<std::size_t>(dtype.itemsize());
    for (py::ssize_t d : shape) {
      if (d <= 0) throw py::value_error("fields: dimensions must be positive");
      if (n > SIZE_MAX / static_cast<std::size_t>(d)) throw py::value_error("fields: size overflows");
      n *= static_cast<std::size_t>(d);
    }
    if (n == 0) throw py::value_error("fields: zero-size field");
    specs.push_back({dtype, shape, n});
  }
  return specs;
}

inline std::vector<std::size_t> field_bytes(const std::vector<FieldSpec>& specs) {
  std::vector<std::size_t> bytes;
  for (const FieldSpec& spec : specs) bytes.push_back(spec.bytes);
  return bytes;
}

// The data of `item` after checking that it is a C-contiguous array of
// exactly `bytes` bytes, or of `rows` such rows stacked along its first axis;
// errors name it as `<kind> <field>` ("example: field 2", "column 0").
inline const void* checked_data(py::handle item, std::size_t bytes, std::optional<std::size_t> rows,
                                const char* kind, std::size_t field) {
  const auto name = [&] { return std::string(kind) + " " + std::to_string(field); };
  if (!py::isinstance<py::array>(item)) throw py::type_error(name() + " is not an array");
  const auto a = py::reinterpret_borrow<py::array>(item);
  if (!(a.flags() & py::array::c_style) || static_cast<std::size_t>(a.nbytes()) != bytes * rows.value_or(1) ||
      (rows && (a.ndim() < 1 || static_cast<std::size_t>(a.shape(0)) != *rows)))
    throw py::value_error(name() + " is not C-contiguous of the declared size");
  return a.data();
}

// One pointer per field of `arrays` (a list), each checked by checked_data
// (`rows` for stacked arrays). The temporaries it makes are gone when it
// returns, so the caller's frame holds only borrowed references (see blocking.hpp).
inline std::vector<const void*> field_pointers(const std::vector<FieldSpec>& specs, py::handle arrays,
                                               std::optional<std::size_t> rows) {
  if (!PyList_Check(arrays.ptr())) throw py::type_error("arrays: expected a list of arrays, one per field");
  const auto items = py::reinterpret_borrow<py::list>(arrays);
  if (items.size() != specs.size())
    throw py::value_error("example: expected " + std::to_string(specs.size()) + " fields, got " +
                          std::to_string(items.size()));
  std::vector<const void*> pointers;
  pointers.reserve(items.size());
  for (std::size_t f = 0; f < items.size(); ++f)
    pointers.push_back(checked_data(items[f], specs[f].bytes, rows, "example: field", f));
  return pointers;
}

// Whether `a` holds exactly one value of `spec` (its dtype and shape), C-contiguous.
inline bool matches(const FieldSpec& spec, const py::array& a) {
  if (!(a.flags() & py::array::c_style) || a.ndim() != static_cast<py::ssize_t>(spec.shape.size())) return false;
  for (std::size_t d = 0; d < spec.shape.size(); ++d)
    if (a.shape(static_cast<py::ssize_t>(d)) != spec.shape[d]) return false;
  return a.dtype().equal(spec.dtype);
}

// How many leading items of `values` (a list) are arrays that match `spec`
// exactly: those can be put as they are.
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

// One pointer per field per row for Producer::put_each, row-major, from
// `columns` (a list, one entry per field), each entry either a C-contiguous
// array of n stacked rows, a list of n C-contiguous arrays of the field's byte
// count, or (array, indices) (see `gathered_rows`). Borrowed, as
// field_pointers: the caller's objects keep every array alive.
inline std::vector<const void*> row_pointers(const std::vector<FieldSpec>& specs, py::handle columns, std::size_t n) {
  if (!PyList_Check(columns.ptr())) throw py::type_error("columns: expected a list, one entry per field");
  const auto items = py::reinterpret_borrow<py::list>(columns);
  const std::size_t fields = specs.size();
  if (items.size() != fields)
    throw py::value_error("columns: expected " + std::to_string(fields) + " fields, got " +
                          std::to_string(items.size()));
  std::vector<const void*> rows(n * fields);
  for (std::size_t f = 0; f < fields; ++f) {
    py::handle column = items[f];
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
  return rows;
}

}  // namespace dataecho::py_binding
