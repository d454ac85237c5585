// The native runtime reads Python objects by field name (the records of rfa_fairseq/modules/decoding.py and
// encoding.py, the caches and the static beam search's buffers): one reader, Record, whose errors name the field's
// path. Nothing here writes to Python.
#pragma once
#include <pybind11/pybind11.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

// A Python object's fields read by name; `path` names it in errors (e.g. "runtime.layers[1].self_attn").
class Record {
 public:
  Record(pybind11::handle object, std::string path)
      : object_(pybind11::reinterpret_borrow<pybind11::object>(object)), path_(std::move(path)) {}
  bool has(const char* name) const;   // the field exists and is not None
  Record sub(const char* name) const;  // a field that is itself a record (not None)
  std::optional<Record> optional_sub(const char* name) const;
  at::Tensor tensor(const char* name) const;            // a tensor field (not None)
  at::Tensor optional_tensor(const char* name) const;   // a tensor field or None (undefined)
  int64_t integer(const char* name) const;
  double number(const char* name) const;
  bool flag(const char* name) const;
  std::string text(const char* name) const;
  std::vector<Record> items(const char* name) const;    // a list or tuple field, one record per item
  std::vector<at::Tensor> tensors(const char* name) const;  // a list or tuple of tensors
  pybind11::handle object() const { return object_; }
  const std::string& path() const { return path_; }

 private:
  pybind11::object get(const char* name) const;
  pybind11::object object_;
  std::string path_;
};

// the code `codes` gives a record's text field, or an error naming the record's field and the codes it may have
int64_t code_of(const std::map<std::string, int64_t>& codes, const std::string& name, const std::string& what);

// an optional tensor argument (None: undefined)
inline at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
