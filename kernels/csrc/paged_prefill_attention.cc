// CPU paged prefill attention: causal flash attention of a chunk's queries (a prefill
// chunk's, or a decode step's one per sequence) over each sequence's K/V read straight from
// the paged pool, as an XLA FFI custom call.
//
// Why this exists (docs/prefill.md, "The CPU attention kernel, and why we wrote one"):
// XLA:CPU runs a blockwise attention as separate thunks per block (two dots, a max, an
// exp/sum, a rescale), each split over the cores and each writing its f32 scores out and
// reading them back; on the 2-core CI machines that is ~2x a fused kernel's time. Here one
// work item (sequence, KV head, QT query positions x G query heads) keeps its query tile,
// scores and output in L1/L2 and walks the key blocks with an online softmax, K and V read
// in place from the pool; items run on XLA's own intra-op thread pool. No maintained CPU
// flash-attention kernel is callable from XLA: XLA:CPU has none, and PyTorch's would pull
// torch into the serving environment.
//
// Built on first use by kernels/cpu_attention.py with -march=native on the machine that
// runs it; the pure-JAX reference is kernels.paged_attention.paged_attention_reference.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Query positions per work item (fewer when the call has fewer: a decode step's one); x G
// heads, rounded up to whole vectors: R rows.
constexpr int QT = 64;
constexpr int KB = 64;  // keys per block
constexpr float kMasked = -std::numeric_limits<float>::infinity();

// A brace list, not `(v16){} + x`: the add (0 + x is not folded for floats) made every
// broadcast a scalar add plus a register shuffle competing with the FMAs for a port.
inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline v16i loadi(const int32_t* p) {
  v16i v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16i splati(int32_t x) { return (v16i){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// exp(x) for x <= 0 (a score minus its row's running max): 2^n * p(f), degree-6 Taylor
// of 2^f on [-0.5, 0.5] (relative error ~2e-7, below f32 rounding of the argument).
inline v16 vexp(v16 x) {
  v16 y = x * 1.4426950408889634f;
  v16 lo = splat(-126.f);
  y = y < lo ? lo : y;
  v16 n = (y + 12582912.f) - 12582912.f;  // round to nearest (needs no -ffast-math)
  v16 f = (y - n) * 0.6931471805599453f;
  v16 p = splat(1.f / 720);
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  v16 out = p * scale;
  return x == splat(kMasked) ? splat(0.f) : out;
}

struct Shapes {
  int64_t b, t, hq, d, pages, page_size, row, width, hkv, group;
  int64_t qt, rows;  // query positions per item, and its rows (qt * group, whole vectors)
};

struct Args {
  Shapes s;
  const float* q;          // [B, T, Hq, D]
  const float* k;          // [P, page_size, row]: the layer's slice of the pool
  const float* v;
  const int32_t* pos;      // [B, T], -1 padding
  const int32_t* table;    // [B, width]
  float* out;              // [B, T, Hq, D]
  float scale;
};

// Where key `key` of KV head h starts in the layer's slice of the pool. The page id is
// clipped to the pool, as XLA's gather with mode="clip": a bad table cannot read outside it.
inline int64_t key_offset(const Shapes& s, const int32_t* table, int64_t key, int64_t h, int d) {
  const int64_t page = std::clamp<int64_t>(table[key / s.page_size], 0, s.pages - 1);
  return (page * s.page_size + key % s.page_size) * s.row + h * d;
}

// Per-thread tiles, transposed so a vector holds 16 query rows (row r = tq * G + g):
// Q^T [D, R], O^T [D, R], S^T / P^T [KB, R]; per row m, l, rescale and position. K and V
// are read in place from the pool: one row pointer per key of the block.
struct Scratch {
  explicit Scratch(const Shapes& s) : rows(s.rows) {
    const int64_t floats = rows * s.d * 2 + KB * rows + rows * 4 + s.d;
    mem.reset(static_cast<float*>(std::aligned_alloc(64, ((floats * 4 + 63) / 64) * 64)));
    float* p = mem.get();
    qt = p, p += rows * s.d;
    ot = p, p += rows * s.d;
    st = p, p += KB * rows;
    m = p, p += rows;
    l = p, p += rows;
    resc = p, p += rows;
    pos = reinterpret_cast<int32_t*>(p), p += rows;
    zero = p;
    std::memset(zero, 0, s.d * sizeof(float));
  }
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  int64_t rows;
  std::unique_ptr<float, Free> mem;
  float *qt, *ot, *st, *m, *l, *resc, *zero;
  int32_t* pos;
  const float* kp[KB];
  const float* vp[KB];
};

// acc[i][c] += s[i] * x[16c .. 16c + 16): the rank-1 update of a 4 x 16NV register tile
// (4 NV accumulators) both products are made of: NV vector loads of x, 4 broadcasts of s.
// NV = 4 (64 rows) for prefill items; NV = 1 where an item has one vector of rows (a decode
// step: G rows), so padding rows cost no FMAs.
template <int NV>
inline void rank1(v16 (&acc)[4][NV], const float* x, const float* s) {
  v16 xs[NV];
  for (int c = 0; c < NV; ++c) xs[c] = load(x + 16 * c);
  for (int i = 0; i < 4; ++i) {
    const v16 b = splat(s[i]);
    for (int c = 0; c < NV; ++c) acc[i][c] += b * xs[c];
  }
}

// S^T[j, r] = K[j, :] . Q^T[:, r]: 4 keys x 16NV rows per micro-tile, the rows' Q^T slice
// (D x 16NV) staying in L1 across the key groups.
template <int D, int NV>
inline void scores(Scratch& w) {
  const int64_t R = w.rows;
  for (int64_t r = 0; r < R; r += 16 * NV)
    for (int j = 0; j < KB; j += 4) {
      v16 acc[4][NV] = {};
      for (int d = 0; d < D; ++d) {
        const float k4[4] = {w.kp[j][d], w.kp[j + 1][d], w.kp[j + 2][d], w.kp[j + 3][d]};
        rank1<NV>(acc, w.qt + d * R + r, k4);
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < NV; ++c) store(w.st + (j + i) * R + r + 16 * c, acc[i][c]);
    }
}

// The online softmax, 16 rows per vector (no horizontal reductions): masks keys past each
// row's position when the block crosses the diagonal, turns S^T into P^T, updates m and l,
// and leaves each row's rescale of O for `values`.
inline void softmax(Scratch& w, int64_t s0, bool diagonal) {
  const int64_t R = w.rows;
  const v16 ninf = splat(kMasked);
  for (int64_t r = 0; r < R; r += 16) {
    v16 mx = ninf;
    if (diagonal) {
      const v16i pr = loadi(w.pos + r);
      for (int j = 0; j < KB; ++j) {
        float* sj = w.st + j * R + r;
        v16 x = splati(static_cast<int32_t>(s0 + j)) <= pr ? load(sj) : ninf;
        store(sj, x);
        mx = x > mx ? x : mx;
      }
    } else {
      for (int j = 0; j < KB; ++j) {
        v16 x = load(w.st + j * R + r);
        mx = x > mx ? x : mx;
      }
    }
    const v16 m_old = load(w.m + r), m_new = mx > m_old ? mx : m_old;
    // A row that has seen no key yet keeps m = -inf: subtract 0 so its P stays 0, not NaN.
    const v16 m_sub = m_new == ninf ? splat(0.f) : m_new;
    v16 sum = {};
    for (int j = 0; j < KB; ++j) {
      float* sj = w.st + j * R + r;
      v16 e = vexp(load(sj) - m_sub);
      store(sj, e);
      sum += e;
    }
    const v16 rescale = vexp(m_old - m_sub);
    store(w.resc + r, rescale);
    store(w.l + r, load(w.l + r) * rescale + sum);
    store(w.m + r, m_new);
  }
}

// O^T[d, r] = O^T[d, r] * rescale[r] + V[:, d] . P^T[:, r]: 4 dims x 16NV rows per
// micro-tile, the rows' P^T slice (KB x 16NV) staying in L1 across the dim groups.
template <int D, int NV>
inline void values(Scratch& w) {
  const int64_t R = w.rows;
  for (int64_t r = 0; r < R; r += 16 * NV)
    for (int d = 0; d < D; d += 4) {
      v16 acc[4][NV] = {};
      for (int j = 0; j < KB; ++j) {
        rank1<NV>(acc, w.st + j * R + r, w.vp[j] + d);
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < NV; ++c) {
          float* o = w.ot + (d + i) * R + r + 16 * c;
          store(o, load(o) * load(w.resc + r + 16 * c) + acc[i][c]);
        }
    }
}

// One work item: sequence b, KV head h, query positions [t0, t0 + s.qt).
template <int D, int NV>
void run_item(const Args& a, Scratch& w, int64_t b, int64_t h, int64_t t0) {
  const Shapes& s = a.s;
  const int64_t g = s.group, nq = std::min<int64_t>(s.qt, s.t - t0), R = w.rows;
  const int32_t* pos = a.pos + b * s.t + t0;
  int32_t pmin = std::numeric_limits<int32_t>::max(), pmax = -1;
  for (int64_t i = 0; i < nq; ++i)
    if (pos[i] >= 0) pmin = std::min(pmin, pos[i]), pmax = std::max(pmax, pos[i]);
  auto out_row = [&](int64_t tq, int64_t gi) {
    return a.out + ((b * s.t + t0 + tq) * s.hq + h * g + gi) * D;
  };
  if (pmax < 0) {  // padding only: zeros, as the XLA path
    for (int64_t tq = 0; tq < nq; ++tq)
      for (int64_t gi = 0; gi < g; ++gi) std::memset(out_row(tq, gi), 0, D * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < R; ++r) {  // rows past the item's queries: masked, never written
    const int64_t tq = r / g, gi = r % g;
    const bool live = tq < nq;
    w.pos[r] = live ? pos[tq] : -1;
    const float* src = a.q + ((b * s.t + t0 + tq) * s.hq + h * g + gi) * D;
    for (int d = 0; d < D; ++d) w.qt[d * R + r] = live ? src[d] * a.scale : 0.f;
  }
  std::fill(w.m, w.m + R, kMasked);
  std::fill(w.l, w.l + R, 0.f);
  std::memset(w.ot, 0, R * D * sizeof(float));
  const int32_t* table = a.table + b * s.width;
  for (int64_t s0 = 0; s0 <= pmax; s0 += KB) {
    // Keys past pmax are seen by none; past the table there are none (clipped, as XLA's
    // gather with mode="clip", so a bad position cannot read outside the pool).
    const int64_t n = std::clamp<int64_t>(
        std::min<int64_t>(pmax + 1, s.width * s.page_size) - s0, 0, KB);
    for (int64_t j = 0; j < KB; ++j) {
      if (j < n) {
        const int64_t off = key_offset(s, table, s0 + j, h, D);
        w.kp[j] = a.k + off, w.vp[j] = a.v + off;
      } else {
        w.kp[j] = w.vp[j] = w.zero;  // masked below: past pmax, so past every position
      }
    }
    scores<D, NV>(w);
    softmax(w, s0, s0 + KB - 1 > pmin);
    values<D, NV>(w);
  }
  for (int64_t tq = 0; tq < nq; ++tq)
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t r = tq * g + gi;
      float* dst = out_row(tq, gi);
      const float inv = pos[tq] >= 0 && w.l[r] > 0 ? 1.f / w.l[r] : 0.f;
      for (int d = 0; d < D; ++d) dst[d] = w.ot[d * R + r] * inv;
    }
}

// The sum of x's 16 lanes, as a tree of halves (a plain loop would be 16 dependent scalar
// adds). Halves by memcpy, which compilers turn into lane extracts: __builtin_shufflevector
// needs GCC 12, and Ubuntu 22.04's g++ is 11.
inline float hsum(v16 x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  const v8 a = lo + hi;
  v4 a0, a1;
  std::memcpy(&a0, &a, sizeof a0);
  std::memcpy(&a1, reinterpret_cast<const char*>(&a) + sizeof a0, sizeof a1);
  const v4 c = a0 + a1;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// A decode item (sequence b, KV head h, one query position): lanes run along head_dim, not
// rows, so no lane is padding: per key, G dot products of D/16 vectors (summed across
// lanes) and G broadcasts into the output rows. `run_item` would hold G live lanes of 16 in
// every FMA (3 for SmolLM2) and broadcast once per FMA. Scratch: Q [G, D], O [G, D], P [G, KB].
template <int D>
void run_decode_item(const Args& a, Scratch& w, int64_t b, int64_t h) {
  constexpr int V = D / 16;
  const Shapes& s = a.s;
  const int64_t g = s.group, p = a.pos[b];
  float* const out = a.out + (b * s.hq + h * g) * D;
  if (p < 0) {  // padding: zeros, as the XLA path
    std::memset(out, 0, g * D * sizeof(float));
    return;
  }
  const float* src = a.q + (b * s.hq + h * g) * D;
  for (int64_t i = 0; i < g * D; ++i) w.qt[i] = src[i] * a.scale;
  std::memset(w.ot, 0, g * D * sizeof(float));
  std::fill(w.m, w.m + g, kMasked);
  std::fill(w.l, w.l + g, 0.f);
  const int32_t* table = a.table + b * s.width;
  // Keys 0..p, clipped to the table (and page ids to the pool), as `run_item`.
  const int64_t keys = std::min<int64_t>(p + 1, s.width * s.page_size);
  for (int64_t s0 = 0; s0 < keys; s0 += KB) {
    const int64_t n = std::min<int64_t>(KB, keys - s0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = key_offset(s, table, s0 + j, h, D);
      w.kp[j] = a.k + off, w.vp[j] = a.v + off;
    }
    for (int64_t j = 0; j < n; ++j) {
      v16 k[V];
      for (int c = 0; c < V; ++c) k[c] = load(w.kp[j] + 16 * c);
      for (int64_t gi = 0; gi < g; ++gi) {
        const float* q = w.qt + gi * D;
        v16 acc = load(q) * k[0];
        for (int c = 1; c < V; ++c) acc += load(q + 16 * c) * k[c];
        w.st[gi * KB + j] = hsum(acc);
      }
    }
    for (int64_t gi = 0; gi < g; ++gi) {  // the online softmax of row gi over this block
      float* sc = w.st + gi * KB;
      std::fill(sc + n, sc + KB, kMasked);
      v16 mx = splat(kMasked);
      for (int j = 0; j < KB; j += 16) {
        const v16 x = load(sc + j);
        mx = x > mx ? x : mx;
      }
      float m_new = w.m[gi];
      for (int i = 0; i < 16; ++i) m_new = std::max(m_new, mx[i]);
      v16 sum = {};
      for (int j = 0; j < KB; j += 16) {
        const v16 e = vexp(load(sc + j) - m_new);
        store(sc + j, e);
        sum += e;
      }
      const float rescale = vexp(splat(w.m[gi] - m_new))[0];
      w.l[gi] = w.l[gi] * rescale + hsum(sum);
      w.m[gi] = m_new;
      float* o = w.ot + gi * D;
      for (int c = 0; c < V; ++c) store(o + 16 * c, load(o + 16 * c) * rescale);
    }
    for (int64_t j = 0; j < n; ++j) {
      v16 v[V];
      for (int c = 0; c < V; ++c) v[c] = load(w.vp[j] + 16 * c);
      for (int64_t gi = 0; gi < g; ++gi) {
        const v16 pj = splat(w.st[gi * KB + j]);
        float* o = w.ot + gi * D;
        for (int c = 0; c < V; ++c) store(o + 16 * c, load(o + 16 * c) + pj * v[c]);
      }
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const float inv = w.l[gi] > 0 ? 1.f / w.l[gi] : 0.f;
    for (int d = 0; d < D; ++d) out[gi * D + d] = w.ot[gi * D + d] * inv;
  }
}

// Work shared by the calling thread and its helpers. Helpers hold it by shared_ptr: one
// that starts after the call returned finds no item left and touches no buffer.
struct Shared {
  explicit Shared(const Args& a, int64_t tiles) : a(a), tiles(tiles) {}
  Args a;
  int64_t tiles;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t active = 0;  // threads between registering and finishing their last item
};

template <int D, int NV>
void work(Shared& sh) {
  const Shapes& s = sh.a.s;
  const int64_t items = s.b * s.hkv * sh.tiles;
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    ++sh.active;  // before claiming: the caller waits for whoever may hold an item
  }
  std::unique_ptr<Scratch> w;
  for (int64_t i; (i = sh.next.fetch_add(1)) < items;) {
    if (!w) w = std::make_unique<Scratch>(s);
    const int64_t b = i / (s.hkv * sh.tiles), h = (i / sh.tiles) % s.hkv;
    if constexpr (D >= 16) {
      if (s.t == 1) {
        run_decode_item<D>(sh.a, *w, b, h);
        continue;
      }
    }
    run_item<D, NV>(sh.a, *w, b, h, (i % sh.tiles) * s.qt);
  }
  std::lock_guard<std::mutex> lock(sh.mu);
  if (--sh.active == 0) sh.cv.notify_all();
}

// The caller works too and then waits only for helpers that registered: never for one that
// has not started (two calls waiting on each other's queued helpers would deadlock a
// pool whose threads they both occupy).
template <int D, int NV>
void run_all(ffi::ThreadPool& pool, const Args& a) {
  const Shapes& s = a.s;
  const int64_t tiles = (s.t + s.qt - 1) / s.qt, items = s.b * s.hkv * tiles;
  auto sh = std::make_shared<Shared>(a, tiles);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { work<D, NV>(*sh); });
  work<D, NV>(*sh);
  std::unique_lock<std::mutex> lock(sh->mu);
  sh->cv.wait(lock, [&] { return sh->active == 0; });
}

template <int NV>
ffi::Error dispatch(ffi::ThreadPool& pool, const Args& a) {
  switch (a.s.d) {
    case 64: run_all<64, NV>(pool, a); break;
    case 128: run_all<128, NV>(pool, a); break;
    case 256: run_all<256, NV>(pool, a); break;
    case 32: run_all<32, NV>(pool, a); break;
    case 16: run_all<16, NV>(pool, a); break;
    case 8: run_all<8, NV>(pool, a); break;
    default:
      return ffi::Error::InvalidArgument("paged prefill attention: head_dim not 8/16/32/64/128/256");
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> page_table,
                ffi::ResultBuffer<ffi::F32> out, float scale, int64_t num_kv_heads) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  auto td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("paged prefill attention: bad ranks or K/V shapes");
  Shapes s{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[3], td[1], num_kv_heads, 0, 0, 0};
  if (s.hkv <= 0 || s.hq % s.hkv || s.hkv * s.d > s.row || td[0] != s.b)
    return ffi::Error::InvalidArgument("paged prefill attention: head counts do not fit the pool");
  s.group = s.hq / s.hkv;
  s.qt = std::max<int64_t>(std::min<int64_t>(QT, s.t), 1);
  s.rows = (s.qt * s.group + 15) / 16 * 16;
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= kd[0]) return ffi::Error::InvalidArgument("paged prefill attention: layer");
  const int64_t stride = s.pages * s.page_size * s.row;
  Args a{s, q.typed_data(), k.typed_data() + li * stride, v.typed_data() + li * stride,
         positions.typed_data(), page_table.typed_data(), out->typed_data(), scale};
  // Items of whole 64-row micro-tiles (prefill: 64 x G rows) or of 16-row ones.
  return s.rows % 64 ? dispatch<1>(pool, a) : dispatch<4>(pool, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MegaservePagedPrefillAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("num_kv_heads"));
