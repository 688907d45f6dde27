// CPU kernels for torch.ops.eplb_graph.{local_experts, local_experts_w8a8}: one EP rank's share
// of a SwiGLU MoE layer.
//
// Why native: expert parallelism only shortens a step when a rank's work follows the placement.
// The output shape is fixed ([T, H], graph-safe) and the work inside is data dependent: the
// kernel collects the (token, k) rows whose slot is local, computes just those, and adds them up.
// Other ranks' rows, -1 slots and padding rows (t >= num_valid_tokens) cost nothing.
//
// Every computed row is evaluated on its own with dot products in one fixed order, then the K
// contributions of a token are summed in k order. So a row's result does not depend on how many
// other rows share its expert, on which rank computes it, or on the thread count: the demo's
// EPLB-on and EPLB-off runs stay bit-identical, whatever replica served a token. Rows are visited
// expert by expert, so an expert's weights stay in cache across its rows.
//
// stats[0] += rows computed, stats[1] += nanoseconds spent (steady clock), and where stats has a
// third cell, stats[2] += local experts that computed at least one row (each one's weights are
// read), so a compiled graph's expert time and what drives it can be read host-side between
// replays without a graph break.
//
// The schemas are defined from Python (eplb_graph/ops/registration.py); eplb_graph/ops/reference.py
// is the oracle (the same formula computed densely with ATen).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Rows per parallel task: a row is 3 * I * H multiply-adds, so a few rows already pay a wake-up.
constexpr int64_t kRowGrain = 4;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Eight independent partial sums in a fixed order: vectorizable without reassociation, and the
// same result for the same inputs on every call.
template <typename w_t, typename x_t>
inline float dot(const w_t* w, const x_t* x, int64_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += to_float(w[i + j]) * to_float(x[i + j]);
  }
  float tail = 0;
  for (; i < n; ++i) tail += to_float(w[i]) * to_float(x[i]);
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7])) + tail;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Rounds through the activation dtype, as the reference's GEMM outputs do.
template <typename t>
inline float round_to(float x) {
  return to_float(static_cast<t>(x));
}

int64_t read_integer_scalar(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 0, "num_valid_tokens should be a 0-d tensor, got ", t.dim(), "D");
  return t.item<int64_t>();
}

// The computed rows, grouped by local expert: entry i is (token t, k) = (row / K, row % K).
struct LocalRows {
  std::vector<int64_t> rows;     // flattened t * K + k, expert by expert
  std::vector<int64_t> starts;   // experts + 1 offsets into rows
  std::vector<int64_t> entry_of; // T * K: index into rows, or -1
};

template <typename id_t, typename map_t>
LocalRows collect_rows(const at::Tensor& slots, const at::Tensor& slot_to_local, int64_t experts,
                       int64_t valid) {
  const int64_t top_k = slots.size(1);
  const int64_t num_slots = slot_to_local.size(0);
  const id_t* ids = slots.const_data_ptr<id_t>();
  const map_t* local = slot_to_local.const_data_ptr<map_t>();
  const int64_t s_row = slots.stride(0), s_col = slots.stride(1), m_stride = slot_to_local.stride(0);
  LocalRows out;
  out.entry_of.assign(static_cast<size_t>(slots.size(0) * top_k), -1);
  std::vector<int64_t> expert_of(static_cast<size_t>(valid * top_k), -1);
  out.starts.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t t = 0; t < valid; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t slot = static_cast<int64_t>(ids[t * s_row + k * s_col]);
      if (slot < 0 || slot >= num_slots) continue;
      const int64_t e = static_cast<int64_t>(local[slot * m_stride]);
      if (e < 0 || e >= experts) continue;
      expert_of[t * top_k + k] = e;
      ++out.starts[e + 1];
    }
  }
  for (int64_t e = 0; e < experts; ++e) out.starts[e + 1] += out.starts[e];
  out.rows.resize(static_cast<size_t>(out.starts[experts]));
  std::vector<int64_t> fill(out.starts.begin(), out.starts.end() - 1);
  for (int64_t row = 0; row < valid * top_k; ++row) {
    const int64_t e = expert_of[row];
    if (e < 0) continue;
    out.entry_of[row] = fill[e];
    out.rows[fill[e]++] = row;
  }
  return out;
}

LocalRows collect(const at::Tensor& slots, const at::Tensor& slot_to_local, int64_t experts,
                  int64_t valid) {
  const bool slots_long = slots.scalar_type() == at::kLong;
  const bool map_long = slot_to_local.scalar_type() == at::kLong;
  if (slots_long && map_long) return collect_rows<int64_t, int64_t>(slots, slot_to_local, experts, valid);
  if (slots_long) return collect_rows<int64_t, int32_t>(slots, slot_to_local, experts, valid);
  if (map_long) return collect_rows<int32_t, int64_t>(slots, slot_to_local, experts, valid);
  return collect_rows<int32_t, int32_t>(slots, slot_to_local, experts, valid);
}

// One unquantized row: y = W2 (silu(G x) * U x), every GEMM output rounded to the dtype.
template <typename t>
void swiglu_row(const t* x, const t* w13, const t* w2, int64_t hidden, int64_t inter, float* y,
                std::vector<t>& inner) {
  for (int64_t j = 0; j < inter; ++j) {
    const float gate = round_to<t>(dot(w13 + j * hidden, x, hidden));
    const float up = round_to<t>(dot(w13 + (inter + j) * hidden, x, hidden));
    inner[j] = static_cast<t>(silu(gate) * up);
  }
  for (int64_t h = 0; h < hidden; ++h) y[h] = round_to<t>(dot(w2 + h * inter, inner.data(), inter));
}

// Per-row symmetric int8 quantization, kept as float integers (round half to even, as torch).
inline float quantize(const float* x, int64_t n, float* q) {
  float peak = 0;
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(x[i]));
  const float scale = std::max(peak, 1e-12f) / 127.0f;
  for (int64_t i = 0; i < n; ++i) q[i] = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] / scale)));
  return scale;
}

// One W8A8 row: the demo's format (eplb_graph/ops/reference.py::_swiglu_w8a8).
void w8a8_row(const float* x, const int8_t* w13, const int8_t* w2, const float* s13,
              const float* s2, int64_t hidden, int64_t inter, float* y, std::vector<float>& xq,
              std::vector<float>& inner) {
  const float x_scale = quantize(x, hidden, xq.data());
  for (int64_t j = 0; j < inter; ++j) {
    const float gate = dot(w13 + j * hidden, xq.data(), hidden) * x_scale * s13[j];
    const float up = dot(w13 + (inter + j) * hidden, xq.data(), hidden) * x_scale * s13[inter + j];
    inner[j] = silu(gate) * up;
  }
  const float inner_scale = quantize(inner.data(), inter, inner.data());
  for (int64_t h = 0; h < hidden; ++h) y[h] = dot(w2 + h * inter, inner.data(), inter) * inner_scale * s2[h];
}

void check_common(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                  const at::Tensor& slot_to_local, const at::Tensor& w13, const at::Tensor& w2,
                  const at::Tensor& stats) {
  for (const at::Tensor* t : {&hidden, &slots, &weights, &slot_to_local, &w13, &w2, &stats}) {
    TORCH_CHECK(t->device().is_cpu(), "local_experts: the native CPU kernel needs CPU tensors, got ",
                t->device());
  }
  TORCH_CHECK(hidden.dim() == 2, "local_experts: hidden should be a 2d tensor [T, H], got ",
              hidden.dim(), "D");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == hidden.size(0),
              "local_experts: slots should be [T, K] with hidden's T");
  TORCH_CHECK(weights.sizes() == slots.sizes(), "local_experts: topk_weights should have slots' shape");
  TORCH_CHECK(slot_to_local.dim() == 1, "local_experts: slot_to_local should be a 1d tensor [P]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(2) == hidden.size(1) &&
                  w13.size(1) % 2 == 0 && w2.size(0) == w13.size(0) &&
                  w2.size(1) == hidden.size(1) && w2.size(2) == w13.size(1) / 2,
              "local_experts: w13 should be [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(stats.dim() == 1 && (stats.size(0) == 2 || stats.size(0) == 3) &&
                  stats.scalar_type() == at::kLong,
              "local_experts: stats should be a 1d int64 tensor [2] (rows, ns) or [3] (rows, ns, "
              "active slots)");
}

// The shared driver: collect local rows, compute each (in parallel, expert by expert), then sum a
// token's K contributions in k order. `row_fn(entry, t, k, y)` computes one row into y[H].
template <typename F>
at::Tensor run(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
               const at::Tensor& slot_to_local, int64_t experts, at::Tensor& stats,
               const at::Tensor& num_valid_tokens, bool weight_on_input, F&& row_fn) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t tokens = hidden.size(0), width = hidden.size(1), top_k = slots.size(1);
  const int64_t valid = std::clamp<int64_t>(read_integer_scalar(num_valid_tokens), 0, tokens);
  const LocalRows local = collect(slots, slot_to_local, experts, valid);
  const int64_t computed = static_cast<int64_t>(local.rows.size());
  const at::Tensor combine = weights.to(at::kFloat).contiguous();
  const float* w = combine.const_data_ptr<float>();
  std::vector<float> rows_out(static_cast<size_t>(computed * width));
  at::parallel_for(0, computed, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = local.rows[i];
      row_fn(row / top_k, row % top_k, w[row], rows_out.data() + i * width);
    }
  });
  at::Tensor sum = at::zeros({tokens, width}, hidden.options().dtype(at::kFloat));
  float* out = sum.data_ptr<float>();
  for (int64_t t = 0; t < valid; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t entry = local.entry_of[t * top_k + k];
      if (entry < 0) continue;
      const float scale = weight_on_input ? 1.0f : w[t * top_k + k];
      const float* y = rows_out.data() + entry * width;
      for (int64_t h = 0; h < width; ++h) out[t * width + h] += scale * y[h];
    }
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  int64_t* counters = stats.data_ptr<int64_t>();
  counters[0] += computed;
  counters[stats.stride(0)] +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
  if (stats.size(0) == 3) {
    int64_t active = 0;
    for (int64_t e = 0; e < experts; ++e) active += local.starts[e + 1] > local.starts[e];
    counters[2 * stats.stride(0)] += active;
  }
  return hidden.scalar_type() == at::kFloat ? sum : sum.to(hidden.scalar_type());
}

template <typename t>
at::Tensor unquantized(const at::Tensor& hidden_in, const at::Tensor& slots,
                       const at::Tensor& weights, const at::Tensor& slot_to_local,
                       const at::Tensor& w13_in, const at::Tensor& w2_in, at::Tensor& stats,
                       const at::Tensor& num_valid_tokens, bool weight_on_input) {
  const at::Tensor hidden = hidden_in.contiguous(), w13 = w13_in.contiguous(), w2 = w2_in.contiguous();
  const int64_t width = hidden.size(1), inter = w13.size(1) / 2;
  const t* x_all = hidden.const_data_ptr<t>();
  const t* w13_all = w13.const_data_ptr<t>();
  const t* w2_all = w2.const_data_ptr<t>();
  const int64_t top_k = slots.size(1);
  const at::Tensor map = slot_to_local.to(at::kLong);
  const at::Tensor ids = slots.to(at::kLong);
  const int64_t* slot_of = ids.const_data_ptr<int64_t>();
  const int64_t* local_of = map.const_data_ptr<int64_t>();
  return run(hidden, slots, weights, slot_to_local, w13.size(0), stats, num_valid_tokens,
             weight_on_input, [&](int64_t tok, int64_t k, float weight, float* y) {
               const int64_t e = local_of[slot_of[tok * top_k + k]];
               // Per-thread scratch, reused across rows and calls: no allocation per row.
               thread_local std::vector<t> input, inner;
               input.assign(x_all + tok * width, x_all + (tok + 1) * width);
               if (weight_on_input) {
                 for (auto& v : input) v = static_cast<t>(to_float(v) * weight);
               }
               inner.resize(static_cast<size_t>(inter));
               swiglu_row<t>(input.data(), w13_all + e * 2 * inter * width,
                             w2_all + e * width * inter, width, inter, y, inner);
             });
}

at::Tensor local_experts_cpu(const at::Tensor& hidden, const at::Tensor& slots,
                             const at::Tensor& topk_weights, const at::Tensor& slot_to_local,
                             const at::Tensor& w13, const at::Tensor& w2, at::Tensor& stats,
                             const at::Tensor& num_valid_tokens, bool weight_on_input) {
  check_common(hidden, slots, topk_weights, slot_to_local, w13, w2, stats);
  TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() && w2.scalar_type() == hidden.scalar_type(),
              "local_experts: w13 and w2 should have hidden's dtype");
  if (hidden.scalar_type() == at::kBFloat16) {
    return unquantized<c10::BFloat16>(hidden, slots, topk_weights, slot_to_local, w13, w2, stats,
                                      num_valid_tokens, weight_on_input);
  }
  TORCH_CHECK(hidden.scalar_type() == at::kFloat,
              "local_experts: hidden should be float32 or bfloat16");
  return unquantized<float>(hidden, slots, topk_weights, slot_to_local, w13, w2, stats,
                            num_valid_tokens, weight_on_input);
}

at::Tensor local_experts_w8a8_cpu(const at::Tensor& hidden_in, const at::Tensor& slots,
                                  const at::Tensor& topk_weights, const at::Tensor& slot_to_local,
                                  const at::Tensor& w13_in, const at::Tensor& w2_in,
                                  const at::Tensor& w13_scale_in, const at::Tensor& w2_scale_in,
                                  at::Tensor& stats, const at::Tensor& num_valid_tokens,
                                  bool weight_on_input) {
  check_common(hidden_in, slots, topk_weights, slot_to_local, w13_in, w2_in, stats);
  TORCH_CHECK(w13_in.scalar_type() == at::kChar && w2_in.scalar_type() == at::kChar,
              "local_experts_w8a8: w13 and w2 should be int8");
  const at::Tensor hidden = hidden_in.to(at::kFloat).contiguous();
  const at::Tensor w13 = w13_in.contiguous(), w2 = w2_in.contiguous();
  const at::Tensor s13 = w13_scale_in.contiguous(), s2 = w2_scale_in.contiguous();
  const int64_t width = hidden.size(1), inter = w13.size(1) / 2, top_k = slots.size(1);
  const float* x_all = hidden.const_data_ptr<float>();
  const int8_t* w13_all = w13.const_data_ptr<int8_t>();
  const int8_t* w2_all = w2.const_data_ptr<int8_t>();
  const float* s13_all = s13.const_data_ptr<float>();
  const float* s2_all = s2.const_data_ptr<float>();
  const at::Tensor map = slot_to_local.to(at::kLong);
  const at::Tensor ids = slots.to(at::kLong);
  const int64_t* slot_of = ids.const_data_ptr<int64_t>();
  const int64_t* local_of = map.const_data_ptr<int64_t>();
  at::Tensor out = run(hidden_in, slots, topk_weights, slot_to_local, w13.size(0), stats,
                       num_valid_tokens, weight_on_input,
                       [&](int64_t tok, int64_t k, float weight, float* y) {
                         const int64_t e = local_of[slot_of[tok * top_k + k]];
                         // Per-thread scratch, reused across rows and calls.
                         thread_local std::vector<float> input, xq, inner;
                         input.assign(x_all + tok * width, x_all + (tok + 1) * width);
                         if (weight_on_input) {
                           for (auto& v : input) v *= weight;
                         }
                         xq.resize(static_cast<size_t>(width));
                         inner.resize(static_cast<size_t>(inter));
                         w8a8_row(input.data(), w13_all + e * 2 * inter * width,
                                  w2_all + e * width * inter, s13_all + e * 2 * inter,
                                  s2_all + e * width, width, inter, y, xq, inner);
                       });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(eplb_graph, CPU, m) {
  m.impl("local_experts", &local_experts_cpu);
  m.impl("local_experts_w8a8", &local_experts_w8a8_cpu);
}
