// Declarations of the decoding step's kernels (rfa_decode_step.cpp), bound in bindings.cpp: one module.
#pragma once
#include <torch/extension.h>

// An AVX2 + FMA build of a hot loop beside the portable one, picked at load time by the CPU's features.
// Not target_clones("arch=haswell"): GCC's resolver for an arch= clone compares the CPU *model*, so any
// CPU but a Haswell (newer Intel, every AMD) would run the SSE2 default.
#define RFA_SIMD_CLONES __attribute__((target_clones("avx2,fma", "default")))

// What turns causal_layer_step's phi_q / phi_k rows into features: the features themselves, or a learned
// map's pre-activations W x + b and its activation. The one table of these codes: bindings.cpp hands it to
// Python by name (the module's `activations`).
enum Activation : int64_t { kFeatures = 0, kHedgehog = 1, kReLU = 2 };

void causal_layer_step(const torch::Tensor& phi_q, const torch::Tensor& phi_k, const torch::Tensor& v,
                       const torch::Tensor& gate_logits, const torch::Tensor& key_pad, const torch::Tensor& state_in,
                       const torch::Tensor& order, torch::Tensor& state_out, torch::Tensor& out, double eps,
                       int64_t activation);
void softmax_cross_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& key_bias, int64_t beam, double scaling, torch::Tensor& out,
                        torch::Tensor& weights);
void add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& gamma,
                    const torch::Tensor& beta, double eps, torch::Tensor& out);
void beam_candidates(const torch::Tensor& lprobs, const torch::Tensor& prev_scores, int64_t beam,
                     torch::Tensor& scores_out, torch::Tensor& indices_out);
// int8 linear layers' activations: the zero point of the 7-bit codes (x86 without VNNI sums pairs of u8 x s8
// products in int16, which 8-bit codes times 7-bit weights overflow)
constexpr int64_t kInt8RowZeroPoint = 64;
void quantize_rows(const torch::Tensor& x, torch::Tensor& codes, torch::Tensor& scales);
void scale_rows(torch::Tensor& y, const torch::Tensor& scales, const torch::Tensor& bias, const torch::Tensor& residual,
                bool relu);
