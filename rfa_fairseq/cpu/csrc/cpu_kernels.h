// The CPU kernels' instruction-set levels and the one table of kernels each level has: levels/level_kernels.cpp,
// written once and compiled once per level into the level's namespace (rfa::cpu::<level's namespace>). Plain C++ over
// raw pointers: the levels' translation units include no torch operators, and the callers (step_kernels.cpp,
// linear_layers.cpp, decode_program.cpp) check their tensors before they pass pointers here.
//
// The levels are declared once, in rfa_fairseq/cpu/levels.py (LEVELS: names, order, compiler flags, the CPU features
// each needs, oneDNN's cap), from which levels/level_table.h (the enum, each architecture's levels) is written:
//   x86-64:  default (the baseline, SSE2), avx2 (AVX2 + FMA + F16C), avx512 (AVX-512 F/BW/VL/DQ), avx512_vnni (+ VNNI)
//   aarch64: neon, neon_dotprod (+ the dot-product extension, sdot)
//   others:  default
// A level name is resolved in one place, `resolve_level(name)`: the best level this CPU runs and this build has, at
// most the named one ("auto": no cap; the plugin's --rfa-cpu-isa).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "levels/level_table.h"

namespace rfa::cpu {

// where a linear layer's results go: y = act(v + bias) + residual per (row, channel)
struct LinearOutput {
  const float* bias;      // (O,) or null
  const float* residual;  // rows of ldr, or null
  int64_t ldr;
  float* y;
  int64_t ldy;
  int64_t out_features;
  bool relu;
};

struct Int8Scales {
  const int32_t* sums;      // (blocks * block,) zero point x each channel's sum of codes
  const float* w_scales;    // (O,)
  const float* row_scales;  // (R,)
};

// One level's kernels. The linear layers keep each weight in blocks of `block` output channels (the level's vector
// width), all of a block's inputs contiguous: fp32 (blocks, I, block); int8 (blocks, ceil(I / 4), block, 4) bytes.
// Each linear_* call computes the output blocks [block_begin, block_end) of every row (callers split the blocks over
// threads), for any number of rows.
struct Kernels {
  Level level;
  const char* name;
  int64_t block;  // output channels per block
  // the blocks a tile of products of `rows` rows spans (callers split the blocks over threads in multiples of it)
  int64_t (*tile_blocks)(int64_t rows);
  // y = act(x W^T + b) + residual, x: R rows of I (row stride ldx)
  void (*linear_fp32)(const float* x, int64_t ldx, int64_t R, int64_t I, const float* blocks, const LinearOutput& out,
                      int64_t block_begin, int64_t block_end);
  // the same from quantize_row's codes (R rows of I, contiguous): act(((codes W^T - sums) * w_scale) * row_scale + b)
  void (*linear_int8)(const uint8_t* codes, int64_t R, int64_t I, const int8_t* blocks, const Int8Scales& scales,
                      const LinearOutput& out, int64_t block_begin, int64_t block_end);
  // exp of n floats in place (a polynomial within about 1 ulp of expf on x <= 0, the range used here)
  void (*exp_inplace)(float* x, int64_t n);
  // max and log(sum(exp(x - max))) of a row: log_softmax(x) = (x - max) - log_sum
  void (*row_log_sum_exp)(const float* x, int64_t n, float* max_out, float* log_sum_out);
  // the largest of n floats (NaN ignored; -inf when none)
  float (*block_max)(const float* x, int64_t n);
  // The causal RFA update and read-out of one head: S' = g * S + k_scale * k (x) [v, 1] (no S: s_in null), written to
  // s_out; acc = q . S' (D1 = d + 1 sums, S' before it is stored). The state in fp32 or fp16 (IEEE binary16 bits).
  void (*update_and_read_out_fp32)(const float* s_in, float* s_out, const float* q, const float* k, const float* v_aug,
                                   float g, float k_scale, int64_t F, int64_t D1, float* acc);
  void (*update_and_read_out_fp16)(const uint16_t* s_in, uint16_t* s_out, const float* q, const float* k,
                                   const float* v_aug, float g, float k_scale, int64_t F, int64_t D1, float* acc);
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);  // y += a * x
  // phi = [softmax(p), softmax(-p)] of one head's D pre-activations (F = 2D), max-shifted as torch.softmax
  void (*hedgehog)(const float* p, int64_t D, float* phi);
  // out = LayerNorm(x + residual) of one row (residual may be null), through y (C floats): out may be x or residual
  void (*layer_norm_row)(const float* x, const float* residual, const float* gamma, const float* beta, int64_t C,
                         float eps, float* y, float* out);
  float (*max_abs)(const float* x, int64_t n);
  // 7-bit codes round(x * inv_scale) + zero point (round half to even, as torch.round)
  void (*quantize_row)(const float* x, int64_t n, float inv_scale, uint8_t* codes);
};

// int8 linear layers' activations: the zero point of the 7-bit codes (x86 without VNNI sums pairs of u8 x s8 products
// in int16, which 8-bit codes times 7-bit weights could overflow)
constexpr int64_t kInt8RowZeroPoint = 64;
constexpr int64_t kInt8Group = 4;  // inputs per int32 lane of an int8 product

const char* level_name(Level level);
// the levels of this build's architecture, lowest first (what --rfa-cpu-isa may name here)
std::vector<Level> architecture_levels();
// whether this CPU (and its operating system) runs the level's instructions
bool cpu_runs(Level level);
// the kernels of a level of this architecture
const Kernels& kernels(Level level);
// The one resolution of a level's name: the best of this architecture's levels that this CPU runs, at most the named
// one ("auto": the best). std::invalid_argument naming the levels for a name that is not one of this architecture's.
// (A caller that needs exactly the named level compares level_name of the result.)
Level resolve_level(const std::string& name);
// the levels this CPU runs, lowest first
std::vector<Level> runnable_levels();

}  // namespace rfa::cpu
