// Linear layers of few rows on AVX-512: the products of a small decoding step (one sentence's beam: 4 rows; a short
// source in the encoder), where oneDNN's linear costs more per call than the arithmetic (2-8x the time at 4 rows on the
// step's shapes, benchmarks/benchmark_few_rows.py). Each weight is kept in blocks of 16 output channels, all of the
// inputs of a block contiguous, so a tile of up to 4 rows x 4 blocks reads each weight once per 4 rows from L1/L2:
//
//   fp32:  blocks (ceil(O / 16), I, 16); y = act(x W^T + b) + residual with vfmadd over the inputs in chunks of 512
//          (each chunk's sum added to the total), the bias added after: oneDNN's fp32 order of operations on this
//          machine's shapes (bit-identical results for I <= 1024 on AVX-512; tests/test_few_rows.py)
//   int8:  AVX-512 VNNI, blocks (ceil(O / 16), ceil(I / 4), 16, 4) (a block's 64 bytes are 16 channels x 4 inputs, one
//          vpdpbusd operand) and per channel kInt8RowZeroPoint x its sum of codes, which turns the 7-bit u8 codes'
//          products into the symmetric ones; y = act(((codes W^T - sums) * w_scale[n]) * row_scale + bias) + residual,
//          the arithmetic of oneDNN's int8 linear and scale_rows (int32 sums exact, fp32 epilogue in their order)
//
// References (tests/test_few_rows.py): the oneDNN paths of LinearLibrary (decode_program.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "rfa_kernels.h"

namespace {

constexpr int64_t kLanes = 16;     // output channels per block (one zmm)
constexpr int64_t kGroup = 4;      // int8: inputs per vpdpbusd lane
constexpr int64_t kRowTile = 4;    // rows sharing each loaded weight vector
constexpr int64_t kBlockTile = 4;  // column blocks per tile: 16 independent sums at 4 rows
constexpr int64_t kFp32Chunk = 512;  // fp32: inputs summed in one chain before joining the total (oneDNN's split)

// where a tile's results go: y = act(v + bias) + residual per (row, channel), v the tile's own value
struct Output {
  const float* bias;      // (O,) or null
  const float* residual;  // rows of ldr, or null
  int64_t ldr;
  float* y;
  int64_t ldy;
  int64_t out_features;
  bool relu;
};

__attribute__((target("avx512f"))) inline __mmask16 lanes_of(int64_t n0, int64_t out_features) {
  const int64_t valid = std::min<int64_t>(kLanes, out_features - n0);
  return static_cast<__mmask16>((1u << valid) - 1u);
}

// v (16 channels from n0) of row r: + bias, relu, + residual, stored
__attribute__((target("avx512f"), always_inline)) inline void store(const Output& out, int64_t r, int64_t n0,
                                                                   __mmask16 mask, __m512 v, __m512 bias16) {
  v = _mm512_add_ps(v, bias16);
  if (out.relu) v = _mm512_max_ps(v, _mm512_setzero_ps());
  if (out.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out.residual + r * out.ldr + n0));
  _mm512_mask_storeu_ps(out.y + r * out.ldy + n0, mask, v);
}

__attribute__((target("avx512f"))) inline __m512 bias_of(const Output& out, int64_t n0, __mmask16 mask) {
  return out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + n0) : _mm512_setzero_ps();
}

// ------------------------------------------------------------------------------------------------ fp32

template <int ROWS, int BLOCKS>
__attribute__((target("avx512f"))) void fp32_tile(const float* x, int64_t ldx, int64_t I, const float* weight,
                                                  const Output& out, int64_t r0, int64_t b0) {
  const int64_t block_stride = I * kLanes;
  const float* w = weight + b0 * block_stride;
  __m512 total[ROWS][BLOCKS];
  for (int64_t k0 = 0; k0 < I; k0 += kFp32Chunk) {
    __m512 part[ROWS][BLOCKS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) part[r][b] = _mm512_setzero_ps();
    for (int64_t k = k0, end = std::min(I, k0 + kFp32Chunk); k < end; ++k) {
      __m512 wb[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b) wb[b] = _mm512_loadu_ps(w + b * block_stride + k * kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(x[(r0 + r) * ldx + k]);
        for (int b = 0; b < BLOCKS; ++b) part[r][b] = _mm512_fmadd_ps(a, wb[b], part[r][b]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) total[r][b] = k0 == 0 ? part[r][b] : _mm512_add_ps(total[r][b], part[r][b]);
  }
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t n0 = (b0 + b) * kLanes;
    const __mmask16 mask = lanes_of(n0, out.out_features);
    const __m512 bias16 = bias_of(out, n0, mask);
    for (int r = 0; r < ROWS; ++r) store(out, r0 + r, n0, mask, total[r][b], bias16);
  }
}

// ------------------------------------------------------------------------------------------------ int8

// the 4 codes at k .. k + 3 of a row as one int32 (bytes past `width` are 0: their weights are padding)
inline int32_t code_group(const uint8_t* row, int64_t k, int64_t width) {
  int32_t word = 0;
  std::memcpy(&word, row + k, std::min(kGroup, width - k));
  return word;
}

template <int ROWS, int BLOCKS>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline void accumulate_codes(
    __m512i (&acc)[ROWS][BLOCKS], const __m512i* a, const int8_t* w, int64_t block_stride, int64_t g) {
  __m512i wb[BLOCKS];
  for (int b = 0; b < BLOCKS; ++b) wb[b] = _mm512_loadu_si512(w + b * block_stride + g * kLanes * kGroup);
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], a[r], wb[b]);
}

struct Int8Scales {
  const int32_t* sums;      // (blocks * 16,) zero point x each channel's sum of codes
  const float* w_scales;    // (O,)
  const float* row_scales;  // (R,)
};

template <int ROWS, int BLOCKS>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int8_tile(const uint8_t* codes, int64_t I,
                                                                      const int8_t* weight, const Int8Scales& scales,
                                                                      const Output& out, int64_t r0, int64_t b0) {
  const int64_t groups = (I + kGroup - 1) / kGroup, whole = I / kGroup;
  const int64_t block_stride = groups * kLanes * kGroup;
  const int8_t* w = weight + b0 * block_stride;
  __m512i acc[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm512_setzero_si512();
  __m512i a[ROWS];
  for (int64_t g = 0; g < whole; ++g) {
    for (int r = 0; r < ROWS; ++r) {
      int32_t word;
      std::memcpy(&word, codes + (r0 + r) * I + g * kGroup, sizeof(word));  // rows need no 4-byte alignment
      a[r] = _mm512_set1_epi32(word);
    }
    accumulate_codes<ROWS, BLOCKS>(acc, a, w, block_stride, g);
  }
  if (whole < groups) {  // a last partial group of codes
    for (int r = 0; r < ROWS; ++r) a[r] = _mm512_set1_epi32(code_group(codes + (r0 + r) * I, whole * kGroup, I));
    accumulate_codes<ROWS, BLOCKS>(acc, a, w, block_stride, whole);
  }
  for (int b = 0; b < BLOCKS; ++b) {
    const int64_t n0 = (b0 + b) * kLanes;
    const __mmask16 mask = lanes_of(n0, out.out_features);
    const __m512i sums = _mm512_loadu_si512(scales.sums + n0);  // padded to whole blocks
    const __m512 w_scales = _mm512_maskz_loadu_ps(mask, scales.w_scales + n0);
    const __m512 bias16 = bias_of(out, n0, mask);
    for (int r = 0; r < ROWS; ++r) {
      // oneDNN's output, float(sum) * w_scale, then scale_rows' y * s + bias (no fused multiply-add: their roundings)
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], sums)), w_scales);
      store(out, r0 + r, n0, mask, _mm512_mul_ps(v, _mm512_set1_ps(scales.row_scales[r0 + r])), bias16);
    }
  }
}

// ------------------------------------------------------------------------------------------------ the tiles

template <class Tile, template <int, int> class Of>
struct TileTable {  // table[rows][blocks] of Of<rows, blocks>::fn
  template <int ROWS>
  static constexpr std::array<Tile, kBlockTile + 1> row() {
    return {nullptr, Of<ROWS, 1>::fn, Of<ROWS, 2>::fn, Of<ROWS, 3>::fn, Of<ROWS, 4>::fn};
  }
  static constexpr std::array<std::array<Tile, kBlockTile + 1>, kRowTile + 1> table = {
      std::array<Tile, kBlockTile + 1>{}, row<1>(), row<2>(), row<3>(), row<4>()};
};

using Fp32Tile = void (*)(const float*, int64_t, int64_t, const float*, const Output&, int64_t, int64_t);
using Int8Tile = void (*)(const uint8_t*, int64_t, const int8_t*, const Int8Scales&, const Output&, int64_t, int64_t);
template <int R, int B>
struct Fp32Of {
  static constexpr Fp32Tile fn = fp32_tile<R, B>;
};
template <int R, int B>
struct Int8Of {
  static constexpr Int8Tile fn = int8_tile<R, B>;
};

// every (rows, blocks) tile of an R x O product, columns outer (a tile's weights stay near over every row), tasks of
// ~256 K multiply-adds or more across the threads (a step's small products stay on one: a team costs more)
template <class Run>
void for_each_tile(int64_t R, int64_t I, int64_t O, const Run& run) {
  const int64_t blocks = (O + kLanes - 1) / kLanes, tiles = (blocks + kBlockTile - 1) / kBlockTile;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, R * I * kLanes * kBlockTile));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kBlockTile, n_blocks = std::min(kBlockTile, blocks - b0);
      for (int64_t r0 = 0; r0 < R; r0 += kRowTile) run(r0, std::min(kRowTile, R - r0), b0, n_blocks);
    }
  });
}

int64_t blocks_for(int64_t out_features) { return (out_features + kLanes - 1) / kLanes; }

Output output_of(const at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual, bool relu) {
  return Output{bias.defined() ? bias.data_ptr<float>() : nullptr,
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

}  // namespace

bool few_rows_available(bool int8) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool vnni = avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return int8 ? vnni : avx512;
}

at::Tensor few_rows_pack_fp32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "few_rows_pack_fp32: the weight must be a 2-d fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t O = weight.size(0), I = weight.size(1), blocks = blocks_for(O);
  at::Tensor padded = at::zeros({blocks * kLanes, I}, weight.options());
  padded.narrow(0, 0, O).copy_(weight);
  return padded.view({blocks, kLanes, I}).transpose(1, 2).contiguous();  // (blocks, I, 16)
}

std::vector<at::Tensor> few_rows_pack_int8(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.device().is_cpu(),
              "few_rows_pack_int8: the codes must be a 2-d int8 CPU tensor, got ", codes.sizes(), " ",
              codes.scalar_type());
  const int64_t O = codes.size(0), I = codes.size(1), blocks = blocks_for(O), groups = (I + kGroup - 1) / kGroup;
  at::Tensor padded = at::zeros({blocks * kLanes, groups * kGroup}, codes.options());
  padded.narrow(0, 0, O).narrow(1, 0, I).copy_(codes);
  at::Tensor packed = padded.view({blocks, kLanes, groups, kGroup}).permute({0, 2, 1, 3}).contiguous();
  at::Tensor sums = padded.sum(1, /*keepdim=*/false, at::kInt).mul_(static_cast<int32_t>(kInt8RowZeroPoint));
  return {packed, sums};
}

void few_rows_linear_fp32(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& residual, bool relu, const at::Tensor& y) {
  TORCH_CHECK(few_rows_available(false), "few_rows_linear_fp32: this CPU has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "few_rows_linear_fp32: x must be fp32 rows");
  const int64_t R = x.size(0), I = x.size(1), O = y.size(1);
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kFloat && weight.size(0) == blocks_for(O) &&
                  weight.size(1) == I && weight.size(2) == kLanes && weight.is_contiguous(),
              "few_rows_linear_fp32: the weight must be few_rows_pack_fp32's blocks for ", I, " inputs and ", O,
              " outputs, got ", weight.sizes());
  check_output("few_rows_linear_fp32", R, O, bias, residual, y);
  const Output out = output_of(y, bias, residual, relu);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  for_each_tile(R, I, O, [&](int64_t r0, int64_t rows, int64_t b0, int64_t blocks) {
    TileTable<Fp32Tile, Fp32Of>::table[rows][blocks](xp, ldx, I, wp, out, r0, b0);
  });
}

void few_rows_linear_int8(const at::Tensor& codes, const at::Tensor& row_scales, const at::Tensor& weight,
                          const at::Tensor& sums, const at::Tensor& w_scales, const at::Tensor& bias,
                          const at::Tensor& residual, bool relu, const at::Tensor& y) {
  TORCH_CHECK(few_rows_available(true), "few_rows_linear_int8: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "few_rows_linear_int8: codes must be contiguous uint8 rows");
  const int64_t R = codes.size(0), I = codes.size(1), O = y.size(1);
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kChar && weight.size(0) == blocks_for(O) &&
                  weight.size(1) == (I + kGroup - 1) / kGroup && weight.is_contiguous(),
              "few_rows_linear_int8: the weight must be few_rows_pack_int8's blocks for ", I, " inputs and ", O,
              " outputs, got ", weight.sizes());
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.numel() == blocks_for(O) * kLanes && sums.is_contiguous(),
              "few_rows_linear_int8: sums must be few_rows_pack_int8's");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.numel() == O && w_scales.is_contiguous(),
              "few_rows_linear_int8: w_scales must hold ", O, " fp32 values");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == R && row_scales.is_contiguous(),
              "few_rows_linear_int8: row_scales must hold ", R, " fp32 values");
  check_output("few_rows_linear_int8", R, O, bias, residual, y);
  const Output out = output_of(y, bias, residual, relu);
  const Int8Scales scales{sums.data_ptr<int32_t>(), w_scales.data_ptr<float>(), row_scales.data_ptr<float>()};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  for_each_tile(R, I, O, [&](int64_t r0, int64_t rows, int64_t b0, int64_t blocks) {
    TileTable<Int8Tile, Int8Of>::table[rows][blocks](cp, I, wp, scales, out, r0, b0);
  });
}
