// The checks the decoder's program and the native search make of every tensor they take a pointer of, with the GIL
// held, before they release it: an error names the tensor (decode_program.cpp, native_search.cpp).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

// `t` is a CPU tensor of `dtype`, contiguous (or with unit last stride), of `sizes` (-1: any; `at_least`: the first
// size may be larger) -> or a RuntimeError naming it
inline void expect(const at::Tensor& t, const std::string& name, at::ScalarType dtype, std::vector<int64_t> sizes,
                   bool at_least = false, bool contiguous = true) {
  TORCH_CHECK(t.defined(), "rfa decode program: ", name, " is missing");
  TORCH_CHECK(t.device().is_cpu(), "rfa decode program: ", name, " is on ", t.device(), ", not the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, "rfa decode program: ", name, " is ", t.scalar_type(), ", not ", dtype);
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  for (size_t i = 0; ok && i < sizes.size(); ++i) {
    ok = sizes[i] < 0 || t.size(i) == sizes[i] || (i == 0 && at_least && t.size(0) >= sizes[0]);
  }
  TORCH_CHECK(ok, "rfa decode program: ", name, " has shape ", t.sizes(), ", expected ", c10::IntArrayRef(sizes),
              at_least ? " (first size or more)" : "", " (-1: any)");
  TORCH_CHECK(contiguous ? t.is_contiguous() : t.stride(-1) == 1, "rfa decode program: ", name,
              contiguous ? " is not contiguous" : " has no unit last stride");
}

// `t` holds `rows` (or more) int64 indices, each a row of `bound`
inline void expect_indices(const at::Tensor& t, const std::string& name, int64_t rows, int64_t bound) {
  expect(t, name, at::kLong, {rows}, true);
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(p[r] >= 0 && p[r] < bound, "rfa decode program: ", name, "[", r, "] = ", p[r], " is not a row of ",
                bound);
  }
}
