// Record (records.h): the native runtime's one reader of Python objects' fields.
#include "records.h"

#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

py::object Record::get(const char* name) const {
  TORCH_CHECK(py::hasattr(object_, name), "rfa decode program: ", path_, " has no field '", name, "'");
  return object_.attr(name);
}

bool Record::has(const char* name) const { return py::hasattr(object_, name) && !object_.attr(name).is_none(); }

Record Record::sub(const char* name) const {
  py::object value = get(name);
  TORCH_CHECK(!value.is_none(), "rfa decode program: ", path_, ".", name, " is None");
  return Record(value, path_ + "." + name);
}

std::optional<Record> Record::optional_sub(const char* name) const {
  if (!has(name)) return std::nullopt;
  return sub(name);
}

at::Tensor Record::tensor(const char* name) const {
  at::Tensor t = optional_tensor(name);
  TORCH_CHECK(t.defined(), "rfa decode program: ", path_, ".", name, " is None, a tensor is needed");
  return t;
}

namespace {

at::Tensor tensor_of(py::handle value, const std::string& name) {
  TORCH_CHECK(THPVariable_Check(value.ptr()), "rfa decode program: ", name, " is not a tensor");
  return THPVariable_Unpack(value.ptr());
}

}  // namespace

at::Tensor Record::optional_tensor(const char* name) const {
  py::object value = get(name);
  return value.is_none() ? at::Tensor() : tensor_of(value, path_ + "." + name);
}

std::vector<at::Tensor> Record::tensors(const char* name) const {
  std::vector<at::Tensor> out;
  for (py::handle item : get(name)) out.push_back(tensor_of(item, path_ + "." + name + "[" + std::to_string(out.size()) + "]"));
  return out;
}

int64_t Record::integer(const char* name) const { return get(name).cast<int64_t>(); }
double Record::number(const char* name) const { return get(name).cast<double>(); }
bool Record::flag(const char* name) const { return get(name).cast<bool>(); }
std::string Record::text(const char* name) const { return get(name).cast<std::string>(); }

std::vector<Record> Record::items(const char* name) const {
  py::object value = get(name);
  std::vector<Record> out;
  int64_t i = 0;
  for (py::handle item : value) out.emplace_back(item, path_ + "." + name + "[" + std::to_string(i++) + "]");
  return out;
}

int64_t code_of(const std::map<std::string, int64_t>& codes, const std::string& name, const std::string& what) {
  auto found = codes.find(name);
  if (found != codes.end()) return found->second;
  std::string known;
  for (const auto& entry : codes) known += (known.empty() ? "" : ", ") + entry.first;
  TORCH_CHECK(false, "rfa native runtime: ", what, " '", name, "' has no native step (it knows ", known, ")");
}
