// The CPU kernels' levels as a program of their own, without torch or Python: linked with cpu_level.cpp and the level
// objects of one architecture (levels/level_kernels.cpp compiled per level), it runs kernels that its input names on
// the data its input holds and writes their results. tests/test_aarch64_emulated.py compiles it for aarch64 with the
// cross compiler, runs it under qemu-user and compares its results with references computed on the host.
//
//   level_kernels_program levels          "architecture: <levels>" and "runnable: <levels this CPU runs>"
//   level_kernels_program < cases > results
//
// A case is a text line "<kernel> <level> <arguments>" followed by its inputs, raw little-endian arrays in the order
// of its reader below; its results are written the same way, in order. The linear layers' weights come as rows
// (fp32 weights; int8 codes, one per weight) and are packed here into the level's blocks, as linear_layers.cpp packs.
#include "cpu_kernels.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

using namespace rfa::cpu;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();  // what a result never written reads as

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "level_kernels_program: %s\n", message.c_str());
  std::exit(2);
}

template <typename T>
std::vector<T> read(int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  if (n > 0 && std::fread(v.data(), sizeof(T), v.size(), stdin) != v.size()) fail("input ended inside an array");
  return v;
}

template <typename T>
void write(const std::vector<T>& v) {
  if (!v.empty() && std::fwrite(v.data(), sizeof(T), v.size(), stdout) != v.size()) fail("cannot write the results");
}

template <typename T>
void write1(T x) {
  write(std::vector<T>{x});
}

const Kernels& level_kernels(const std::string& name) {
  for (Level level : architecture_levels())
    if (name == level_name(level)) {
      if (!cpu_runs(level)) fail("this CPU does not run the level " + name);
      return kernels(level);
    }
  fail("no level " + name + " in this build");
}

std::string names(const std::vector<Level>& levels) {
  std::string out;
  for (Level level : levels) out += (out.empty() ? "" : " ") + std::string(level_name(level));
  return out;
}

int64_t blocks_for(int64_t O, int64_t block) { return (O + block - 1) / block; }

// the blocks' share of each of two threads, split at a multiple of tile_blocks as the callers split them
template <typename F>
void in_two_shares(const Kernels& k, int64_t R, int64_t blocks, F&& run) {
  const int64_t step = k.tile_blocks(R), middle = (blocks / 2) / step * step;
  if (middle > 0) run(int64_t{0}, middle);
  run(middle, blocks);
}

void linear_fp32(const Kernels& k, std::istringstream& args) {
  int64_t R, I, O, relu, has_bias, has_residual;
  args >> R >> I >> O >> relu >> has_bias >> has_residual;
  const auto x = read<float>(R * I), weight = read<float>(O * I);
  const auto bias = read<float>(has_bias ? O : 0), residual = read<float>(has_residual ? R * O : 0);
  const int64_t block = k.block, blocks = blocks_for(O, block);
  std::vector<float> packed(static_cast<size_t>(blocks * I * block), 0.0f), y(static_cast<size_t>(R * O), kNaN);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) packed[(o / block) * I * block + i * block + o % block] = weight[o * I + i];
  const LinearOutput out{has_bias ? bias.data() : nullptr, has_residual ? residual.data() : nullptr, O, y.data(), O,
                         O, relu != 0};
  in_two_shares(k, R, blocks, [&](int64_t b0, int64_t b1) { k.linear_fp32(x.data(), I, R, I, packed.data(), out, b0, b1); });
  write(y);
}

void linear_int8(const Kernels& k, std::istringstream& args) {
  int64_t R, I, O, relu, has_bias, has_residual;
  args >> R >> I >> O >> relu >> has_bias >> has_residual;
  const auto codes = read<uint8_t>(R * I);
  const auto row_scales = read<float>(R);
  const auto w_codes = read<int8_t>(O * I);
  const auto w_scales = read<float>(O);
  const auto bias = read<float>(has_bias ? O : 0), residual = read<float>(has_residual ? R * O : 0);
  const int64_t block = k.block, blocks = blocks_for(O, block), groups = (I + kInt8Group - 1) / kInt8Group;
  std::vector<int8_t> packed(static_cast<size_t>(blocks * groups * block * kInt8Group), 0);
  std::vector<int32_t> sums(static_cast<size_t>(blocks * block), 0);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) {
      packed[((o / block) * groups + i / kInt8Group) * block * kInt8Group + (o % block) * kInt8Group +
             i % kInt8Group] = w_codes[o * I + i];
      sums[o] += static_cast<int32_t>(w_codes[o * I + i]) * static_cast<int32_t>(kInt8RowZeroPoint);
    }
  std::vector<float> y(static_cast<size_t>(R * O), kNaN);
  const LinearOutput out{has_bias ? bias.data() : nullptr, has_residual ? residual.data() : nullptr, O, y.data(), O,
                         O, relu != 0};
  const Int8Scales scales{sums.data(), w_scales.data(), row_scales.data()};
  in_two_shares(k, R, blocks,
                [&](int64_t b0, int64_t b1) { k.linear_int8(codes.data(), R, I, packed.data(), scales, out, b0, b1); });
  write(y);
}

template <typename S>
void update_and_read_out(const Kernels& k, std::istringstream& args) {
  int64_t F, D1, has_state;
  float g, k_scale;
  args >> F >> D1 >> has_state >> g >> k_scale;
  const auto s_in = read<S>(has_state ? F * D1 : 0);
  const auto q = read<float>(F), key = read<float>(F), v_aug = read<float>(D1);
  std::vector<S> s_out(static_cast<size_t>(F * D1));
  std::vector<float> acc(static_cast<size_t>(D1), kNaN);
  if constexpr (sizeof(S) == sizeof(float))
    k.update_and_read_out_fp32(has_state ? s_in.data() : nullptr, s_out.data(), q.data(), key.data(), v_aug.data(), g,
                               k_scale, F, D1, acc.data());
  else
    k.update_and_read_out_fp16(has_state ? s_in.data() : nullptr, s_out.data(), q.data(), key.data(), v_aug.data(), g,
                               k_scale, F, D1, acc.data());
  write(s_out);
  write(acc);
}

void run_case(const std::string& line) {
  std::istringstream args(line);
  std::string kernel, level;
  args >> kernel >> level;
  const Kernels& k = level_kernels(level);
  int64_t n;
  if (kernel == "linear_fp32") {
    linear_fp32(k, args);
  } else if (kernel == "linear_int8") {
    linear_int8(k, args);
  } else if (kernel == "update_fp32") {
    update_and_read_out<float>(k, args);
  } else if (kernel == "update_fp16") {
    update_and_read_out<uint16_t>(k, args);
  } else if (kernel == "exp") {
    args >> n;
    auto x = read<float>(n);
    k.exp_inplace(x.data(), n);
    write(x);
  } else if (kernel == "row_log_sum_exp") {
    args >> n;
    const auto x = read<float>(n);
    float max = kNaN, log_sum = kNaN;
    k.row_log_sum_exp(x.data(), n, &max, &log_sum);
    write(std::vector<float>{max, log_sum});
  } else if (kernel == "block_max" || kernel == "max_abs") {
    args >> n;
    const auto x = read<float>(n);
    write1(kernel == "block_max" ? k.block_max(x.data(), n) : k.max_abs(x.data(), n));
  } else if (kernel == "dot") {
    args >> n;
    const auto a = read<float>(n), b = read<float>(n);
    write1(k.dot(a.data(), b.data(), n));
  } else if (kernel == "axpy") {
    float a;
    args >> n >> a;
    const auto x = read<float>(n);
    auto y = read<float>(n);
    k.axpy(a, x.data(), y.data(), n);
    write(y);
  } else if (kernel == "hedgehog") {
    args >> n;
    const auto p = read<float>(n);
    std::vector<float> phi(static_cast<size_t>(2 * n), kNaN);
    k.hedgehog(p.data(), n, phi.data());
    write(phi);
  } else if (kernel == "layer_norm") {
    int64_t has_residual;
    float eps;
    args >> n >> has_residual >> eps;
    const auto x = read<float>(n), residual = read<float>(has_residual ? n : 0);
    const auto gamma = read<float>(n), beta = read<float>(n);
    std::vector<float> y(static_cast<size_t>(n)), out(static_cast<size_t>(n), kNaN);
    k.layer_norm_row(x.data(), has_residual ? residual.data() : nullptr, gamma.data(), beta.data(), n, eps, y.data(),
                     out.data());
    write(out);
  } else if (kernel == "quantize_row") {
    float inv_scale;
    args >> n >> inv_scale;
    const auto x = read<float>(n);
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    k.quantize_row(x.data(), n, inv_scale, codes.data());
    write(codes);
  } else {
    fail("no kernel named " + kernel);
  }
  if (args.fail()) fail("bad arguments in the case: " + line);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "levels") == 0) {
    std::printf("architecture: %s\nrunnable: %s\n", names(architecture_levels()).c_str(),
                names(runnable_levels()).c_str());
    return 0;
  }
  if (argc != 1) fail("usage: level_kernels_program [levels] (cases on stdin, results on stdout)");
  std::string line;
  for (int c; (c = std::fgetc(stdin)) != EOF;) {
    if (c != '\n') {
      line.push_back(static_cast<char>(c));
      continue;
    }
    run_case(line);
    line.clear();
  }
  if (!line.empty()) fail("input ended inside a case's line");
  return 0;
}
