// Decode attention over a ragged KV cache: one query token per row, each row reading its own
// cache only up to its own length. See hisr_core/rollout/cpu/decode_attention.py.
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HISR_VECTORIZED 1

namespace {

// The vector operations the kernel needs, for 16 float32 lanes (AVX-512) or 8 (AVX2 with FMA,
// e.g. AMD Zen 1-3 and most laptops): the kernel below is written once against these.
#if defined(__AVX512F__)
struct Vec {
  using reg = __m512;
  static constexpr int W = 16;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg round(reg x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static reg times_pow2(reg p, reg n) { return _mm512_scalef_ps(p, n); }  // p · 2^n
  static float reduce(reg x) { return _mm512_reduce_add_ps(x); }
  // 32 bfloat16 → their float32 values, the even ones and the odd ones (each bfloat16 is the
  // high half of a float32: the odd ones are a mask away, the even ones a shift).
  static void load_bf16(const at::BFloat16* p, reg* even, reg* odd) {
    const __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(
        static_cast<int>(0xFFFF0000u))));
  }
  // Lane k of the result: the sum of the 16 lanes of v[k] (a transpose-and-add tree: 45
  // shuffles and adds for 16 sums, against 8 each one at a time).
  static reg sum_each(const reg* v) {
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
};
#else
struct Vec {
  using reg = __m256;
  static constexpr int W = 8;
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg zero() { return _mm256_setzero_ps(); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg round(reg x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // p · 2^n for integral n in [-126, 127]: n built into a float's exponent field.
  static reg times_pow2(reg p, reg n) {
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float reduce(reg x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static void load_bf16(const at::BFloat16* p, reg* even, reg* odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(
        static_cast<int>(0xFFFF0000u))));
  }
  // Lane k of the result: the sum of the 8 lanes of v[k] (transpose-and-add, as above).
  static reg sum_each(const reg* v) {
    __m256 a[4], b[2];
    for (int k = 0; k < 4; ++k)
      a[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                           _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; ++k) {
      const __m256d x = _mm256_castps_pd(a[2 * k]), y = _mm256_castps_pd(a[2 * k + 1]);
      b[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                           _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                         _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }
};
#endif

constexpr int W = Vec::W;
using reg = Vec::reg;

// A cache column of D values as D/W float32 vectors. float32 in order; bfloat16 as two vectors
// per 2W values, the even ones and the odd ones. Dot products do not care about order as long
// as the query is permuted alike (lane_of).
template <typename T, int D>
struct Column;

template <int D>
struct Column<float, D> {
  static void load(const float* p, reg* out) {
    for (int c = 0; c < D / W; ++c) out[c] = Vec::load(p + c * W);
  }
  static int lane_of(int c, int i) { return c * W + i; }
};

template <int D>
struct Column<at::BFloat16, D> {
  static void load(const at::BFloat16* p, reg* out) {
    for (int b = 0; b < D / (2 * W); ++b)
      Vec::load_bf16(p + b * 2 * W, &out[2 * b], &out[2 * b + 1]);
  }
  static int lane_of(int c, int i) { return (c / 2) * 2 * W + 2 * i + (c % 2); }
};

// exp(x) for x <= 0 (scores minus their maximum): 2^n · p(r), r = x - n ln 2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error ~2e-7); x is clamped at -87 (exp(-87) ~ 1.6e-38).
inline reg exp_neg(reg x) {
  x = Vec::max(x, Vec::set1(-87.f));
  const reg n = Vec::round(Vec::mul(x, Vec::set1(1.44269504f)));
  reg r = Vec::fnmadd(n, Vec::set1(0.693145751953125f), x);
  r = Vec::fnmadd(n, Vec::set1(1.428606765330187e-06f), r);
  reg p = Vec::set1(1.f / 720);
  p = Vec::fmadd(p, r, Vec::set1(1.f / 120));
  p = Vec::fmadd(p, r, Vec::set1(1.f / 24));
  p = Vec::fmadd(p, r, Vec::set1(1.f / 6));
  p = Vec::fmadd(p, r, Vec::set1(0.5f));
  p = Vec::fmadd(p, r, Vec::set1(1.f));
  p = Vec::fmadd(p, r, Vec::set1(1.f));
  return Vec::times_pow2(p, n);
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
// q, out: [G, D] float32; k, v: [len, D] (rows D apart); s: room for G * len + W floats, the
// scores column by column (s[j * G + g]).
template <typename T, int D, int G>
void attend_one(const float* __restrict q, const T* __restrict k, const T* __restrict v,
                float* __restrict out, int64_t len, float scale, float* __restrict s) {
  using Col = Column<T, D>;
  constexpr int C = D / W, B = W / G;  // vectors a column; columns a block of W scores
  reg qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      float lanes[W];
      for (int i = 0; i < W; ++i) lanes[i] = q[g * D + Col::lane_of(c, i)] * scale;
      qv[g][c] = Vec::load(lanes);
    }
  reg top = Vec::set1(-INFINITY);
  const int64_t blocked = len / B * B;
  for (int64_t j0 = 0; j0 < blocked; j0 += B) {
    reg part[W];
    for (int b = 0; b < B; ++b) {
      reg kj[C];
      prefetch_ahead<T, D>(k + (j0 + b) * D);
      Col::load(k + (j0 + b) * D, kj);
      for (int g = 0; g < G; ++g) {
        reg acc = Vec::mul(qv[g][0], kj[0]);
        for (int c = 1; c < C; ++c) acc = Vec::fmadd(qv[g][c], kj[c], acc);
        part[b * G + g] = acc;
      }
    }
    const reg x = Vec::sum_each(part);
    Vec::store(s + j0 * G, x);
    top = Vec::max(top, x);
  }
  float tops[W];
  Vec::store(tops, top);
  float m[G];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    for (int i = g; i < W; i += G) m[g] = std::max(m[g], tops[i]);
  }
  for (int64_t j = blocked; j < len; ++j) {
    reg kj[C];
    Col::load(k + j * D, kj);
    for (int g = 0; g < G; ++g) {
      reg acc = Vec::mul(qv[g][0], kj[0]);
      for (int c = 1; c < C; ++c) acc = Vec::fmadd(qv[g][c], kj[c], acc);
      s[j * G + g] = Vec::reduce(acc);
      m[g] = std::max(m[g], s[j * G + g]);
    }
  }
  // Softmax numerators in place; lane i of a block holds head i % G.
  for (int i = 0; i < W; ++i) tops[i] = m[i % G];
  const reg shift = Vec::load(tops);
  reg total = Vec::zero();
  const int64_t n = len * G, vec = n / W * W;
  for (int64_t i = 0; i < vec; i += W) {
    const reg e = exp_neg(Vec::sub(Vec::load(s + i), shift));
    Vec::store(s + i, e);
    total = Vec::add(total, e);
  }
  float totals[W];
  Vec::store(totals, total);
  float sum[G] = {};
  for (int i = 0; i < W; ++i) sum[i % G] += totals[i];
  for (int64_t i = vec; i < n; ++i) {
    s[i] = std::exp(s[i] - m[i % G]);
    sum[i % G] += s[i];
  }
  reg acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec::zero();
  for (int64_t j = 0; j < len; ++j) {
    reg vj[C];
    prefetch_ahead<T, D>(v + j * D);
    Col::load(v + j * D, vj);
    for (int g = 0; g < G; ++g) {
      const reg p = Vec::set1(s[j * G + g]);
      for (int c = 0; c < C; ++c) acc[g][c] = Vec::fmadd(p, vj[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      float lanes[W];
      Vec::store(lanes, Vec::mul(acc[g][c], Vec::set1(1.f / sum[g])));
      for (int i = 0; i < W; ++i) out[g * D + Col::lane_of(c, i)] = lanes[i];
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
    std::vector<float> s(G * longest + W);
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

// float32 lanes of a vector in this build (0: none).
int64_t lanes() { return W; }

#else

int64_t lanes() { return 0; }

#endif

// Whether decode() serves head size d, g query heads per KV head and a cache of this dtype.
bool supports(int64_t d, int64_t g, const std::string& dtype) {
  return lanes() > 0 && (d == 32 || d == 64 || d == 128) && (g == 1 || g == 2 || g == 4 || g == 8)
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
#if defined(HISR_VECTORIZED)
  const bool done = k.scalar_type() == at::kFloat
      ? dispatch<float>(q.size(3), q.size(2), q, k, v, rows, lengths, out, scale)
      : k.scalar_type() == at::kBFloat16
      ? dispatch<at::BFloat16>(q.size(3), q.size(2), q, k, v, rows, lengths, out, scale)
      : false;
  TORCH_CHECK(done, "decode: unsupported head size, group or dtype (see supports)");
#else
  TORCH_CHECK(false, "decode: built without AVX-512 or AVX2 with FMA");
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lanes", &lanes);
  m.def("supports", &supports);
  m.def("decode", &decode);
}
