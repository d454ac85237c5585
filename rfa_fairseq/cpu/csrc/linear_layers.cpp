// The native runtime's linear layers (linear_layers.h): the weights' packing into the level's blocks (the one copy the
// runtime keeps), the products' checked calls (the kernels themselves are the level's, levels/level_kernels.cpp) and
// their split over the threads. References (tests/test_cpu_levels.py): torch's products on the same weights (fp32) and
// on the same codes (int8: exact integer sums).
#include "linear_layers.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <pybind11/stl.h>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "step_kernels.h"

namespace py = pybind11;
using rfa::cpu::kInt8Group;
using rfa::cpu::kInt8RowZeroPoint;

namespace {

// t with unit stride along its rows (the kernels read rows), or undefined
at::Tensor rows_of(const at::Tensor& t) { return !t.defined() || t.stride(1) == 1 ? t : t.contiguous(); }

int64_t blocks_for(int64_t out_features, int64_t block) { return (out_features + block - 1) / block; }

rfa::cpu::LinearOutput output_of(const at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual, bool relu) {
  return rfa::cpu::LinearOutput{bias.defined() ? bias.data_ptr<float>() : nullptr,
                                residual.defined() ? residual.data_ptr<float>() : nullptr,
                                residual.defined() ? residual.stride(0) : 0,
                                y.data_ptr<float>(),
                                y.stride(0),
                                y.size(1),
                                relu};
}

void check_output(const char* who, int64_t R, int64_t O, const at::Tensor& bias, const at::Tensor& residual,
                  const at::Tensor& y) {
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == O && bias.is_contiguous()),
              who, ": bias must hold ", O, " contiguous fp32 values");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == R && y.size(1) == O && y.stride(1) == 1,
              who, ": y must be (", R, ", ", O, ") fp32 rows");
  TORCH_CHECK(!residual.defined() || (residual.scalar_type() == at::kFloat && residual.dim() == 2 &&
                                      residual.size(0) == R && residual.size(1) == O && residual.stride(1) == 1),
              who, ": residual must be (", R, ", ", O, ") fp32 rows");
}

// The output blocks of an R x I -> O product split over the threads, each a run of whole tiles: one thread where the
// product is small (~256 K multiply-adds a thread or fewer: a team costs more than it saves), else equal shares.
template <class Run>
void for_each_share(const rfa::cpu::Kernels& kernels, int64_t R, int64_t I, int64_t blocks, const Run& run) {
  constexpr int64_t kWorkPerThread = int64_t{1} << 18;
  const int64_t tile = kernels.tile_blocks(R);
  const int64_t tiles = (blocks + tile - 1) / tile;
  const int64_t work = R * I * blocks * kernels.block;
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), tiles, std::max<int64_t>(1, work / kWorkPerThread)});
  if (threads <= 1) {
    run(0, blocks);
    return;
  }
  const int64_t per_thread = (tiles + threads - 1) / threads * tile;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * per_thread, b1 = std::min(blocks, b0 + per_thread);
      if (b0 < b1) run(b0, b1);
    }
  });
}

// Gives the pages of [p, p + bytes) back to the system where it can (Linux 5.4+: MADV_PAGEOUT drops a page of a file's
// mapping that was only read, and keeps one that was written; elsewhere nothing)
void release_pages(const void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
  static const int64_t page = sysconf(_SC_PAGESIZE);
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);
#else
  (void)p;
  (void)bytes;
#endif
}

// the output channels packed per chunk: whole blocks, about a megabyte of the source (its pages released per chunk)
int64_t chunk_channels(int64_t in_features, int64_t element_size, int64_t block) {
  const int64_t channels = (int64_t{1} << 20) / std::max<int64_t>(1, in_features * element_size);
  return std::max<int64_t>(1, channels / block) * block;
}

void check_weight(const at::Tensor& weight, const char* who) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu() &&
                  weight.stride(1) == 1,
              who, ": the weight must be a 2-d fp32 CPU tensor with contiguous rows, got ", weight.sizes(), " ",
              weight.scalar_type());
}

}  // namespace

LinearLayer LinearLayer::from(const Record& r) {
  LinearLayer layer;
  layer.weight = r.tensor("weight");
  layer.bias = r.optional_tensor("bias");
  layer.w_scales = r.optional_tensor("w_scales");
  layer.w_sums = r.optional_tensor("w_sums");
  layer.in_features = r.integer("in_features");
  layer.out_features = r.integer("out_features");
  TORCH_CHECK(!layer.bias.defined() || (layer.bias.numel() == layer.out_features && layer.bias.is_contiguous()),
              "rfa linear layer: ", r.path(), ".bias must hold out_features (", layer.out_features, ") values");
  return layer;
}

LinearLibrary::LinearLibrary(const std::string& precision, const std::string& cpu_isa) {
  precision_ = static_cast<Precision>(
      code_of({{"fp32", kPrecisionFp32}, {"int8", kPrecisionInt8}}, precision, "linear layers' precision"));
  try {
    kernels_ = &rfa::cpu::kernels(rfa::cpu::resolve_level(cpu_isa));
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, "--rfa-cpu-isa: ", error.what());
  }
}

// ------------------------------------------------------------------------------------------------ packing

at::Tensor LinearLibrary::pack_fp32(const at::Tensor& weight, bool release_source) const {
  check_weight(weight, "rfa linear pack");
  const int64_t block = kernels_->block, O = weight.size(0), I = weight.size(1), blocks = blocks_for(O, block);
  at::Tensor packed = at::zeros({blocks, I, block}, weight.options().memory_format(at::MemoryFormat::Contiguous));
  const float* w = weight.data_ptr<float>();
  float* out = packed.data_ptr<float>();
  const int64_t ldw = weight.stride(0), step = chunk_channels(I, sizeof(float), block);
  for (int64_t o0 = 0; o0 < O; o0 += step) {
    const int64_t o1 = std::min(O, o0 + step);
    for (int64_t o = o0; o < o1; ++o) {
      float* dst = out + (o / block) * I * block + o % block;
      const float* src = w + o * ldw;
      for (int64_t i = 0; i < I; ++i) dst[i * block] = src[i];
    }
    if (release_source) release_pages(w + o0 * ldw, (o1 - o0) * ldw * static_cast<int64_t>(sizeof(float)));
  }
  return packed;
}

std::vector<at::Tensor> LinearLibrary::pack_int8(const at::Tensor& weight, bool release_source) const {
  check_weight(weight, "rfa int8 linear pack");
  const int64_t block = kernels_->block, O = weight.size(0), I = weight.size(1), blocks = blocks_for(O, block);
  const int64_t groups = (I + kInt8Group - 1) / kInt8Group;
  at::Tensor packed = at::zeros({blocks, groups, block, kInt8Group}, weight.options().dtype(at::kChar));
  at::Tensor sums = at::zeros({blocks * block}, weight.options().dtype(at::kInt));
  at::Tensor scales = at::empty({O}, weight.options());
  const float* w = weight.data_ptr<float>();
  int8_t* out = packed.data_ptr<int8_t>();
  int32_t* sp = sums.data_ptr<int32_t>();
  float* scale = scales.data_ptr<float>();
  const int64_t ldw = weight.stride(0), step = chunk_channels(I, sizeof(float), block);
  for (int64_t o0 = 0; o0 < O; o0 += step) {
    const int64_t o1 = std::min(O, o0 + step);
    for (int64_t o = o0; o < o1; ++o) {
      const float* src = w + o * ldw;
      float top = 0.0f;
      for (int64_t i = 0; i < I; ++i) top = std::max(top, std::fabs(src[i]));
      // the scale as torch computes (w.abs().amax(1) / 127.0).clamp_min(tiny), each code as torch.round(w / scale)
      const float s = std::max(top / 127.0f, std::numeric_limits<float>::min());
      scale[o] = s;
      int8_t* dst = out + (o / block) * groups * block * kInt8Group + (o % block) * kInt8Group;
      int32_t code_sum = 0;
      for (int64_t i = 0; i < I; ++i) {
        const float code = std::min(127.0f, std::max(-127.0f, std::nearbyint(src[i] / s)));
        dst[(i / kInt8Group) * block * kInt8Group + i % kInt8Group] = static_cast<int8_t>(code);
        code_sum += static_cast<int32_t>(code);
      }
      sp[o] = code_sum * static_cast<int32_t>(kInt8RowZeroPoint);
    }
    if (release_source) release_pages(w + o0 * ldw, (o1 - o0) * ldw * static_cast<int64_t>(sizeof(float)));
  }
  return {packed, sums, scales};
}

// ------------------------------------------------------------------------------------------------ a layer's outputs

LinearLayer LinearLibrary::select_outputs(const LinearLayer& layer, const at::Tensor& ids) const {
  const int64_t I = layer.in_features, O = layer.out_features, block = kernels_->block;
  check_blocks(layer, I);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu() && ids.is_contiguous() &&
                  ids.numel() >= 1,
              "rfa linear select_outputs: ids must be a non-empty (U,) contiguous int64 CPU tensor");
  const int64_t U = ids.numel(), blocks = blocks_for(U, block);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < U; ++j) {
    TORCH_CHECK(id[j] >= 0 && id[j] < O, "rfa linear select_outputs: ids[", j, "] = ", id[j], " is not one of the ",
                O, " outputs");
  }
  LinearLayer out;
  out.in_features = I;
  out.out_features = U;
  // per new block, its channels' inputs: a channel's values sit `block` apart in its old block (one per input row),
  // and land `block` apart in the new one; channels of the shortlist that share an old block read its lines once
  // from the cache
  if (precision_ == kPrecisionFp32) {
    out.weight = at::zeros({blocks, I, block}, layer.weight.options());
    const float* w = layer.weight.data_ptr<float>();
    float* dst = out.weight.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t lane = 0; lane < block && b * block + lane < U; ++lane) {
          const int64_t o = id[b * block + lane];
          const float* from = w + (o / block) * I * block + o % block;
          float* to = dst + b * I * block + lane;
          for (int64_t i = 0; i < I; ++i) to[i * block] = from[i * block];
        }
      }
    });
  } else {
    const int64_t groups = (I + kInt8Group - 1) / kInt8Group, stride = block * kInt8Group;
    out.weight = at::zeros({blocks, groups, block, kInt8Group}, layer.weight.options());
    out.w_sums = at::zeros({blocks * block}, layer.w_sums.options());
    out.w_scales = at::empty({U}, layer.w_scales.options());
    const int8_t* w = layer.weight.data_ptr<int8_t>();
    int8_t* dst = out.weight.data_ptr<int8_t>();
    const int32_t* sums = layer.w_sums.data_ptr<int32_t>();
    const float* scales = layer.w_scales.data_ptr<float>();
    int32_t* out_sums = out.w_sums.data_ptr<int32_t>();
    float* out_scales = out.w_scales.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t lane = 0; lane < block && b * block + lane < U; ++lane) {
          const int64_t j = b * block + lane, o = id[j];
          const int8_t* from = w + (o / block) * groups * stride + (o % block) * kInt8Group;
          int8_t* to = dst + b * groups * stride + lane * kInt8Group;
          for (int64_t g = 0; g < groups; ++g) std::copy(from + g * stride, from + g * stride + kInt8Group, to + g * stride);
          out_sums[j] = sums[o];
          out_scales[j] = scales[o];
        }
      }
    });
  }
  if (layer.bias.defined()) out.bias = layer.bias.index_select(0, ids).contiguous();
  return out;
}

// ------------------------------------------------------------------------------------------------ products

void LinearLibrary::check_blocks(const LinearLayer& layer, int64_t I) const {
  const at::Tensor& weight = layer.weight;
  const int64_t O = layer.out_features, block = kernels_->block;
  if (precision_ == kPrecisionFp32) {
    TORCH_CHECK(weight.defined() && weight.dim() == 3 && weight.scalar_type() == at::kFloat &&
                    weight.size(0) == blocks_for(O, block) && weight.size(1) == I && weight.size(2) == block &&
                    weight.is_contiguous(),
                "rfa linear fp32: the weight must be the ", kernels_->name, " level's blocks (pack_fp32) for ", I,
                " inputs and ", O, " outputs, got ", weight.defined() ? weight.sizes() : at::IntArrayRef{});
    return;
  }
  TORCH_CHECK(weight.defined() && weight.dim() == 4 && weight.scalar_type() == at::kChar &&
                  weight.size(0) == blocks_for(O, block) && weight.size(1) == (I + kInt8Group - 1) / kInt8Group &&
                  weight.size(2) == block && weight.is_contiguous(),
              "rfa linear int8: the weight must be the ", kernels_->name, " level's blocks (pack_int8) for ", I,
              " inputs and ", O, " outputs, got ", weight.defined() ? weight.sizes() : at::IntArrayRef{});
  const at::Tensor& sums = layer.w_sums;
  TORCH_CHECK(sums.defined() && sums.scalar_type() == at::kInt && sums.numel() == weight.size(0) * block &&
                  sums.is_contiguous(),
              "rfa linear int8: w_sums must be pack_int8's for the same blocks");
  TORCH_CHECK(layer.w_scales.defined() && layer.w_scales.scalar_type() == at::kFloat && layer.w_scales.numel() == O &&
                  layer.w_scales.is_contiguous(),
              "rfa linear int8: w_scales must hold ", O, " fp32 values");
}

void LinearLibrary::linear_fp32(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual, bool relu,
                                const at::Tensor& y) const {
  TORCH_CHECK(precision_ == kPrecisionFp32, "rfa linear fp32: this library's layers are int8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "rfa linear fp32: x must be fp32 CPU rows");
  const int64_t R = x.size(0), I = x.size(1), O = layer.out_features;
  check_blocks(layer, I);
  check_output("rfa linear fp32", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const float* xp = x.data_ptr<float>();
  const float* wp = layer.weight.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_share(k, R, I, layer.weight.size(0), [&](int64_t begin, int64_t end) {
    k.linear_fp32(xp, ldx, R, I, wp, out, begin, end);
  });
}

void LinearLibrary::linear_int8(const LinearLayer& layer, const at::Tensor& codes, const at::Tensor& row_scales,
                                const at::Tensor& residual, bool relu, const at::Tensor& y) const {
  TORCH_CHECK(precision_ == kPrecisionInt8, "rfa linear int8: this library's layers are fp32");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu() && codes.is_contiguous(),
              "rfa linear int8: codes must be contiguous uint8 CPU rows");
  const int64_t R = codes.size(0), I = codes.size(1), O = layer.out_features;
  check_blocks(layer, I);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == R && row_scales.is_contiguous(),
              "rfa linear int8: row_scales must hold ", R, " fp32 values");
  check_output("rfa linear int8", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const rfa::cpu::Int8Scales scales{layer.w_sums.data_ptr<int32_t>(), layer.w_scales.data_ptr<float>(),
                                    row_scales.data_ptr<float>()};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int8_t* wp = layer.weight.data_ptr<int8_t>();
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_share(k, R, I, layer.weight.size(0), [&](int64_t begin, int64_t end) {
    k.linear_int8(cp, R, I, wp, scales, out, begin, end);
  });
}

at::Tensor LinearLibrary::linear_int8_of(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual,
                                         bool relu, const at::Tensor& out_buffer) const {
  // every product quantizes its rows: into the calling thread's scratch, not two new tensors a product
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> row_scales;
  const int64_t R = x.size(0), I = x.size(1), O = layer.out_features;
  check_blocks(layer, I);
  codes.resize(static_cast<size_t>(R * I));
  row_scales.resize(static_cast<size_t>(R));
  quantize_rows(x.data_ptr<float>(), x.stride(0), R, I, codes.data(), row_scales.data(), *kernels_);
  at::Tensor y = out_buffer.defined() ? out_buffer : at::empty({R, O}, x.options());
  check_output("rfa linear int8", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const rfa::cpu::Int8Scales scales{layer.w_sums.data_ptr<int32_t>(), layer.w_scales.data_ptr<float>(),
                                    row_scales.data()};
  const uint8_t* cp = codes.data();
  const int8_t* wp = layer.weight.data_ptr<int8_t>();
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_share(k, R, I, layer.weight.size(0), [&](int64_t begin, int64_t end) {
    k.linear_int8(cp, R, I, wp, scales, out, begin, end);
  });
  return y;
}

at::Tensor LinearLibrary::linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                                 const char* part, const at::Tensor& out) const {
  RECORD_FUNCTION(part, std::vector<c10::IValue>());
  return unrecorded_linear(layer, x, relu, residual, out);
}

at::Tensor LinearLibrary::unrecorded_linear(const LinearLayer& layer, const at::Tensor& x, bool relu,
                                            const at::Tensor& residual, const at::Tensor& out) const {
  TORCH_CHECK(!out.defined() || (out.is_contiguous() && out.scalar_type() == at::kFloat),
              "rfa linear: the output buffer must be a contiguous fp32 tensor");
  if (precision_ == kPrecisionInt8) {
    return linear_int8_of(layer, x.is_contiguous() ? x : x.contiguous(), rows_of(residual), relu, out);
  }
  const at::Tensor input = rows_of(x);
  at::Tensor y = out.defined() ? out : at::empty({input.size(0), layer.out_features}, input.options());
  linear_fp32(layer, input, rows_of(residual), relu, y);
  return y;
}

// ------------------------------------------------------------------------------------------------ bindings

void bind_linear_layers(py::module_& m) {
  m.def(
      "release_pages",
      [](uintptr_t address, int64_t length) {
        py::gil_scoped_release release;
        release_pages(reinterpret_cast<const void*>(address), length);
      },
      py::arg("address"), py::arg("length"),
      "gives the whole pages of [address, address + length) back to the system (madvise MADV_PAGEOUT: a page of a "
      "file's mapping is dropped and read again from the file when touched; a written page is kept)");
  auto layer_of = [](const py::object& packed) { return LinearLayer::from(Record(packed, "packed")); };
  py::class_<LinearLibrary, std::shared_ptr<LinearLibrary>>(m, "LinearLibrary")
      .def(py::init<const std::string&, const std::string&>(), py::arg("precision"), py::arg("cpu_isa") = "auto")
      .def_property_readonly("level", [](const LinearLibrary& lib) { return std::string(lib.kernels().name); },
                             "the instruction-set level its kernels run on (cpu_kernels.h)")
      .def_property_readonly("block", [](const LinearLibrary& lib) { return lib.kernels().block; },
                             "output channels per block at that level")
      .def_property_readonly("precision",
                             [](const LinearLibrary& lib) { return lib.precision() == kPrecisionInt8 ? "int8" : "fp32"; })
      .def(
          "linear",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& x, bool relu,
                     const std::optional<at::Tensor>& residual) {
            const LinearLayer layer = layer_of(packed);
            TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat,
                        "rfa linear: x must be a 2-d fp32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
            py::gil_scoped_release release;
            return lib.unrecorded_linear(layer, x, relu, or_undefined(residual));
          },
          py::arg("packed"), py::arg("x"), py::arg("relu") = false, py::arg("residual") = py::none(),
          "act(x W^T + b) + residual on this library (linear_layers.h)")
      .def(
          "pack_fp32",
          [](const LinearLibrary& lib, const at::Tensor& weight, bool release_source) {
            py::gil_scoped_release release;
            return lib.pack_fp32(weight, release_source);
          },
          py::arg("weight"), py::arg("release_source") = false, "an fp32 weight (O, I) in the level's blocks")
      .def(
          "pack_int8",
          [](const LinearLibrary& lib, const at::Tensor& weight, bool release_source) {
            py::gil_scoped_release release;
            return lib.pack_int8(weight, release_source);
          },
          py::arg("weight"), py::arg("release_source") = false,
          "an fp32 weight (O, I) quantized per output channel -> [the codes' blocks, zero point x code sums, scales]")
      .def(
          "select_outputs",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& ids) {
            const LinearLayer layer = layer_of(packed);
            LinearLayer out;
            {
              py::gil_scoped_release release;
              out = lib.select_outputs(layer, ids);
            }
            auto maybe = [](const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
            return py::make_tuple(out.weight, maybe(out.bias), maybe(out.w_scales), maybe(out.w_sums));
          },
          py::arg("packed"), py::arg("ids"),
          "the output channels `ids` of a packed layer as a layer of their own (linear_layers.h) -> [its blocks, bias "
          "or None, int8 scales or None, int8 zero point x code sums or None]")
      .def(
          "linear_fp32",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, bool relu, const at::Tensor& y) {
            const LinearLayer layer = layer_of(packed);
            py::gil_scoped_release release;
            lib.linear_fp32(layer, x, or_undefined(residual), relu, y);
          },
          py::arg("packed"), py::arg("x"), py::arg("residual"), py::arg("relu"), py::arg("y"),
          "the fp32 product: y = act(x W^T + b) + residual on packed.weight's blocks")
      .def(
          "linear_int8",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& codes,
                     const at::Tensor& row_scales, const std::optional<at::Tensor>& residual, bool relu,
                     const at::Tensor& y) {
            const LinearLayer layer = layer_of(packed);
            py::gil_scoped_release release;
            lib.linear_int8(layer, codes, row_scales, or_undefined(residual), relu, y);
          },
          py::arg("packed"), py::arg("codes"), py::arg("row_scales"), py::arg("residual"), py::arg("relu"), py::arg("y"),
          "the int8 product from quantize_rows' codes on packed.weight's blocks and w_sums");
}
