// Decode attention over a ragged KV cache: one query token per row, each row reading its own
// cache only up to its own length. See hisr_core/decode_attention.py.
//
// Decoding many rows at once on a CPU is bound by reading the cache. PyTorch's SDPA reads every
// row up to the longest (or needs one call per range of rows), and in bfloat16 is bound by
// converting, not by reading. This kernel reads each (row, KV head) once, up to the row's own
// length: scores of its G query heads against the keys, softmax, then the values, in float32
// whatever the cache stores (float32 or bfloat16).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// A cache column of D values as D/16 float32 vectors. float32 in order; bfloat16 as two
// vectors per 32 values, the even ones and the odd ones (each bfloat16 is the high half of a
// float32: the odd ones are a mask away, the even ones a shift). Dot products do not care about
// order as long as the query is permuted alike (lane_of).
template <typename T, int D>
struct Column;

template <int D>
struct Column<float, D> {
  static void load(const float* p, __m512* out) {
    for (int c = 0; c < D / 16; ++c) out[c] = _mm512_loadu_ps(p + c * 16);
  }
  static int lane_of(int c, int i) { return c * 16 + i; }
};

template <int D>
struct Column<at::BFloat16, D> {
  static void load(const at::BFloat16* p, __m512* out) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int b = 0; b < D / 32; ++b) {
      const __m512i x = _mm512_loadu_si512(p + b * 32);
      out[2 * b] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      out[2 * b + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
    }
  }
  static int lane_of(int c, int i) { return (c / 2) * 32 + 2 * i + (c % 2); }
};

// Lane k of the result: the sum of the 16 lanes of v[k] (a transpose-and-add tree: 45
// shuffles and adds for 16 sums, against 8 each one at a time).
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// exp(x) for x <= 0 (scores minus their maximum): 2^n · p(r), r = x - n ln 2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error ~2e-7); below -87 the result is 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Ask for the cache lines of a column ahead of the one being read. One (row, KV head) streams a
// few KB to a few hundred KB, too short for the hardware prefetcher alone to keep enough reads
// in flight: asking 4 KB ahead read the cache 10-25% faster (float32 and bfloat16, 2-core
// CPU). A prefetch past the end of the cache is harmless (it never faults).
constexpr int64_t kPrefetchBytes = 4096;

template <typename T, int D>
inline void prefetch_ahead(const T* column) {
  constexpr int64_t columns = std::max<int64_t>(1, kPrefetchBytes / (sizeof(T) * D));
  // Integer arithmetic: the address may lie past the tensor, which a pointer may not.
  const auto p = reinterpret_cast<uintptr_t>(column) + columns * D * sizeof(T);
  for (int i = 0; i < static_cast<int>(sizeof(T) * D + 63) / 64; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T0);
}

// One (row, KV head): out[g] = softmax(scale * q[g] · K[:len]) · V[:len] for its G query heads.
// q, out: [G, D] float32; k, v: [len, D] (rows D apart); s: room for G * len + 16 floats, the
// scores column by column (s[j * G + g]).
template <typename T, int D, int G>
void attend_one(const float* __restrict q, const T* __restrict k, const T* __restrict v,
                float* __restrict out, int64_t len, float scale, float* __restrict s) {
  using Col = Column<T, D>;
  constexpr int C = D / 16, B = 16 / G;  // vectors a column; columns a block of 16 scores
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      alignas(64) float lanes[16];
      for (int i = 0; i < 16; ++i) lanes[i] = q[g * D + Col::lane_of(c, i)] * scale;
      qv[g][c] = _mm512_load_ps(lanes);
    }
  __m512 top = _mm512_set1_ps(-INFINITY);
  const int64_t blocked = len / B * B;
  for (int64_t j0 = 0; j0 < blocked; j0 += B) {
    __m512 part[16];
    for (int b = 0; b < B; ++b) {
      __m512 kj[C];
      prefetch_ahead<T, D>(k + (j0 + b) * D);
      Col::load(k + (j0 + b) * D, kj);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kj[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kj[c], acc);
        part[b * G + g] = acc;
      }
    }
    const __m512 x = sum16(part);
    _mm512_storeu_ps(s + j0 * G, x);
    top = _mm512_max_ps(top, x);
  }
  alignas(64) float tops[16];
  _mm512_store_ps(tops, top);
  float m[G];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    for (int i = g; i < 16; i += G) m[g] = std::max(m[g], tops[i]);
  }
  for (int64_t j = blocked; j < len; ++j) {
    __m512 kj[C];
    Col::load(k + j * D, kj);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kj[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kj[c], acc);
      s[j * G + g] = _mm512_reduce_add_ps(acc);
      m[g] = std::max(m[g], s[j * G + g]);
    }
  }
  // Softmax numerators in place; lane i of a block holds head i % G.
  for (int i = 0; i < 16; ++i) tops[i] = m[i % G];
  const __m512 shift = _mm512_load_ps(tops);
  __m512 total = _mm512_setzero_ps();
  const int64_t n = len * G, vec = n / 16 * 16;
  for (int64_t i = 0; i < vec; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift));
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  alignas(64) float totals[16];
  _mm512_store_ps(totals, total);
  float sum[G] = {};
  for (int i = 0; i < 16; ++i) sum[i % G] += totals[i];
  for (int64_t i = vec; i < n; ++i) {
    s[i] = std::exp(s[i] - m[i % G]);
    sum[i % G] += s[i];
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    __m512 vj[C];
    prefetch_ahead<T, D>(v + j * D);
    Col::load(v + j * D, vj);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[j * G + g]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vj[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(1.f / sum[g])));
      for (int i = 0; i < 16; ++i) out[g * D + Col::lane_of(c, i)] = lanes[i];
    }
}

template <typename T, int D, int G>
void attend_all(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const torch::Tensor& rows, const torch::Tensor& lengths, torch::Tensor& out,
                double scale) {
  const int64_t n_rows = q.size(0), heads = q.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t longest = n_rows ? *std::max_element(lp, lp + n_rows) : 0;
  const int64_t items = n_rows * heads;
  // Rows differ in length: threads take (row, head) items one at a time, not equal shares.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> s(G * longest + 16);
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t r = i / heads, h = i % heads, row = rp[r];
      attend_one<T, D, G>(qp + i * G * D, kp + row * k.stride(0) + h * k.stride(1),
                          vp + row * v.stride(0) + h * v.stride(1), op + i * G * D, lp[r],
                          static_cast<float>(scale), s.data());
    }
  });
}

template <typename T, int D>
bool dispatch_g(int64_t g, const torch::Tensor& q, const torch::Tensor& k,
                const torch::Tensor& v, const torch::Tensor& rows, const torch::Tensor& lengths,
                torch::Tensor& out, double scale) {
  switch (g) {
    case 1: attend_all<T, D, 1>(q, k, v, rows, lengths, out, scale); return true;
    case 2: attend_all<T, D, 2>(q, k, v, rows, lengths, out, scale); return true;
    case 4: attend_all<T, D, 4>(q, k, v, rows, lengths, out, scale); return true;
    case 8: attend_all<T, D, 8>(q, k, v, rows, lengths, out, scale); return true;
    default: return false;
  }
}

template <typename T>
bool dispatch(int64_t d, int64_t g, const torch::Tensor& q, const torch::Tensor& k,
              const torch::Tensor& v, const torch::Tensor& rows, const torch::Tensor& lengths,
              torch::Tensor& out, double scale) {
  switch (d) {
    case 32: return dispatch_g<T, 32>(g, q, k, v, rows, lengths, out, scale);
    case 64: return dispatch_g<T, 64>(g, q, k, v, rows, lengths, out, scale);
    case 128: return dispatch_g<T, 128>(g, q, k, v, rows, lengths, out, scale);
    default: return false;
  }
}

}  // namespace

bool vectorized() { return true; }

#else

bool vectorized() { return false; }

#endif

// Whether decode() serves head size d, g query heads per KV head and a cache of this dtype.
bool supports(int64_t d, int64_t g, const std::string& dtype) {
  return vectorized() && (d == 32 || d == 64 || d == 128) && (g == 1 || g == 2 || g == 4 || g == 8)
      && (dtype == "float32" || dtype == "bfloat16");
}

// q [R, H_kv, G, D] float32; k, v [N, H_kv, S, D] (float32 or bfloat16, the last two dims
// contiguous); rows [R] int64: the cache row each query row reads; lengths [R] int64: the
// columns it reads, 1..S. Returns [R, H_kv, G, D] float32.
torch::Tensor decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                     torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "decode: q must be "
              "contiguous float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "decode: k and v differ in dtype");
  TORCH_CHECK(k.size(1) == q.size(1) && v.size(1) == q.size(1) && k.size(3) == q.size(3)
              && v.size(3) == q.size(3) && k.size(0) == v.size(0) && k.size(2) == v.size(2),
              "decode: q, k, v shapes disagree");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == k.size(3)
              && v.stride(2) == v.size(3), "decode: k and v need contiguous [S, D] per head");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong
              && rows.is_contiguous() && lengths.is_contiguous() && rows.numel() == q.size(0)
              && lengths.numel() == q.size(0), "decode: rows and lengths must be [R] int64");
  const int64_t n = q.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < k.size(0), "decode: row ", rp[r], " out of range");
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= k.size(2), "decode: length ", lp[r], " out of range");
  }
  auto out = torch::empty_like(q);
#if defined(__AVX512F__)
  const bool done = k.scalar_type() == at::kFloat
      ? dispatch<float>(q.size(3), q.size(2), q, k, v, rows, lengths, out, scale)
      : k.scalar_type() == at::kBFloat16
      ? dispatch<at::BFloat16>(q.size(3), q.size(2), q, k, v, rows, lengths, out, scale)
      : false;
  TORCH_CHECK(done, "decode: unsupported head size, group or dtype (see supports)");
#else
  TORCH_CHECK(false, "decode: built without AVX-512");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports);
  m.def("decode", &decode);
}
