// Fused CPU kernels for torch.ops.eplb_graph.{map_to_physical, record_load, map_and_record}.
//
// Why native: the ATen reference composes about a dozen full passes (casts, where, remainder,
// two gathers, scatter_add); on CPU each pass re-reads T*K elements and pays a dispatch. This
// kernel makes one pass per (t, k): hash once per row, gather count and table entry, record.
// Semantics are exactly those of custom_ops/reference.py, which stays the oracle.
//
// The schemas are defined from Python (custom_ops/_library.py) so the ops exist even when no
// compiler is present; this file only registers CPU implementations for them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr uint32_t kGoldenHash = 2654435769u;
// Below this many (t, k) pairs a single thread wins: thread wake-up costs more than the work.
constexpr int64_t kParallelGrain = 16384;

inline uint32_t replica_hash(int64_t row, int64_t offset) {
  // (row + offset) mod 2^32, then the product mod 2^32: unsigned arithmetic wraps by definition.
  const uint32_t x = static_cast<uint32_t>(static_cast<uint64_t>(row) + static_cast<uint64_t>(offset));
  return x * kGoldenHash;
}

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
      TORCH_CHECK(false, what, " should be int32 or int64, got ", type);
  }
}

void check_index_dtype(const at::Tensor& t, const char* what) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kInt || type == at::kLong, what, " should be int32 or int64, got ", type);
}

int64_t read_integer_scalar(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 0, what, " should be a 0-d tensor, got ", t.dim(), "D");
  // The same set as custom_ops/_checks.py, so eager CPU and compiled graphs accept alike.
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kByte || type == at::kChar || type == at::kShort || type == at::kInt ||
                  type == at::kLong,
              what, " should be an integer tensor, got ", type);
  return t.item<int64_t>();  // CPU memory: a plain load, not a device sync.
}

struct MapArgs {
  int64_t rows, top_k, experts, width, table_row_stride, table_col_stride, count_stride, offset;
};

struct RecordArgs {
  bool enabled;
  int64_t valid_rows, slots, load_stride;
};

// One (t, k) element: logical id -> physical slot, -1 for an invalid id.
template <typename tab_t, typename cnt_t>
inline int64_t lookup_one(int64_t expert, uint32_t hash, const tab_t* table, const cnt_t* count,
                          const MapArgs& a) {
  if (expert < 0 || expert >= a.experts) return -1;
  int64_t c = static_cast<int64_t>(count[expert * a.count_stride]);
  if (c < 1) c = 1;
  int64_t replica = static_cast<int64_t>(hash % static_cast<uint64_t>(c));
  if (replica >= a.width) replica = a.width - 1;
  const tab_t* row = table + expert * a.table_row_stride;
  int64_t slot = static_cast<int64_t>(row[replica * a.table_col_stride]);
  // Torn refresh (new count, old row): replica 0 is populated in every valid row.
  if (slot < 0) slot = static_cast<int64_t>(row[0]);
  return slot;
}

template <typename id_t, typename tab_t, typename cnt_t, typename load_t, bool kMap, bool kRecord>
void run_rows(int64_t row_begin, int64_t row_end, const id_t* ids, id_t* out, const tab_t* table,
              const cnt_t* count, const MapArgs& m, load_t* load, const RecordArgs& r,
              bool atomic) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const uint32_t hash = kMap ? replica_hash(t, m.offset) : 0u;
    const bool record_row = kRecord && r.enabled && t < r.valid_rows;
    for (int64_t k = 0; k < m.top_k; ++k) {
      const int64_t i = t * m.top_k + k;
      int64_t slot;
      if constexpr (kMap) {
        slot = lookup_one(static_cast<int64_t>(ids[i]), hash, table, count, m);
        out[i] = static_cast<id_t>(slot);
      } else {
        slot = static_cast<int64_t>(ids[i]);
      }
      if (record_row && slot >= 0 && slot < r.slots) {
        load_t* cell = load + slot * r.load_stride;
        if (atomic) {
          __atomic_fetch_add(cell, static_cast<load_t>(1), __ATOMIC_RELAXED);
        } else {
          *cell += 1;
        }
      }
    }
  }
}

template <typename id_t, typename tab_t, typename cnt_t, typename load_t, bool kMap, bool kRecord>
void run(const id_t* ids, id_t* out, const tab_t* table, const cnt_t* count, const MapArgs& m,
         load_t* load, const RecordArgs& r) {
  const int64_t elements = m.rows * m.top_k;
  if (elements < kParallelGrain || at::get_num_threads() == 1) {
    run_rows<id_t, tab_t, cnt_t, load_t, kMap, kRecord>(0, m.rows, ids, out, table, count, m, load,
                                                        r, /*atomic=*/false);
    return;
  }
  const int64_t grain_rows = std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(1, m.top_k));
  at::parallel_for(0, m.rows, grain_rows, [&](int64_t begin, int64_t end) {
    run_rows<id_t, tab_t, cnt_t, load_t, kMap, kRecord>(begin, end, ids, out, table, count, m, load,
                                                        r, /*atomic=*/true);
  });
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor for the native CPU kernel, got ",
              t.device());
}

MapArgs make_map_args(const at::Tensor& ids, const at::Tensor& log2phy,
                      const at::Tensor& replica_count, const at::Tensor& offset) {
  TORCH_CHECK(ids.dim() == 2, "topk_ids should be a 2d tensor [T, K], got ", ids.dim(), "D");
  TORCH_CHECK(log2phy.dim() == 2, "log2phy should be a 2d tensor [N, R], got ", log2phy.dim(), "D");
  TORCH_CHECK(log2phy.size(0) >= 1 && log2phy.size(1) >= 1,
              "log2phy should have at least one expert and one replica column, got ",
              log2phy.sizes());
  TORCH_CHECK(replica_count.dim() == 1, "replica_count should be a 1d tensor [N], got ",
              replica_count.dim(), "D");
  TORCH_CHECK(replica_count.size(0) == log2phy.size(0), "replica_count has ",
              replica_count.size(0), " experts but log2phy has ", log2phy.size(0));
  TORCH_CHECK(offset.dim() == 0, "offset should be a 0-d tensor, got ", offset.dim(), "D");
  TORCH_CHECK(offset.scalar_type() == at::kLong, "offset should be int64, got ",
              offset.scalar_type());
  check_cpu(ids, "topk_ids");
  check_cpu(log2phy, "log2phy");
  check_cpu(replica_count, "replica_count");
  check_cpu(offset, "offset");
  return MapArgs{ids.size(0),          ids.size(1),           log2phy.size(0),
                 log2phy.size(1),      log2phy.stride(0),     log2phy.stride(1),
                 replica_count.stride(0), offset.item<int64_t>()};
}

RecordArgs make_record_args(const at::Tensor& load, const at::Tensor& num_valid_tokens,
                            const at::Tensor& record_enabled) {
  TORCH_CHECK(load.dim() == 1, "load should be a 1d tensor [P], got ", load.dim(), "D");
  check_index_dtype(load, "load");
  TORCH_CHECK(record_enabled.dim() == 0, "record_enabled should be a 0-d tensor, got ",
              record_enabled.dim(), "D");
  TORCH_CHECK(record_enabled.scalar_type() == at::kBool, "record_enabled should be a bool tensor, got ",
              record_enabled.scalar_type());
  check_cpu(load, "load");
  check_cpu(num_valid_tokens, "num_valid_tokens");
  check_cpu(record_enabled, "record_enabled");
  return RecordArgs{record_enabled.item<bool>(),
                    read_integer_scalar(num_valid_tokens, "num_valid_tokens"), load.size(0),
                    load.stride(0)};
}

template <bool kRecord>
at::Tensor map_impl(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                    const at::Tensor& replica_count, const at::Tensor& offset, at::Tensor* load,
                    const RecordArgs& r) {
  const MapArgs m = make_map_args(topk_ids, log2phy, replica_count, offset);
  const at::Tensor ids = topk_ids.contiguous();
  at::Tensor out = at::empty_like(ids);
  dispatch_index_type(ids.scalar_type(), "topk_ids", [&](auto id_tag) {
    using id_t = decltype(id_tag);
    dispatch_index_type(log2phy.scalar_type(), "log2phy", [&](auto tab_tag) {
      using tab_t = decltype(tab_tag);
      dispatch_index_type(replica_count.scalar_type(), "replica_count", [&](auto cnt_tag) {
        using cnt_t = decltype(cnt_tag);
        if constexpr (kRecord) {
          dispatch_index_type(load->scalar_type(), "load", [&](auto load_tag) {
            using load_t = decltype(load_tag);
            run<id_t, tab_t, cnt_t, load_t, true, true>(
                ids.data_ptr<id_t>(), out.data_ptr<id_t>(), log2phy.data_ptr<tab_t>(),
                replica_count.data_ptr<cnt_t>(), m, load->data_ptr<load_t>(), r);
          });
        } else {
          run<id_t, tab_t, cnt_t, int64_t, true, false>(
              ids.data_ptr<id_t>(), out.data_ptr<id_t>(), log2phy.data_ptr<tab_t>(),
              replica_count.data_ptr<cnt_t>(), m, nullptr, r);
        }
      });
    });
  });
  return out;
}

at::Tensor map_to_physical_cpu(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                               const at::Tensor& replica_count, const at::Tensor& offset) {
  return map_impl<false>(topk_ids, log2phy, replica_count, offset, nullptr,
                         RecordArgs{false, 0, 0, 1});
}

void record_load_cpu(at::Tensor& load, const at::Tensor& physical_ids,
                     const at::Tensor& num_valid_tokens, const at::Tensor& record_enabled) {
  const RecordArgs r = make_record_args(load, num_valid_tokens, record_enabled);
  TORCH_CHECK(physical_ids.dim() == 2, "physical_ids should be a 2d tensor [T, K], got ",
              physical_ids.dim(), "D");
  check_index_dtype(physical_ids, "physical_ids");
  check_cpu(physical_ids, "physical_ids");
  if (!r.enabled) return;
  const at::Tensor ids = physical_ids.contiguous();
  const MapArgs m{ids.size(0), ids.size(1), 0, 1, 0, 0, 0, 0};
  dispatch_index_type(ids.scalar_type(), "physical_ids", [&](auto id_tag) {
    using id_t = decltype(id_tag);
    dispatch_index_type(load.scalar_type(), "load", [&](auto load_tag) {
      using load_t = decltype(load_tag);
      run<id_t, int64_t, int64_t, load_t, false, true>(ids.data_ptr<id_t>(), nullptr, nullptr,
                                                       nullptr, m, load.data_ptr<load_t>(), r);
    });
  });
}

at::Tensor map_and_record_cpu(const at::Tensor& topk_ids, const at::Tensor& log2phy,
                              const at::Tensor& replica_count, const at::Tensor& offset,
                              at::Tensor& load, const at::Tensor& num_valid_tokens,
                              const at::Tensor& record_enabled) {
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
