// The native runtime's linear layers (linear_layers.h): the library's dispatch, the few-rows kernels' packing and their
// checked calls (the kernels themselves are the level's, levels/level_kernels.cpp), the timing that decides between
// them. References (tests/test_cpu_levels.py): oneDNN's products on the same weights (fp32) and the same codes (int8).
#include "linear_layers.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>
#include <pybind11/stl.h>

#include <chrono>
#include <limits>
#include <vector>

#include "step_kernels.h"

namespace py = pybind11;
using rfa::cpu::kInt8Group;
using rfa::cpu::kInt8RowZeroPoint;

namespace {

// a boxed call of one of torch's operators with these arguments -> its (one) output
template <class... Args>
at::Tensor call_operator(const c10::OperatorHandle& op, Args&&... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.emplace_back(std::forward<Args>(args)), ...);
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

c10::IValue optional_value(const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); }

c10::IValue empty_scalar_list() {
  return c10::IValue(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
}

// t with unit stride along its rows (the few-rows kernel reads rows), or undefined
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

// The output blocks of an R x I -> O product split over the threads in tasks of ~256 K multiply-adds or more (a
// step's small products stay on one thread: a team costs more), each task a run of whole tiles of 4 blocks.
template <class Run>
void for_each_task(int64_t R, int64_t I, int64_t blocks, int64_t block, const Run& run) {
  constexpr int64_t kTaskBlocks = 4;
  const int64_t tasks = (blocks + kTaskBlocks - 1) / kTaskBlocks;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, R * I * block * kTaskBlocks));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    run(begin * kTaskBlocks, std::min(blocks, end * kTaskBlocks));
  });
}

}  // namespace

LinearLayer LinearLayer::from(const Record& r) {
  LinearLayer layer;
  layer.weight = r.tensor("weight");
  layer.bias = r.optional_tensor("bias");
  layer.w_scales = r.optional_tensor("w_scales");
  layer.w_zero_points = r.optional_tensor("w_zero_points");
  layer.rows_weight = r.optional_tensor("rows_weight");
  layer.rows_sums = r.optional_tensor("rows_sums");
  layer.in_features = r.integer("in_features");
  layer.out_features = r.integer("out_features");
  TORCH_CHECK(!layer.bias.defined() || (layer.bias.numel() == layer.out_features && layer.bias.is_contiguous()),
              "rfa linear layer: ", r.path(), ".bias must hold out_features (", layer.out_features, ") values");
  return layer;
}

LinearLibrary::LinearLibrary(const std::string& gemm, const py::dict& operators, const std::string& cpu_isa) {
  gemm_ = static_cast<Gemm>(
      code_of({{"torch", kGemmTorch}, {"onednn", kGemmOneDNN}, {"onednn_int8", kGemmOneDNNInt8}}, gemm,
              "linear-layer library"));
  try {
    kernels_ = &rfa::cpu::kernels(rfa::cpu::resolve_level(cpu_isa));
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, "--rfa-cpu-isa: ", error.what());
  }
  auto find = [&](const char* role) {
    TORCH_CHECK(operators.contains(role), "rfa linear library: the torch operator for '", role, "' is not named");
    auto name = operators[role].cast<std::pair<std::string, std::string>>();
    return c10::Dispatcher::singleton().findSchemaOrThrow(name.first.c_str(), name.second.c_str());
  };
  if (gemm_ == kGemmOneDNN) {
    linear_op_ = find("linear");
    linear_add_op_ = find("linear_add");
  } else if (gemm_ == kGemmOneDNNInt8) {
    qlinear_op_ = find("qlinear");
  }
}

// ------------------------------------------------------------------------------------------------ few-rows blocks

at::Tensor LinearLibrary::pack_fp32(const at::Tensor& weight) const {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "rfa few-rows pack: the weight must be a 2-d fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t block = kernels_->block, O = weight.size(0), I = weight.size(1), blocks = blocks_for(O, block);
  at::Tensor padded = at::zeros({blocks * block, I}, weight.options());
  padded.narrow(0, 0, O).copy_(weight);
  return padded.view({blocks, block, I}).transpose(1, 2).contiguous();  // (blocks, I, block)
}

std::vector<at::Tensor> LinearLibrary::pack_int8(const at::Tensor& codes) const {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.device().is_cpu(),
              "rfa few-rows pack: the codes must be a 2-d int8 CPU tensor, got ", codes.sizes(), " ",
              codes.scalar_type());
  const int64_t block = kernels_->block, O = codes.size(0), I = codes.size(1), blocks = blocks_for(O, block);
  const int64_t groups = (I + kInt8Group - 1) / kInt8Group;
  at::Tensor padded = at::zeros({blocks * block, groups * kInt8Group}, codes.options());
  padded.narrow(0, 0, O).narrow(1, 0, I).copy_(codes);
  at::Tensor packed = padded.view({blocks, block, groups, kInt8Group}).permute({0, 2, 1, 3}).contiguous();
  at::Tensor sums = padded.sum(1, /*keepdim=*/false, at::kInt).mul_(static_cast<int32_t>(kInt8RowZeroPoint));
  return {packed, sums};
}

void LinearLibrary::few_rows_fp32(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual, bool relu,
                                  const at::Tensor& y) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "rfa few-rows fp32: x must be fp32 CPU rows");
  const at::Tensor& weight = layer.rows_weight;
  const int64_t R = x.size(0), I = x.size(1), O = layer.out_features, block = kernels_->block;
  TORCH_CHECK(weight.defined() && weight.dim() == 3 && weight.scalar_type() == at::kFloat &&
                  weight.size(0) == blocks_for(O, block) && weight.size(1) == I && weight.size(2) == block &&
                  weight.is_contiguous(),
              "rfa few-rows fp32: the weight must be the ", kernels_->name, " level's blocks (pack_fp32) for ", I,
              " inputs and ", O, " outputs, got ", weight.defined() ? weight.sizes() : at::IntArrayRef{});
  check_output("rfa few-rows fp32", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_task(R, I, weight.size(0), block, [&](int64_t begin, int64_t end) {
    k.few_rows_fp32(xp, ldx, R, I, wp, out, begin, end);
  });
}

void LinearLibrary::check_int8_blocks(const LinearLayer& layer, int64_t I) const {
  const at::Tensor& weight = layer.rows_weight;
  const int64_t O = layer.out_features, block = kernels_->block;
  TORCH_CHECK(weight.defined() && weight.dim() == 4 && weight.scalar_type() == at::kChar &&
                  weight.size(0) == blocks_for(O, block) && weight.size(1) == (I + kInt8Group - 1) / kInt8Group &&
                  weight.size(2) == block && weight.is_contiguous(),
              "rfa few-rows int8: the weight must be the ", kernels_->name, " level's blocks (pack_int8) for ", I,
              " inputs and ", O, " outputs, got ", weight.defined() ? weight.sizes() : at::IntArrayRef{});
  const at::Tensor& sums = layer.rows_sums;
  TORCH_CHECK(sums.defined() && sums.scalar_type() == at::kInt && sums.numel() == weight.size(0) * block &&
                  sums.is_contiguous(),
              "rfa few-rows int8: rows_sums must be pack_int8's for the same blocks");
  TORCH_CHECK(layer.w_scales.defined() && layer.w_scales.scalar_type() == at::kFloat && layer.w_scales.numel() == O &&
                  layer.w_scales.is_contiguous(),
              "rfa few-rows int8: w_scales must hold ", O, " fp32 values");
}

void LinearLibrary::few_rows_int8(const LinearLayer& layer, const at::Tensor& codes, const at::Tensor& row_scales,
                                  const at::Tensor& residual, bool relu, const at::Tensor& y) const {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu() && codes.is_contiguous(),
              "rfa few-rows int8: codes must be contiguous uint8 CPU rows");
  const at::Tensor& weight = layer.rows_weight;
  const int64_t R = codes.size(0), I = codes.size(1), O = layer.out_features, block = kernels_->block;
  check_int8_blocks(layer, I);
  const at::Tensor& sums = layer.rows_sums;
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == R && row_scales.is_contiguous(),
              "rfa few-rows int8: row_scales must hold ", R, " fp32 values");
  check_output("rfa few-rows int8", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const rfa::cpu::Int8Scales scales{sums.data_ptr<int32_t>(), layer.w_scales.data_ptr<float>(),
                                    row_scales.data_ptr<float>()};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_task(R, I, weight.size(0), block, [&](int64_t begin, int64_t end) {
    k.few_rows_int8(cp, R, I, wp, scales, out, begin, end);
  });
}

at::Tensor LinearLibrary::few_rows_int8_of(const LinearLayer& layer, const at::Tensor& x, const at::Tensor& residual,
                                           bool relu) const {
  // a step's products quantize a few rows each: into the calling thread's scratch, not two new tensors a product
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> row_scales;
  const int64_t R = x.size(0), I = x.size(1), O = layer.out_features, block = kernels_->block;
  check_int8_blocks(layer, I);
  codes.resize(static_cast<size_t>(R * I));
  row_scales.resize(static_cast<size_t>(R));
  quantize_rows(x.data_ptr<float>(), x.stride(0), R, I, codes.data(), row_scales.data(), *kernels_);
  at::Tensor y = at::empty({R, O}, x.options());
  check_output("rfa few-rows int8", R, O, layer.bias, residual, y);
  const rfa::cpu::LinearOutput out = output_of(y, layer.bias, residual, relu);
  const rfa::cpu::Int8Scales scales{layer.rows_sums.data_ptr<int32_t>(), layer.w_scales.data_ptr<float>(),
                                    row_scales.data()};
  const uint8_t* cp = codes.data();
  const int8_t* wp = layer.rows_weight.data_ptr<int8_t>();
  const rfa::cpu::Kernels& k = *kernels_;
  for_each_task(R, I, layer.rows_weight.size(0), block, [&](int64_t begin, int64_t end) {
    k.few_rows_int8(cp, R, I, wp, scales, out, begin, end);
  });
  return y;
}

// ------------------------------------------------------------------------------------------------ the dispatch

void LinearLibrary::set_few_rows_limit(int64_t in_features, int64_t out_features, int64_t rows) {
  TORCH_CHECK(rows >= 0, "rfa linear library: a few-rows limit is a number of rows, got ", rows);
  std::lock_guard<std::mutex> lock(limits_mutex_);
  few_rows_limits_[{in_features, out_features}] = rows;
}

std::optional<int64_t> LinearLibrary::few_rows_limit(int64_t in_features, int64_t out_features) const {
  std::lock_guard<std::mutex> lock(limits_mutex_);
  auto found = few_rows_limits_.find({in_features, out_features});
  if (found == few_rows_limits_.end()) return std::nullopt;
  return found->second;
}

bool LinearLibrary::few_rows(const LinearLayer& layer, int64_t rows, int64_t in_features) const {
  if (!layer.rows_weight.defined() || gemm_ == kGemmTorch) return false;
  const std::optional<int64_t> limit = few_rows_limit(in_features, layer.out_features);
  return limit.has_value() && rows <= *limit;
}

at::Tensor LinearLibrary::linear(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                                 const char* part) const {
  RECORD_FUNCTION(part, std::vector<c10::IValue>());
  return unrecorded_linear(layer, x, relu, residual);
}

at::Tensor LinearLibrary::unrecorded_linear(const LinearLayer& layer, const at::Tensor& x, bool relu,
                                            const at::Tensor& residual) const {
  return product(layer, x, relu, residual, few_rows(layer, x.size(0), x.size(1)));
}

at::Tensor LinearLibrary::product(const LinearLayer& layer, const at::Tensor& x, bool relu, const at::Tensor& residual,
                                  bool use_few_rows) const {
  switch (gemm_) {
    case kGemmOneDNN: {
      if (use_few_rows) {
        const at::Tensor input = rows_of(x);
        at::Tensor y = at::empty({input.size(0), layer.out_features}, input.options());
        few_rows_fp32(layer, input, rows_of(residual), relu, y);
        return y;
      }
      if (residual.defined() && !relu) {  // y = x W^T + b + residual, the add fused into the product
        return call_operator(*linear_add_op_, x, residual, layer.weight, optional_value(layer.bias), std::string("add"));
      }
      at::Tensor y = call_operator(*linear_op_, x, layer.weight, optional_value(layer.bias),
                                   std::string(relu ? "relu" : "none"), empty_scalar_list(), std::string(""));
      if (residual.defined()) y.add_(residual);
      return y;
    }
    case kGemmOneDNNInt8: {
      // each row quantized with its own scale, oneDNN's int8 product with the weights' per-channel scales, then
      // the row scales, bias, relu and residual in one pass
      const at::Tensor input = x.is_contiguous() ? x : x.contiguous();
      if (use_few_rows) return few_rows_int8_of(layer, input, rows_of(residual), relu);
      at::Tensor codes = at::empty(input.sizes(), input.options().dtype(at::kByte));
      at::Tensor row_scales = at::empty({input.size(0)}, input.options());
      quantize_rows(input, codes, row_scales, *kernels_);
      at::Tensor y = call_operator(*qlinear_op_, codes, 1.0, kInt8RowZeroPoint, layer.weight, layer.w_scales,
                                   layer.w_zero_points, c10::IValue(), 1.0, int64_t{0}, c10::IValue(at::kFloat),
                                   std::string("none"), empty_scalar_list(), std::string(""));
      scale_rows(y, row_scales, layer.bias, residual, relu, *kernels_);
      return y;
    }
    default: {
      at::Tensor y = layer.bias.defined() ? at::addmm(layer.bias, x, layer.weight.t()) : at::mm(x, layer.weight.t());
      if (relu) y.relu_();
      if (residual.defined()) y.add_(residual);
      return y;
    }
  }
}

std::pair<double, double> LinearLibrary::time_products(const LinearLayer& layer, int64_t rows, int64_t repeats) const {
  TORCH_CHECK(rows >= 1 && repeats >= 1, "rfa linear library: time_products needs rows >= 1 and repeats >= 1");
  TORCH_CHECK(layer.rows_weight.defined() && gemm_ != kGemmTorch,
              "rfa linear library: time_products compares the few-rows kernel with oneDNN on a layer packed for both");
  // inputs of no consequence but their cost (no random draw: the process's generator is the user's)
  const at::Tensor x = at::linspace(-1.0, 1.0, rows * layer.in_features, at::TensorOptions().dtype(at::kFloat))
                           .view({rows, layer.in_features});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);  // the calling thread's teams (at::parallel_for's and oneDNN's): one thread
  auto best_of = [&](bool use_few_rows) {
    double best = std::numeric_limits<double>::infinity();
    product(layer, x, false, at::Tensor(), use_few_rows);  // warm-up (oneDNN builds its primitive)
    for (int64_t i = 0; i < repeats; ++i) {
      const auto start = std::chrono::steady_clock::now();
      product(layer, x, false, at::Tensor(), use_few_rows);
      const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
      best = std::min(best, took.count());
    }
    return best;
  };
  std::pair<double, double> times;
  try {
    // interleaved: a change of the machine's speed meets both alike
    double few = std::numeric_limits<double>::infinity(), other = few;
    for (int round = 0; round < 2; ++round) {
      few = std::min(few, best_of(true));
      other = std::min(other, best_of(false));
    }
    times = {few, other};
  } catch (...) {
    omp_set_num_threads(saved);
    throw;
  }
  omp_set_num_threads(saved);
  return times;
}

// ------------------------------------------------------------------------------------------------ bindings

void bind_linear_layers(py::module_& m) {
  auto layer_of = [](const py::object& packed) { return LinearLayer::from(Record(packed, "packed")); };
  py::class_<LinearLibrary, std::shared_ptr<LinearLibrary>>(m, "LinearLibrary")
      .def(py::init<const std::string&, const py::dict&, const std::string&>(), py::arg("gemm"), py::arg("operators"),
           py::arg("cpu_isa") = "auto")
      .def_property_readonly("level", [](const LinearLibrary& lib) { return std::string(lib.kernels().name); },
                             "the instruction-set level its kernels run on (cpu_kernels.h)")
      .def_property_readonly("block", [](const LinearLibrary& lib) { return lib.kernels().block; },
                             "output channels per few-rows block at that level")
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
      .def("pack_fp32", &LinearLibrary::pack_fp32, py::arg("weight"), "an fp32 weight (O, I) in the few-rows blocks")
      .def("pack_int8", &LinearLibrary::pack_int8, py::arg("codes"),
           "int8 codes (O, I) -> [the few-rows blocks, zero point x code sums]")
      .def(
          "few_rows_fp32",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, bool relu, const at::Tensor& y) {
            const LinearLayer layer = layer_of(packed);
            py::gil_scoped_release release;
            lib.few_rows_fp32(layer, x, or_undefined(residual), relu, y);
          },
          py::arg("packed"), py::arg("x"), py::arg("residual"), py::arg("relu"), py::arg("y"),
          "the few-rows kernel: y = act(x W^T + b) + residual on packed.rows_weight")
      .def(
          "few_rows_int8",
          [layer_of](const LinearLibrary& lib, const py::object& packed, const at::Tensor& codes,
                     const at::Tensor& row_scales, const std::optional<at::Tensor>& residual, bool relu,
                     const at::Tensor& y) {
            const LinearLayer layer = layer_of(packed);
            py::gil_scoped_release release;
            lib.few_rows_int8(layer, codes, row_scales, or_undefined(residual), relu, y);
          },
          py::arg("packed"), py::arg("codes"), py::arg("row_scales"), py::arg("residual"), py::arg("relu"), py::arg("y"),
          "the few-rows int8 kernel from quantize_rows' codes on packed.rows_weight / rows_sums")
      .def("set_few_rows_limit", &LinearLibrary::set_few_rows_limit, py::arg("in_features"), py::arg("out_features"),
           py::arg("rows"), "the most rows the few-rows kernel takes on products of this shape")
      .def("few_rows_limit", &LinearLibrary::few_rows_limit, py::arg("in_features"), py::arg("out_features"))
      .def(
          "time_products",
          [layer_of](const LinearLibrary& lib, const py::object& packed, int64_t rows, int64_t repeats) {
            const LinearLayer layer = layer_of(packed);
            py::gil_scoped_release release;
            return lib.time_products(layer, rows, repeats);
          },
          py::arg("packed"), py::arg("rows"), py::arg("repeats"),
          "(few-rows us, oneDNN us) of one product of `rows` rows, the best of `repeats`, on one thread");
}
