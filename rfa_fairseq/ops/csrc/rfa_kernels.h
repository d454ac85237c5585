// Declarations of the kernels bound in rfa_decode_step.cpp's module (one extension, several sources).
#pragma once
#include <torch/extension.h>

void causal_layer_step(const torch::Tensor& phi_q, const torch::Tensor& phi_k, const torch::Tensor& v,
                       const torch::Tensor& gate_logits, const torch::Tensor& key_pad, const torch::Tensor& state_in,
                       const torch::Tensor& order, torch::Tensor& state_out, torch::Tensor& out, double eps);
void softmax_cross_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& key_bias, int64_t beam, double scaling, torch::Tensor& out,
                        torch::Tensor& weights);
void add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& gamma,
                    const torch::Tensor& beta, double eps, torch::Tensor& out);
