// Fused CPU kernels for torch.ops.eplb_graph.{map_to_physical, record_load, map_and_record}.
//
// Why native: the ATen reference composes about a dozen full passes (casts, where, remainder,
// two gathers, scatter_add); on CPU each pass re-reads T*K elements and pays a dispatch. This
// kernel makes one pass per (t, k): hash once per row, gather count and table entry, record.
// Semantics are exactly those of eplb_graph/ops/reference.py, which stays the oracle.
//
// Speed notes (measured with tools/bench/bench_ops.py; see docs/benchmarks.md):
// - Per call: the 0-d inputs are read straight from CPU memory (no item() dispatch) and the
//   output is allocated without a dispatcher round trip; a decode step (T=1) is dominated by
//   these fixed costs. Small calls use a 32-bit modulo, never a 64-bit one.
// - Large calls (FastLookup) first resolve, per expert, the usable slots (clamp and torn-refresh
//   fallback applied) and a Lemire multiplier for its replica count, so the inner loop has no
//   division, no stride and no data-dependent branch besides the id range check. Their load
//   counts go to a private histogram folded into `load` once (no atomics per pair, also when
//   threads split the rows). Top-k 8 rows are unrolled.
//
// The schemas are defined from Python (eplb_graph/ops/registration.py) so the ops exist even
// when no compiler is present; this file only registers CPU implementations for them.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace {

constexpr uint32_t kGoldenHash = 2654435769u;
// Fewer (t, k) pairs than this per thread and a call stays on one thread: waking a thread costs
// more than the work, and on a loaded machine the wait for a busy core dominates.
constexpr int64_t kParallelGrain = 65536;
// From this many (t, k) pairs on (and at least twice N + P) the per-expert tables and the private
// histogram of FastLookup pay for their setup.
constexpr int64_t kPrecomputeMin = 1024;

inline uint32_t replica_hash(int64_t row, int64_t offset) {
  // (row + offset) mod 2^32, then the product mod 2^32: unsigned arithmetic wraps by definition.
  const uint32_t x =
      static_cast<uint32_t>(static_cast<uint64_t>(row) + static_cast<uint64_t>(offset));
  return x * kGoldenHash;
}

// A dtype as Python spells it ("torch.int32"), so messages equal eplb_graph/ops/checks.py's.
std::string dtype_name(at::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

bool is_index_type(at::ScalarType type) { return type == at::kInt || type == at::kLong; }

template <typename F>
void dispatch_index_type(at::ScalarType type, const char* what, F&& body) {
  switch (type) {
    case at::kInt:
      body(int32_t{});
      break;
    case at::kLong:
      body(int64_t{});
      break;
    default:
      TORCH_CHECK(false, what, " should be int32 or int64, got ", dtype_name(type));
  }
}

// A checked 0-d integer tensor (check_step_flags), read from CPU memory without item()'s dispatch.
int64_t read_integer_scalar(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kByte:
      return *t.const_data_ptr<uint8_t>();
    case at::kChar:
      return *t.const_data_ptr<int8_t>();
    case at::kShort:
      return *t.const_data_ptr<int16_t>();
    case at::kInt:
      return *t.const_data_ptr<int32_t>();
    default:
      return *t.const_data_ptr<int64_t>();
  }
}

struct MapArgs {
  int64_t rows, top_k, experts, width, table_row_stride, table_col_stride, count_stride, offset;
};

// The slot a chosen table entry maps to in an output of type out_t, as in
// eplb_graph/ops/reference.py: the entry if it is a usable slot (0 <= entry <= max(out_t), so the
// output cast never wraps), else replica 0's entry if that is usable (torn refresh: new count, old
// row; replica 0 is populated in every valid row), else -1, like an invalid id. The output is
// therefore always -1 or an exact table entry. The bound is a compile-time constant: with it the
// hot path is one compare, as cheap as the plain sign test (a runtime bound measurably was not).
template <typename out_t>
inline int64_t resolve_slot(int64_t entry, int64_t first) {
  constexpr uint64_t kMaxSlot = static_cast<uint64_t>(std::numeric_limits<out_t>::max());
  if (C10_LIKELY(static_cast<uint64_t>(entry) <= kMaxSlot)) return entry;
  return static_cast<uint64_t>(first) <= kMaxSlot ? first : -1;
}

struct RecordArgs {
  bool enabled;
  int64_t valid_rows, slots, load_stride;
};

// Logical id -> physical slot with the count read per element and a 32-bit modulo.
template <typename out_t, typename tab_t, typename cnt_t>
struct DirectLookup {
  const tab_t* table;
  const cnt_t* count;
  int64_t experts, width, row_stride, col_stride, count_stride;

  inline int64_t operator()(int64_t expert, uint32_t hash) const {
    if (static_cast<uint64_t>(expert) >= static_cast<uint64_t>(experts)) return -1;
    const int64_t c = static_cast<int64_t>(count[expert * count_stride]);
    // max(c, 1) replicas; a count of 2^32 or more exceeds every 32-bit hash, so h % c == h.
    uint32_t replica;
    if (c <= 1) {
      replica = 0;
    } else if (c > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
      replica = hash;
    } else {
      replica = hash % static_cast<uint32_t>(c);
    }
    // The clamp keeps the column inside the table even if a count exceeds the table width.
    const int64_t column = std::min<int64_t>(replica, width - 1);
    const tab_t* row = table + expert * row_stride;
    return resolve_slot<out_t>(static_cast<int64_t>(row[column * col_stride]),
                               static_cast<int64_t>(row[0]));
  }
};

// Large calls resolve every expert's usable slots once per call. Per expert: Lemire's multiplier
// M = floor((2^64 - 1) / d) + 1 for its count d, with which ((M * h mod 2^64) * d) >> 64 == h % d
// for every 32-bit h and d (M = 0 for d = 1), and the index of its first entry in `slots`, which
// holds the slot of replica 0..min(d, R)-1 with the torn-refresh fallback already applied. The
// inner loop is then a multiply-high and one gather, with no division, stride or branch on data.
struct FastExpert {
  uint64_t multiplier;
  uint32_t divisor;
  uint32_t first;
};

struct FastLookup {
  const FastExpert* experts_table;
  const int64_t* slots;
  int64_t experts, last_column;

  inline int64_t operator()(int64_t expert, uint32_t hash) const {
    if (static_cast<uint64_t>(expert) >= static_cast<uint64_t>(experts)) return -1;
    const FastExpert e = experts_table[expert];
    const uint64_t low = e.multiplier * hash;
    const uint32_t replica =
        static_cast<uint32_t>((static_cast<unsigned __int128>(low) * e.divisor) >> 64);
    // replica < d, and min(replica, R-1) < min(d, R): always one of the expert's entries.
    return slots[e.first + std::min<int64_t>(replica, last_column)];
  }
};

// Fills the per-expert table and the resolved slots; false if the direct path is better or needed
// (a count of 2^32 or more, or more resolved entries than the call has (t, k) pairs).
template <typename out_t, typename tab_t, typename cnt_t>
bool make_fast_tables(const tab_t* table, const cnt_t* count, const MapArgs& m, int64_t budget,
                      c10::SmallVector<FastExpert, 512>& experts,
                      c10::SmallVector<int64_t, 2048>& slots) {
  experts.resize(static_cast<size_t>(m.experts));
  int64_t total = 0;
  for (int64_t e = 0; e < m.experts; ++e) {
    int64_t c = static_cast<int64_t>(count[e * m.count_stride]);
    if (c > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) return false;
    if (c < 1) c = 1;
    total += std::min<int64_t>(c, m.width);
  }
  if (total > budget || total > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    return false;
  }
  slots.resize(static_cast<size_t>(total));
  int64_t next = 0;
  for (int64_t e = 0; e < m.experts; ++e) {
    const int64_t c = std::max<int64_t>(1, static_cast<int64_t>(count[e * m.count_stride]));
    const uint32_t d = static_cast<uint32_t>(c);
    const tab_t* row = table + e * m.table_row_stride;
    const int64_t first_slot = static_cast<int64_t>(row[0]);
    experts[e] = FastExpert{d == 1 ? 0 : std::numeric_limits<uint64_t>::max() / d + 1, d,
                            static_cast<uint32_t>(next)};
    const int64_t used = std::min<int64_t>(c, m.width);
    for (int64_t j = 0; j < used; ++j) {
      slots[next + j] =
          resolve_slot<out_t>(static_cast<int64_t>(row[j * m.table_col_stride]), first_slot);
    }
    next += used;
  }
  return true;
}

// Physical ids given as input (record_load): the "lookup" reads them back.
struct IdentityLookup {
  inline int64_t operator()(int64_t slot, uint32_t) const { return slot; }
};

// Rows [begin, end): out[t, k] = lookup(ids[t, k]); when kRecord, count valid slots via `add`.
// kTopK > 0 fixes K at compile time (fully unrolled rows); 0 reads it from `dynamic_top_k`.
template <bool kMap, bool kRecord, int kTopK, typename id_t, typename Lookup, typename Add>
inline void run_rows_k(int64_t begin, int64_t end, int64_t dynamic_top_k, int64_t offset,
                       const id_t* ids, id_t* out, const Lookup lookup, int64_t slots, Add&& add) {
  const int64_t top_k = kTopK > 0 ? kTopK : dynamic_top_k;
  for (int64_t t = begin; t < end; ++t) {
    const uint32_t hash = kMap ? replica_hash(t, offset) : 0u;
    const id_t* row_ids = ids + t * top_k;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t slot = lookup(static_cast<int64_t>(row_ids[k]), hash);
      if constexpr (kMap) out[t * top_k + k] = static_cast<id_t>(slot);
      if constexpr (kRecord) {
        if (static_cast<uint64_t>(slot) < static_cast<uint64_t>(slots)) add(slot);
      }
    }
  }
}

// Top-k 8 (DeepSeek-V3, Qwen3 and most current MoE routers) gets its own unrolled instance.
template <bool kMap, bool kRecord, typename id_t, typename Lookup, typename Add>
inline void run_rows(int64_t begin, int64_t end, int64_t top_k, int64_t offset, const id_t* ids,
                     id_t* out, const Lookup& lookup, int64_t slots, Add&& add) {
  if (top_k == 8) {
    run_rows_k<kMap, kRecord, 8>(begin, end, top_k, offset, ids, out, lookup, slots, add);
  } else {
    run_rows_k<kMap, kRecord, 0>(begin, end, top_k, offset, ids, out, lookup, slots, add);
  }
}

// `cell + amount` wrapping modulo the counter's width, as ATen's scatter_add_ does in practice:
// computed unsigned, because a signed overflow is undefined behaviour in C++.
template <typename load_t>
inline load_t wrapping_add(load_t cell, int64_t amount) {
  using bits_t = std::make_unsigned_t<load_t>;
  return static_cast<load_t>(static_cast<bits_t>(cell) + static_cast<bits_t>(amount));
}

// How a chunk of rows adds its counts to `load`.
enum class Counting { kDirect, kAtomic, kHistogram, kHistogramAtomic };

// Maps rows [begin, end) (when kMap) and counts the rows below valid_rows (when kRecord).
template <bool kMap, bool kRecord, typename id_t, typename load_t, typename Lookup>
void run_chunk(int64_t begin, int64_t end, int64_t top_k, int64_t offset, const id_t* ids,
               id_t* out, const Lookup& lookup, load_t* load, const RecordArgs& r,
               Counting counting) {
  int64_t counted_end = begin;
  if constexpr (kRecord) {
    counted_end = std::clamp<int64_t>(r.valid_rows, begin, end);
    const int64_t slots = r.slots;
    const int64_t stride = r.load_stride;
    if (counted_end == begin) {
      // No valid row in this chunk: nothing to count.
    } else if (counting == Counting::kHistogram || counting == Counting::kHistogramAtomic) {
      c10::SmallVector<int64_t, 1024> histogram(static_cast<size_t>(slots), 0);
      int64_t* hist = histogram.data();
      run_rows<kMap, true>(begin, counted_end, top_k, offset, ids, out, lookup, slots,
                           [hist](int64_t slot) { ++hist[slot]; });
      const bool atomic = counting == Counting::kHistogramAtomic;
      for (int64_t s = 0; s < slots; ++s) {
        if (hist[s] == 0) continue;
        load_t* cell = load + s * stride;
        // Counters wrap modulo their width, exactly as repeated increments would.
        if (atomic) {
          __atomic_fetch_add(cell, static_cast<load_t>(hist[s]), __ATOMIC_RELAXED);
        } else {
          *cell = wrapping_add(*cell, hist[s]);
        }
      }
    } else if (counting == Counting::kAtomic) {
      run_rows<kMap, true>(begin, counted_end, top_k, offset, ids, out, lookup, slots,
                           [load, stride](int64_t slot) {
                             __atomic_fetch_add(load + slot * stride, static_cast<load_t>(1),
                                                __ATOMIC_RELAXED);
                           });
    } else {
      run_rows<kMap, true>(begin, counted_end, top_k, offset, ids, out, lookup, slots,
                           [load, stride](int64_t slot) {
                             load_t* cell = load + slot * stride;
                             *cell = wrapping_add(*cell, 1);
                           });
    }
  }
  if constexpr (kMap) {
    // Padding rows (and every row when not recording) are mapped but not counted.
    run_rows<true, false>(counted_end, end, top_k, offset, ids, out, lookup, 0, [](int64_t) {});
  }
}

template <bool kMap, bool kRecord, typename id_t, typename load_t, typename Lookup>
void run(const id_t* ids, id_t* out, const Lookup& lookup, int64_t rows, int64_t top_k,
         int64_t offset, load_t* load, const RecordArgs& r, bool large) {
  const int64_t elements = rows * top_k;
  if (elements < 2 * kParallelGrain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    run_chunk<kMap, kRecord>(0, rows, top_k, offset, ids, out, lookup, load, r,
                             large ? Counting::kHistogram : Counting::kDirect);
    return;
  }
  const int64_t grain_rows = std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(1, top_k));
  at::parallel_for(0, rows, grain_rows, [&](int64_t begin, int64_t end) {
    // A private histogram per chunk, folded in with P atomics, unless P outnumbers its pairs.
    run_chunk<kMap, kRecord>(
        begin, end, top_k, offset, ids, out, lookup, load, r,
        r.slots <= kParallelGrain ? Counting::kHistogramAtomic : Counting::kAtomic);
  });
}

// Input checks: the same checks, in the same order, with the same messages as
// eplb_graph/ops/checks.py (the fake and reference kernels), so that every kernel rejects an input
// with the same error. Everything is checked before anything is read or written.

void check_index_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(is_index_type(t.scalar_type()), what, " should be int32 or int64, got ",
              dtype_name(t.scalar_type()));
}

void check_map_tensors(const at::Tensor& ids, const at::Tensor& log2phy,
                       const at::Tensor& replica_count, const at::Tensor& offset) {
  TORCH_CHECK(ids.dim() == 2, "topk_ids should be a 2d tensor [T, K], got ", ids.dim(), "D");
  check_index_dtype(ids, "topk_ids");
  TORCH_CHECK(log2phy.dim() == 2, "log2phy should be a 2d tensor [N, R], got ", log2phy.dim(), "D");
  check_index_dtype(log2phy, "log2phy");
  TORCH_CHECK(log2phy.size(0) >= 1 && log2phy.size(1) >= 1,
              "log2phy should have at least one expert and one replica column, got ",
              log2phy.sizes());
  TORCH_CHECK(replica_count.dim() == 1, "replica_count should be a 1d tensor [N], got ",
              replica_count.dim(), "D");
  check_index_dtype(replica_count, "replica_count");
  TORCH_CHECK(replica_count.size(0) == log2phy.size(0), "replica_count has ",
              replica_count.size(0), " experts but log2phy has ", log2phy.size(0));
  TORCH_CHECK(offset.dim() == 0, "offset should be a 0-d tensor, got ", offset.dim(), "D");
  TORCH_CHECK(offset.scalar_type() == at::kLong, "offset should be int64, got ",
              dtype_name(offset.scalar_type()));
}

// A counter per slot: at least one slot and one memory cell per slot (a stride-0 view would put
// every count in one cell).
void check_load(const at::Tensor& load) {
  TORCH_CHECK(load.dim() == 1, "load should be a 1d tensor [P], got ", load.dim(), "D");
  check_index_dtype(load, "load");
  TORCH_CHECK(load.size(0) >= 1, "load should have at least one slot, got 0");
  TORCH_CHECK(load.size(0) == 1 || load.stride(0) != 0,
              "load has several slots in one memory cell (stride 0, e.g. from expand()); pass a "
              "tensor with one element per slot (clone() it)");
}

void check_step_flags(const at::Tensor& num_valid_tokens, const at::Tensor& record_enabled) {
  TORCH_CHECK(num_valid_tokens.dim() == 0, "num_valid_tokens should be a 0-d tensor, got ",
              num_valid_tokens.dim(), "D");
  const auto type = num_valid_tokens.scalar_type();
  TORCH_CHECK(type == at::kByte || type == at::kChar || type == at::kShort || type == at::kInt ||
                  type == at::kLong,
              "num_valid_tokens should be an integer tensor, got ", dtype_name(type));
  TORCH_CHECK(record_enabled.dim() == 0, "record_enabled should be a 0-d tensor, got ",
              record_enabled.dim(), "D");
  TORCH_CHECK(record_enabled.scalar_type() == at::kBool,
              "record_enabled should be a bool tensor, got ",
              dtype_name(record_enabled.scalar_type()));
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor for the native CPU kernel, got ",
              t.device());
}

// True when a and b are views of one storage whose byte ranges intersect (checks.py's _overlaps).
// The address test comes first: it is a few compares, and on one storage it is the same test.
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const char* first = static_cast<const char*>(t.const_data_ptr());
    return std::make_pair(first, first + (last + 1) * static_cast<int64_t>(t.element_size()));
  };
  const auto [a_begin, a_end] = span(a);
  const auto [b_begin, b_end] = span(b);
  return a_begin < b_end && b_begin < a_end && a.is_alias_of(b);
}

using NamedInputs = std::initializer_list<std::pair<const char*, const at::Tensor*>>;

// The op writes load while it reads its other inputs: load must not overlap any of them.
void check_load_is_private(const at::Tensor& load, NamedInputs read_only) {
  for (const auto& [name, tensor] : read_only) {
    TORCH_CHECK(!overlaps(load, *tensor), "load shares memory with ", name,
                "; the op writes load while it reads ", name,
                ", so give load its own storage (clone() it)");
  }
}

MapArgs make_map_args(const at::Tensor& ids, const at::Tensor& log2phy,
                      const at::Tensor& replica_count, const at::Tensor& offset) {
  return MapArgs{ids.size(0),
                 ids.size(1),
                 log2phy.size(0),
                 log2phy.size(1),
                 log2phy.stride(0),
                 log2phy.stride(1),
                 replica_count.stride(0),
                 *offset.const_data_ptr<int64_t>()};
}

RecordArgs make_record_args(const at::Tensor& load, const at::Tensor& num_valid_tokens,
                            const at::Tensor& record_enabled) {
  return RecordArgs{*record_enabled.const_data_ptr<bool>(), read_integer_scalar(num_valid_tokens),
                    load.size(0), load.stride(0)};
}

// Calls `body(lookup, large)` with the fastest lookup that is exact for these inputs, whose
// output has type out_t.
template <typename out_t, typename tab_t, typename cnt_t, typename F>
void with_lookup(const tab_t* table, const cnt_t* count, const MapArgs& m, int64_t slots,
                 F&& body) {
  const int64_t elements = m.rows * m.top_k;
  const bool large = elements >= kPrecomputeMin && elements >= 2 * (m.experts + slots);
  if (large) {
    c10::SmallVector<FastExpert, 512> experts;
    c10::SmallVector<int64_t, 2048> resolved;
    if (make_fast_tables<out_t>(table, count, m, elements, experts, resolved)) {
      body(FastLookup{experts.data(), resolved.data(), m.experts, m.width - 1}, true);
      return;
    }
  }
  body(DirectLookup<out_t, tab_t, cnt_t>{table, count, m.experts, m.width, m.table_row_stride,
                                         m.table_col_stride, m.count_stride},
       large);
}

at::Tensor new_output(const at::Tensor& ids) {
  // Every element is written below, so the deterministic-fill of at::empty is not needed.
  return at::detail::empty_cpu({ids.size(0), ids.size(1)}, ids.scalar_type(),
                               /*pin_memory=*/false);
}

template <bool kRecord>
at::Tensor map_impl(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                    const at::Tensor& replica_count, const at::Tensor& offset, at::Tensor* load,
                    const RecordArgs& r) {
  const MapArgs m = make_map_args(topk_ids, log2phy, replica_count, offset);
  const at::Tensor ids = topk_ids.contiguous();
  at::Tensor out = new_output(ids);
  dispatch_index_type(ids.scalar_type(), "topk_ids", [&](auto id_tag) {
    using id_t = decltype(id_tag);
    dispatch_index_type(log2phy.scalar_type(), "log2phy", [&](auto tab_tag) {
      using tab_t = decltype(tab_tag);
      dispatch_index_type(replica_count.scalar_type(), "replica_count", [&](auto cnt_tag) {
        using cnt_t = decltype(cnt_tag);
        const id_t* in = ids.const_data_ptr<id_t>();
        id_t* dst = out.mutable_data_ptr<id_t>();
        const tab_t* table = log2phy.const_data_ptr<tab_t>();
        const cnt_t* count = replica_count.const_data_ptr<cnt_t>();
        with_lookup<id_t>(table, count, m, kRecord ? r.slots : 0, [&](const auto& lookup,
                                                                      bool large) {
          if constexpr (kRecord) {
            dispatch_index_type(load->scalar_type(), "load", [&](auto load_tag) {
              using load_t = decltype(load_tag);
              run<true, true>(in, dst, lookup, m.rows, m.top_k, m.offset,
                              load->mutable_data_ptr<load_t>(), r, large);
            });
          } else {
            run<true, false>(in, dst, lookup, m.rows, m.top_k, m.offset,
                             static_cast<int64_t*>(nullptr), r, large);
          }
        });
      });
    });
  });
  return out;
}

at::Tensor map_to_physical_cpu(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                               const at::Tensor& replica_count, const at::Tensor& offset) {
  check_map_tensors(topk_ids, log2phy, replica_count, offset);
  check_cpu(topk_ids, "topk_ids");
  check_cpu(log2phy, "log2phy");
  check_cpu(replica_count, "replica_count");
  check_cpu(offset, "offset");
  return map_impl<false>(topk_ids, log2phy, replica_count, offset, nullptr,
                         RecordArgs{false, 0, 0, 1});
}

void record_load_cpu(at::Tensor& load, const at::Tensor& physical_ids,
                     const at::Tensor& num_valid_tokens, const at::Tensor& record_enabled) {
  check_load(load);
  TORCH_CHECK(physical_ids.dim() == 2, "physical_ids should be a 2d tensor [T, K], got ",
              physical_ids.dim(), "D");
  check_index_dtype(physical_ids, "physical_ids");
  check_step_flags(num_valid_tokens, record_enabled);
  check_cpu(load, "load");
  check_cpu(physical_ids, "physical_ids");
  check_cpu(num_valid_tokens, "num_valid_tokens");
  check_cpu(record_enabled, "record_enabled");
  check_load_is_private(load, {{"physical_ids", &physical_ids},
                               {"num_valid_tokens", &num_valid_tokens},
                               {"record_enabled", &record_enabled}});
  const RecordArgs r = make_record_args(load, num_valid_tokens, record_enabled);
  if (!r.enabled) return;
  const at::Tensor ids = physical_ids.contiguous();
  const int64_t elements = ids.numel();
  const bool large = elements >= kPrecomputeMin && elements >= 2 * r.slots;
  dispatch_index_type(ids.scalar_type(), "physical_ids", [&](auto id_tag) {
    using id_t = decltype(id_tag);
    dispatch_index_type(load.scalar_type(), "load", [&](auto load_tag) {
      using load_t = decltype(load_tag);
      run<false, true>(ids.const_data_ptr<id_t>(), static_cast<id_t*>(nullptr), IdentityLookup{},
                       ids.size(0), ids.size(1), 0, load.mutable_data_ptr<load_t>(), r, large);
    });
  });
}

at::Tensor map_and_record_cpu(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                              const at::Tensor& replica_count, const at::Tensor& offset,
                              at::Tensor& load, const at::Tensor& num_valid_tokens,
                              const at::Tensor& record_enabled) {
  check_map_tensors(topk_ids, log2phy, replica_count, offset);
  check_load(load);
  check_step_flags(num_valid_tokens, record_enabled);
  check_cpu(topk_ids, "topk_ids");
  check_cpu(log2phy, "log2phy");
  check_cpu(replica_count, "replica_count");
  check_cpu(offset, "offset");
  check_cpu(load, "load");
  check_cpu(num_valid_tokens, "num_valid_tokens");
  check_cpu(record_enabled, "record_enabled");
  check_load_is_private(load, {{"topk_ids", &topk_ids},
                               {"log2phy", &log2phy},
                               {"replica_count", &replica_count},
                               {"offset", &offset},
                               {"num_valid_tokens", &num_valid_tokens},
                               {"record_enabled", &record_enabled}});
  const RecordArgs r = make_record_args(load, num_valid_tokens, record_enabled);
  if (!r.enabled) {
    return map_impl<false>(topk_ids, log2phy, replica_count, offset, nullptr, r);
  }
  return map_impl<true>(topk_ids, log2phy, replica_count, offset, &load, r);
}

}  // namespace

TORCH_LIBRARY_IMPL(eplb_graph, CPU, m) {
  m.impl("map_to_physical", &map_to_physical_cpu);
  m.impl("record_load", &record_load_cpu);
  m.impl("map_and_record", &map_and_record_cpu);
}
