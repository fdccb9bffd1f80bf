#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum(a[0]), ..., sum(a[7])]
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Cephes-style exp, relative error ~1e-7 (softmax and SiLU).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Runs f(chunk) for chunk in [0, n) on torch's intra-op threads, dynamically balanced.
template <typename F>
void parallel_chunks(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t c = 0; c < n; ++c) f(c);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(c);
  });
}

// ---- quantized weights ---------------------------------------------------------------------------

enum Kind { kQ4_1 = 0, kQ8_0 = 1 };

struct QWeight {
  Kind kind;
  int64_t n, k;  // rows, columns
  const uint8_t* qs;
  const float* d;
  const float* m;  // Q4_1 only
};

QWeight make_qweight(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kFloat && d.is_contiguous(), "d: contiguous float [N, K/32]");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(0) == d.size(0), "qs: contiguous [N, ...]");
  QWeight w;
  w.n = d.size(0);
  w.k = d.size(1) * 32;
  w.qs = static_cast<const uint8_t*>(qs.data_ptr());
  w.d = d.data_ptr<float>();
  w.m = nullptr;
  if (qs.scalar_type() == at::kByte) {
    TORCH_CHECK(qs.size(1) * 2 == w.k, "Q4_1 qs must be [N, K/2]");
    TORCH_CHECK(m.has_value() && m->sizes() == d.sizes() && m->is_contiguous() && m->scalar_type() == at::kFloat,
                "Q4_1 needs m shaped like d");
    w.kind = kQ4_1;
    w.m = m->data_ptr<float>();
  } else {
    TORCH_CHECK(qs.scalar_type() == at::kChar && qs.size(1) == w.k, "Q8_0 qs must be int8 [N, K]");
    w.kind = kQ8_0;
  }
  return w;
}

inline __m256 q4_to_float(__m128i nibbles, __m256 d, __m256 m) {  // 8 low bytes -> d * q + m
  return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)), m);
}

// Block g of row n as 4 x 8 floats (Q4_1: element j in the low nibble of byte j, j + 16 in its high).
template <Kind KIND>
inline void dequant_block(const QWeight& w, int64_t n, int64_t g, __m256 out[4]) {
  const int64_t G = w.k / 32;
  const __m256 vd = _mm256_set1_ps(w.d[n * G + g]);
  if (KIND == kQ4_1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.k / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m256 vm = _mm256_set1_ps(w.m[n * G + g]);
    out[0] = q4_to_float(lo, vd, vm);
    out[1] = q4_to_float(_mm_srli_si128(lo, 8), vd, vm);
    out[2] = q4_to_float(hi, vd, vm);
    out[3] = q4_to_float(_mm_srli_si128(hi, 8), vd, vm);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + n * w.k + g * 32;
    for (int s = 0; s < 4; ++s) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * s));
      out[s] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
  }
}

// Block g of row n as its integer values in floats, unscaled (Q4_1: 0..15, Q8_0: -128..127).
template <Kind KIND>
inline void block_values(const QWeight& w, int64_t n, int64_t g, __m256 out[4]) {
  if (KIND == kQ4_1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.k / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + n * w.k + g * 32;
    for (int s = 0; s < 4; ++s)
      out[s] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * s))));
  }
}

template <int MR, int NR>
inline void store_tile(__m256 acc[MR][NR], float* out, int64_t ldo, int64_t n0, bool accumulate) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float r = hsum(acc[i][j]);
      float& o = out[i * ldo + n0 + j];
      o = accumulate ? o + r : r;
    }
}

// MR rows of x times NR weight rows, each block dequantized in registers (3-4 rows: measured faster
// than scaling per block, which needs more registers).
template <Kind KIND, int MR, int NR>
inline void tile_dequantized(const float* x, int64_t ldx, const QWeight& w, int64_t n0, float* out, int64_t ldo,
                             bool accumulate) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t G = w.k / 32;
  for (int64_t g = 0; g < G; ++g) {
    __m256 wv[NR][4];
    for (int j = 0; j < NR; ++j) dequant_block<KIND>(w, n0 + j, g, wv[j]);
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + g * 32 + 8 * s);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j][s], xv, acc[i][j]);
      }
  }
  store_tile<MR, NR>(acc, out, ldo, n0, accumulate);
}

// MR rows of x times NR weight rows, for small M. Per block, sum_k x_k (d q_k + m) is computed as
// d * sum_k x_k q_k + m * sum_k x_k (`xsum`: block sums of x, [MR, G]): the scale and offset cost one
// operation per block instead of one per 8 weights (at M = 1 converting the blocks is the bottleneck).
template <Kind KIND, int MR, int NR>
inline void tile_fused(const float* x, int64_t ldx, const float* xsum, const QWeight& w, int64_t n0, float* out,
                       int64_t ldo, bool accumulate) {
  __m256 acc[MR][NR];
  float offset[MR][NR] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t G = w.k / 32;
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[NR][4];
    for (int j = 0; j < NR; ++j) block_values<KIND>(w, n0 + j, g, qv[j]);
    for (int i = 0; i < MR; ++i) {
      const float* xs = x + i * ldx + g * 32;
      const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
      const __m256 x2 = _mm256_loadu_ps(xs + 16), x3 = _mm256_loadu_ps(xs + 24);
      for (int j = 0; j < NR; ++j) {
        __m256 b = _mm256_mul_ps(qv[j][0], x0);
        b = _mm256_fmadd_ps(qv[j][1], x1, b);
        b = _mm256_fmadd_ps(qv[j][2], x2, b);
        b = _mm256_fmadd_ps(qv[j][3], x3, b);
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(w.d[(n0 + j) * G + g]), b, acc[i][j]);
        if (KIND == kQ4_1) offset[i][j] += w.m[(n0 + j) * G + g] * xsum[i * G + g];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float r = hsum(acc[i][j]) + offset[i][j];
      float& o = out[i * ldo + n0 + j];
      o = accumulate ? o + r : r;
    }
}

// MR rows of x times NR dequantized weight rows held in `wb` ([NR][K] floats, row stride K).
template <int MR, int NR>
inline void tile_buffered(const float* x, int64_t ldx, const float* wb, int64_t K, int64_t n0, float* out,
                          int64_t ldo, bool accumulate) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(wb + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  store_tile<MR, NR>(acc, out, ldo, n0, accumulate);
}

template <Kind KIND, int MR>
void rows_fused(const float* x, int64_t ldx, const float* xsum, const QWeight& w, int64_t n0, int64_t n1,
                float* out, int64_t ldo, bool accumulate) {
  int64_t n = n0;
  if constexpr (MR <= 2) {
    for (; n + 4 <= n1; n += 4) tile_fused<KIND, MR, 4>(x, ldx, xsum, w, n, out, ldo, accumulate);
    for (; n < n1; ++n) tile_fused<KIND, MR, 1>(x, ldx, xsum, w, n, out, ldo, accumulate);
  } else {
    for (; n + 2 <= n1; n += 2) tile_dequantized<KIND, MR, 2>(x, ldx, w, n, out, ldo, accumulate);
    for (; n < n1; ++n) tile_dequantized<KIND, MR, 1>(x, ldx, w, n, out, ldo, accumulate);
  }
}

constexpr int kBufferedMR = 4, kBufferedNR = 3;  // 12 accumulators + 3 weights + 1 x: 16 registers

template <int NR>
void rows_buffered_m(const float* x, int64_t ldx, int64_t M, const float* wb, int64_t K, int64_t n0, float* out,
                     int64_t ldo, bool accumulate) {
  constexpr int MR = kBufferedMR;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) tile_buffered<MR, NR>(x + i * ldx, ldx, wb, K, n0, out + i * ldo, ldo, accumulate);
  for (; i + 4 <= M; i += 4) tile_buffered<4, NR>(x + i * ldx, ldx, wb, K, n0, out + i * ldo, ldo, accumulate);
  switch (M - i) {
    case 3: tile_buffered<3, NR>(x + i * ldx, ldx, wb, K, n0, out + i * ldo, ldo, accumulate); break;
    case 2: tile_buffered<2, NR>(x + i * ldx, ldx, wb, K, n0, out + i * ldo, ldo, accumulate); break;
    case 1: tile_buffered<1, NR>(x + i * ldx, ldx, wb, K, n0, out + i * ldo, ldo, accumulate); break;
    default: break;
  }
}

// Rows n0..n1 of W for many rows of x: those rows are dequantized once into a buffer (24 rows x K
// floats, L1/L2-resident), then every row of x reuses them. (Splitting K to fit L1 measured slower:
// each split pays the horizontal sums again.)
template <Kind KIND>
void rows_buffered(const float* x, int64_t ldx, int64_t M, const QWeight& w, int64_t n0, int64_t n1, float* out,
                   int64_t ldo, bool accumulate) {
  thread_local std::vector<float> buffer;
  const int64_t K = w.k, G = K / 32;
  buffer.resize((n1 - n0) * K);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t g = 0; g < G; ++g) {
      __m256 wv[4];
      dequant_block<KIND>(w, n, g, wv);
      for (int s = 0; s < 4; ++s) _mm256_storeu_ps(buffer.data() + (n - n0) * K + g * 32 + 8 * s, wv[s]);
    }
  int64_t n = n0;
  for (; n + kBufferedNR <= n1; n += kBufferedNR)
    rows_buffered_m<kBufferedNR>(x, ldx, M, buffer.data() + (n - n0) * K, K, n, out, ldo, accumulate);
  for (; n < n1; ++n) rows_buffered_m<1>(x, ldx, M, buffer.data() + (n - n0) * K, K, n, out, ldo, accumulate);
}

template <Kind KIND>
void rows_any(const float* x, int64_t ldx, const float* xsum, int64_t M, const QWeight& w, int64_t n0, int64_t n1,
              float* out, int64_t ldo, bool accumulate) {
  switch (M) {
    case 1: rows_fused<KIND, 1>(x, ldx, xsum, w, n0, n1, out, ldo, accumulate); break;
    case 2: rows_fused<KIND, 2>(x, ldx, xsum, w, n0, n1, out, ldo, accumulate); break;
    case 3: rows_fused<KIND, 3>(x, ldx, xsum, w, n0, n1, out, ldo, accumulate); break;
    case 4: rows_fused<KIND, 4>(x, ldx, xsum, w, n0, n1, out, ldo, accumulate); break;
    default: rows_buffered<KIND>(x, ldx, M, w, n0, n1, out, ldo, accumulate);
  }
}

// ---- many rows of x: x as panels of 8 rows, weights broadcast from a dequantized buffer ----------
//
// x is transposed once per call into panels xt[p][k][r] = x[8p + r][k] (rows past M are 0), so one
// ymm holds column k of 8 rows of x. A tile keeps PV panels x NR weight rows of outputs in registers
// (lane r of acc[p][j] is out[8p + r][n0 + j]) and per k does PV loads of x, NR broadcasts of dequantized
// weights and PV * NR FMAs: no horizontal sums, and few bytes per FMA (2 x 6: 64 + 24 bytes for 12
// FMAs, against 7 full vectors for 12 in the dot-product tiles of rows_buffered, whose loads outran L2).
// Each output sums its products in k order within a K block, then block by block.

// Panels pad M to a multiple of 8: used from 16 rows, and at 8 (no padding); 9-15 rows measured faster
// on the 4-row dot-product tiles.
inline bool use_panels(int64_t M) { return M >= 16 || M == 8; }

inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Panel p of x: xt[k * 8 + r] = x[8p + r][k], K a multiple of 8.
void pack_panel(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t p, float* xt) {
  for (int64_t k = 0; k < K; k += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = 8 * p + i < M ? _mm256_loadu_ps(x + (8 * p + i) * ldx + k) : _mm256_setzero_ps();
    transpose8(r);
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(xt + (k + c) * 8, r[c]);
  }
}

// PV panels of x (xt: panel stride ldp floats) times NR weight rows (wb: row stride ldw), over kc
// columns, added to the tile's running sums ct[j][p][8] (stride P * 8 per weight row) kept transposed.
template <int PV, int NR>
inline void tile_panels(const float* xt, int64_t ldp, const float* wb, int64_t ldw, int64_t kc, float* ct,
                        int64_t P) {
  // Every loop over PV and NR unrolled, or GCC keeps acc in memory and stores it on every k.
  __m256 acc[PV][NR];
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[p][j] = _mm256_loadu_ps(ct + j * P * 8 + p * 8);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 xv[PV];
#pragma GCC unroll 16
    for (int p = 0; p < PV; ++p) xv[p] = _mm256_loadu_ps(xt + p * ldp + k * 8);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_broadcast_ss(wb + j * ldw + k);
#pragma GCC unroll 16
      for (int p = 0; p < PV; ++p) acc[p][j] = _mm256_fmadd_ps(xv[p], wv, acc[p][j]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) _mm256_storeu_ps(ct + j * P * 8 + p * 8, acc[p][j]);
}

template <int PV, int NR>
void panels_rows(const float* xt, int64_t ldp, const float* wb, int64_t ldw, int64_t kc, int64_t rows, float* ct,
                 int64_t P) {
  int64_t n = 0;
  for (; n + NR <= rows; n += NR) tile_panels<PV, NR>(xt, ldp, wb + n * ldw, ldw, kc, ct + n * P * 8, P);
  for (; n < rows; ++n) tile_panels<PV, 1>(xt, ldp, wb + n * ldw, ldw, kc, ct + n * P * 8, P);
}

// Columns per K block, which bounds the x panels a tile streams (192 and 576 measured alike at K = 576
// and 1536; 576 leaves the model's hidden size in one block).
constexpr int64_t kPanelKc = 576;

// Row n of W as K floats. Q4_1 bytes are widened 8 at a time to 32-bit lanes, where a mask and a
// shift give both nibbles (fewer instructions than splitting nibbles in bytes first, as dequant_block).
template <Kind KIND>
inline void dequant_row(const QWeight& w, int64_t n, float* out) {
  const int64_t G = w.k / 32;
  if (KIND == kQ4_1) {
    const uint8_t* q = w.qs + n * (w.k / 2);
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int64_t g = 0; g < G; ++g, q += 16, out += 32) {
      const __m256 vd = _mm256_set1_ps(w.d[n * G + g]), vm = _mm256_set1_ps(w.m[n * G + g]);
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
      _mm256_storeu_ps(out, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), vm));
      _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), vm));
      _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vm));
      _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vm));
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      __m256 wv[4];
      dequant_block<KIND>(w, n, g, wv);
      for (int s = 0; s < 4; ++s) _mm256_storeu_ps(out + g * 32 + 8 * s, wv[s]);
    }
  }
}

// Rows n0..n1 of W dequantized once into a buffer (row by row: the quantized rows stream from memory in
// order), then K block by K block every panel pair of x reuses the block; the sums stay transposed in
// `ct` until the last block.
template <Kind KIND>
void rows_panels(const float* xt, int64_t M, const QWeight& w, int64_t n0, int64_t n1, float* out, int64_t ldo,
                 bool accumulate) {
  thread_local std::vector<float> buffer, ct;
  const int64_t K = w.k, P = (M + 7) / 8, rows = n1 - n0;
  buffer.resize(rows * K);
  ct.assign(rows * P * 8, 0.0f);
  for (int64_t n = n0; n < n1; ++n) dequant_row<KIND>(w, n, buffer.data() + (n - n0) * K);
  for (int64_t k0 = 0; k0 < K; k0 += kPanelKc) {
    const int64_t kc = std::min(kPanelKc, K - k0);
    int64_t p = 0;
    for (; p + 2 <= P; p += 2)
      panels_rows<2, 6>(xt + p * K * 8 + k0 * 8, K * 8, buffer.data() + k0, K, kc, rows, ct.data() + p * 8, P);
    if (p < P)
      panels_rows<1, 12>(xt + p * K * 8 + k0 * 8, K * 8, buffer.data() + k0, K, kc, rows, ct.data() + p * 8, P);
  }
  for (int64_t i = 0; i < M; ++i) {
    float* o = out + i * ldo + n0;
    const float* c = ct.data() + (i / 8) * 8 + i % 8;
    for (int64_t n = 0; n < rows; ++n) o[n] = accumulate ? o[n] + c[n * P * 8] : c[n * P * 8];
  }
}

constexpr int64_t kChunkRows = 24;  // weight rows per parallel chunk (a multiple of 2, 3, 4, 6 and 12)

// out[M, N] (row stride ldo) = (or +=) x[M, K] @ W.T
void linear_into(const float* x, int64_t ldx, int64_t M, const QWeight& w, float* out, int64_t ldo, bool accumulate) {
  if (M == 0) return;
  const int64_t G = w.k / 32;
  std::vector<float> xsum;  // block sums of x, for the fused Q4_1 tiles
  if (M <= 2 && w.kind == kQ4_1) {
    xsum.resize(M * G);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const float* xs = x + i * ldx + g * 32;
        xsum[i * G + g] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8)),
                                             _mm256_add_ps(_mm256_loadu_ps(xs + 16), _mm256_loadu_ps(xs + 24))));
      }
  }
  const int64_t chunks = (w.n + kChunkRows - 1) / kChunkRows;
  if (use_panels(M)) {
    // Per call, not thread_local: a prefill's rows would keep megabytes held after it.
    const int64_t P = (M + 7) / 8;
    const std::unique_ptr<float[]> panels(new float[P * w.k * 8]);
    float* xt = panels.get();
    for (int64_t p = 0; p < P; ++p) pack_panel(x, ldx, M, w.k, p, xt + p * w.k * 8);
    parallel_chunks(chunks, [&](int64_t c) {
      const int64_t n0 = c * kChunkRows, n1 = std::min(w.n, n0 + kChunkRows);
      if (w.kind == kQ4_1) rows_panels<kQ4_1>(xt, M, w, n0, n1, out, ldo, accumulate);
      else rows_panels<kQ8_0>(xt, M, w, n0, n1, out, ldo, accumulate);
    });
    return;
  }
  parallel_chunks(chunks, [&](int64_t c) {
    const int64_t n0 = c * kChunkRows, n1 = std::min(w.n, n0 + kChunkRows);
    if (w.kind == kQ4_1) rows_any<kQ4_1>(x, ldx, xsum.data(), M, w, n0, n1, out, ldo, accumulate);
    else rows_any<kQ8_0>(x, ldx, xsum.data(), M, w, n0, n1, out, ldo, accumulate);
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  const QWeight w = make_qweight(qs, d, m);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == w.k,
              "x must be float32 [M, ", w.k, "]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, x.options());
  linear_into(x.data_ptr<float>(), w.k, x.size(0), w, out.data_ptr<float>(), w.n, false);
  return out;
}

// ---- the decode stack ------------------------------------------------------------------------------

void rms_norm(const float* x, const float* weight, int64_t B, int64_t E, double eps, float* out) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * E;
    double ss = 0;
    for (int64_t e = 0; e < E; ++e) ss += double(xr[e]) * xr[e];
    const float scale = float(1.0 / std::sqrt(ss / E + eps));
    for (int64_t e = 0; e < E; ++e) out[b * E + e] = xr[e] * scale * weight[e];
  }
}

// In place, rotate-half layout: out[d] = x[d] cos[d] + (d < D/2 ? -x[d + D/2] : x[d - D/2]) sin[d].
void rope_head(float* x, const float* cos, const float* sin, int64_t D) {
  float tmp[512];
  std::copy(x, x + D, tmp);
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) x[d] = tmp[d] * cos[d] - tmp[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) x[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

struct Pages {
  float* cache;  // [P, 2, S, KVH, D]
  int64_t S, KVH, D;
  const int64_t* table;  // [B, max_pages]
  int64_t max_pages;
  const int64_t* ctx_len;  // [B] tokens of the item, the new one included
  const uint8_t* visible;  // [B, width]: slot t of the item may be attended
  int64_t width;
  int64_t slot_offset(int64_t b, int64_t t, int kv) const {  // float offset of K (0) / V (1) of slot t
    const int64_t page = table[b * max_pages + t / S];
    return ((page * 2 + kv) * S + t % S) * KVH * D;
  }
};

template <int D>
void attention_task(const float* qkv, int64_t ld_qkv, int64_t H, const Pages& p, int64_t b, int64_t kh, float* out) {
  const int64_t group = H / p.KVH, n = p.ctx_len[b];
  thread_local std::vector<int64_t> offsets;
  thread_local std::vector<float> scores;
  offsets.clear();
  for (int64_t t = 0; t < n; ++t)
    if (p.visible[b * p.width + t]) offsets.push_back(p.slot_offset(b, t, 0) + kh * D);
  const int64_t count = offsets.size(), v_shift = p.S * p.KVH * D;
  scores.resize(count + 8);
  const float scale = 1.0f / std::sqrt(float(D));
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kh * group + g;
    const float* q = qkv + b * ld_qkv + h * D;
    float* o = out + b * H * D + h * D;
    if (count == 0) {  // every slot hidden: output 0, as the general path does
      std::fill(o, o + D, 0.0f);
      continue;
    }
    __m256 qv[D / 8];
    for (int c = 0; c < D / 8; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
    // Scores 8 slots at a time: 8 dot-product vectors reduced together (one hadd tree, not 8 hsums).
    __m256 vmax8 = _mm256_set1_ps(-INFINITY);
    for (int64_t i0 = 0; i0 < count; i0 += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) {
        const float* k = p.cache + offsets[std::min(i0 + t, count - 1)];  // past the end: a repeat, unused
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
        for (int c = 1; c < D / 8; ++c) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + 8 * c), a);
        acc[t] = a;
      }
      const __m256 s = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
      _mm256_storeu_ps(scores.data() + i0, s);
      const int64_t valid = std::min<int64_t>(8, count - i0);
      const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid),
                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      vmax8 = _mm256_max_ps(vmax8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, lanes));
    }
    float max_score = -INFINITY;
    for (int t = 0; t < 8; ++t) max_score = std::max(max_score, vmax8[t]);
    const __m256 vmax = _mm256_set1_ps(max_score);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + i), vmax));
      _mm256_storeu_ps(scores.data() + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    if (i < count) {
      float tail[8] = {0};
      std::copy(scores.begin() + i, scores.begin() + count, tail);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), vmax));
      _mm256_storeu_ps(tail, e);
      for (int64_t j = 0; j < count - i; ++j) {
        scores[i + j] = tail[j];
        sum += tail[j];
      }
    }
    __m256 acc[D / 8];
    for (int c = 0; c < D / 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const float* v = p.cache + offsets[j] + v_shift;
      const __m256 w = _mm256_set1_ps(scores[j]);
      for (int c = 0; c < D / 8; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
}

void attention(const float* qkv, int64_t ld_qkv, int64_t B, int64_t H, const Pages& p, float* out) {
  parallel_chunks(B * p.KVH, [&](int64_t task) {
    const int64_t b = task / p.KVH, kh = task % p.KVH;
    switch (p.D) {
      case 64: attention_task<64>(qkv, ld_qkv, H, p, b, kh, out); break;
      case 128: attention_task<128>(qkv, ld_qkv, H, p, b, kh, out); break;
      default: TORCH_CHECK(false, "decode_layers supports head_dim 64 or 128, got ", p.D);
    }
  });
}

void silu_mul(const float* gate_up, int64_t B, int64_t F, float* out) {  // out[b, f] = silu(gate) * up
  for (int64_t b = 0; b < B; ++b) {
    const float* g = gate_up + b * 2 * F;
    const float* u = g + F;
    float* o = out + b * F;
    int64_t f = 0;
    for (; f + 8 <= F; f += 8) {
      const __m256 gv = _mm256_loadu_ps(g + f);
      const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                       _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      _mm256_storeu_ps(o + f, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + f)));
    }
    for (; f < F; ++f) o[f] = g[f] / (1.0f + std::exp(-g[f])) * u[f];
  }
}

constexpr int64_t kWeightsPerLayer = 14;  // in_norm, qkv (qs, d, m), o (3), post_norm, gate_up (3), down (3)

QWeight layer_qweight(const std::vector<at::Tensor>& ws, int64_t base) {
  const at::Tensor& m = ws[base + 2];
  return make_qweight(ws[base], ws[base + 1], m.numel() ? c10::optional<at::Tensor>(m) : c10::nullopt);
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         std::vector<at::Tensor> weights, std::vector<at::Tensor> kv, const at::Tensor& page_table,
                         const at::Tensor& ctx_len, const at::Tensor& visible, int64_t num_heads, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [B, E]");
  const int64_t B = hidden.size(0), E = hidden.size(1), L = kv.size();
  TORCH_CHECK(int64_t(weights.size()) == L * kWeightsPerLayer, "expected ", kWeightsPerLayer, " weights per layer");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.size(0) == B &&
              page_table.is_contiguous(), "page_table: contiguous int64 [B, max_pages]");
  TORCH_CHECK(ctx_len.scalar_type() == at::kLong && ctx_len.numel() == B && ctx_len.is_contiguous());
  TORCH_CHECK(visible.scalar_type() == at::kByte && visible.dim() == 2 && visible.size(0) == B &&
              visible.is_contiguous(), "visible: contiguous uint8 [B, width]");
  at::Tensor x = hidden.contiguous().clone();
  if (L == 0 || B == 0) return x;
  const int64_t S = kv[0].size(2), KVH = kv[0].size(3), D = kv[0].size(4), H = num_heads;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == B && cos.size(1) == D && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin: contiguous [B, head_dim]");
  TORCH_CHECK(H % KVH == 0 && D <= 512, "bad head layout");
  const int64_t* ctx = ctx_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= std::min(visible.size(1), page_table.size(1) * S), "bad ctx_len");
  const int64_t QKV = (H + 2 * KVH) * D;
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  std::vector<float> h(B * E), qkv(B * QKV), attn(B * H * D), gate_up, act;
  float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = l * kWeightsPerLayer;
    TORCH_CHECK(kv[l].is_contiguous() && kv[l].scalar_type() == at::kFloat && kv[l].size(2) == S &&
                kv[l].size(3) == KVH && kv[l].size(4) == D, "kv caches must be contiguous float32 alike");
    const QWeight w_qkv = layer_qweight(weights, base + 1), w_o = layer_qweight(weights, base + 4);
    const QWeight w_gate_up = layer_qweight(weights, base + 8), w_down = layer_qweight(weights, base + 11);
    TORCH_CHECK(w_qkv.n == QKV && w_qkv.k == E && w_o.n == E && w_o.k == H * D && w_gate_up.k == E &&
                w_down.n == E && w_down.k * 2 == w_gate_up.n, "layer ", l, ": weight shapes do not fit");
    const int64_t F = w_down.k;
    gate_up.resize(B * 2 * F);
    act.resize(B * F);
    Pages p{kv[l].data_ptr<float>(), S, KVH, D, page_table.data_ptr<int64_t>(), page_table.size(1), ctx,
            visible.data_ptr<uint8_t>(), visible.size(1)};

    rms_norm(xp, weights[base].data_ptr<float>(), B, E, eps, h.data());
    linear_into(h.data(), E, B, w_qkv, qkv.data(), QKV, false);
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv.data() + b * QKV;
      for (int64_t hd = 0; hd < H + KVH; ++hd) rope_head(row + hd * D, cs + b * D, sn + b * D, D);
      const int64_t t = ctx[b] - 1;
      std::copy(row + H * D, row + (H + KVH) * D, p.cache + p.slot_offset(b, t, 0));
      std::copy(row + (H + KVH) * D, row + QKV, p.cache + p.slot_offset(b, t, 1));
    }
    attention(qkv.data(), QKV, B, H, p, attn.data());
    linear_into(attn.data(), H * D, B, w_o, xp, E, true);
    rms_norm(xp, weights[base + 7].data_ptr<float>(), B, E, eps, h.data());
    linear_into(h.data(), E, B, w_gate_up, gate_up.data(), 2 * F, false);
    silu_mul(gate_up.data(), B, F, act.data());
    linear_into(act.data(), F, B, w_down, xp, E, true);
  }
  return x;
}

// decode_layers' attention alone, for the single-token items of a mixed batch (the rest of the batch
// attends through torch): q [B, H * D] float32 with RoPE applied, the items' K/V already in the pages.
// Each item's context fits its visibility row and page table, and every page it reads is one of the cache's.
void check_pages(const int64_t* ctx, const int64_t* table, int64_t B, int64_t table_width, int64_t width,
                 int64_t S, int64_t num_pages) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= width, "bad ctx_len");
    for (int64_t i = 0; i < (ctx[b] + S - 1) / S; ++i)
      TORCH_CHECK(table[b * table_width + i] >= 0 && table[b * table_width + i] < num_pages,
                  "page id out of range");
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                            const at::Tensor& ctx_len, const at::Tensor& visible, int64_t num_heads) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [B, H * D]");
  TORCH_CHECK(kv.dim() == 5 && kv.scalar_type() == at::kFloat && kv.is_contiguous(),
              "kv: a layer's contiguous float32 cache [pages, 2, S, KVH, D]");
  const int64_t B = q.size(0), S = kv.size(2), KVH = kv.size(3), D = kv.size(4), H = num_heads;
  TORCH_CHECK(H > 0 && H % KVH == 0 && q.size(1) == H * D, "q's width must be num_heads * head_dim");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.size(0) == B &&
              page_table.is_contiguous(), "page_table: contiguous int64 [B, max_pages]");
  TORCH_CHECK(ctx_len.scalar_type() == at::kLong && ctx_len.numel() == B && ctx_len.is_contiguous());
  TORCH_CHECK(visible.scalar_type() == at::kByte && visible.dim() == 2 && visible.size(0) == B &&
              visible.is_contiguous(), "visible: contiguous uint8 [B, width]");
  const int64_t* ctx = ctx_len.data_ptr<int64_t>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t width = std::min(visible.size(1), page_table.size(1) * S);
  check_pages(ctx, table, B, page_table.size(1), width, S, kv.size(0));
  at::Tensor out = at::empty({B, H * D}, q.options());
  if (B == 0) return out;
  Pages p{kv.data_ptr<float>(), S, KVH, D, table, page_table.size(1), ctx, visible.data_ptr<uint8_t>(),
          visible.size(1)};
  attention(q.data_ptr<float>(), H * D, B, H, p, out.data_ptr<float>());
  return out;
}

// decode_layers for a mixed batch: hidden's first B rows are single-token items (one row each of
// page_table, ctx_len and visible, attending as in decode_layers), its other rows one padded group of
// Bc items of Tq new tokens each (a prefill chunk), attending as attention.py's padded path does
// (group_kv_index [Bc, 2, Tkv]: rows of a layer's cache viewed [pages * 2 * S, KVH, D]; group_mask
// [Bc, 1, Tq, Tkv] additive), through torch's SDPA. Every linear runs once over all rows: the decode
// steps keep the fused stack without reading the weights twice. write_slots [N]: page * S + offset of
// each row's new K/V; dead_rows: rows whose mask hides everything (attention output 0).
at::Tensor mixed_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        std::vector<at::Tensor> weights, std::vector<at::Tensor> kv, const at::Tensor& page_table,
                        const at::Tensor& ctx_len, const at::Tensor& visible, const at::Tensor& write_slots,
                        const at::Tensor& group_kv_index, const at::Tensor& group_mask, const at::Tensor& dead_rows,
                        int64_t num_heads, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [N, E]");
  const int64_t N = hidden.size(0), E = hidden.size(1), L = kv.size();
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == L * kWeightsPerLayer, "expected ", kWeightsPerLayer,
              " weights per layer");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.is_contiguous(),
              "page_table: contiguous int64 [B, max_pages]");
  const int64_t B = page_table.size(0);
  TORCH_CHECK(ctx_len.scalar_type() == at::kLong && ctx_len.numel() == B && ctx_len.is_contiguous(),
              "ctx_len: contiguous int64 [B]");
  TORCH_CHECK(visible.scalar_type() == at::kByte && visible.dim() == 2 && visible.size(0) == B &&
              visible.is_contiguous(), "visible: contiguous uint8 [B, width]");
  TORCH_CHECK(group_mask.dim() == 4 && group_mask.scalar_type() == at::kFloat && group_mask.size(1) == 1,
              "group_mask: float32 [Bc, 1, Tq, Tkv]");
  const int64_t Bc = group_mask.size(0), Tq = group_mask.size(2), Tkv = group_mask.size(3);
  TORCH_CHECK(B >= 1 && Bc >= 1 && B + Bc * Tq == N, "hidden's rows must be the B decode items' then the group's ",
              "Bc * Tq, got ", N, " rows for B = ", B, ", Bc = ", Bc, ", Tq = ", Tq);
  TORCH_CHECK(group_kv_index.scalar_type() == at::kLong && group_kv_index.dim() == 3 &&
              group_kv_index.size(0) == Bc && group_kv_index.size(1) == 2 && group_kv_index.size(2) == Tkv,
              "group_kv_index: int64 [Bc, 2, Tkv]");
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && write_slots.numel() == N && write_slots.is_contiguous(),
              "write_slots: contiguous int64 [N]");
  TORCH_CHECK(dead_rows.scalar_type() == at::kLong && dead_rows.dim() == 1 && dead_rows.is_contiguous(),
              "dead_rows: contiguous int64 [n]");
  for (const at::Tensor& layer : kv)
    TORCH_CHECK(layer.dim() == 5 && layer.is_contiguous() && layer.scalar_type() == at::kFloat &&
                layer.sizes() == kv[0].sizes(), "kv caches must be contiguous float32 alike [pages, 2, S, KVH, D]");
  const int64_t P = kv[0].size(0), S = kv[0].size(2), KVH = kv[0].size(3), D = kv[0].size(4), H = num_heads;
  TORCH_CHECK(H > 0 && H % KVH == 0 && D <= 512, "bad head layout");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == N && cos.size(1) == D && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin: contiguous [N, head_dim]");
  const int64_t* ctx = ctx_len.data_ptr<int64_t>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t width = std::min(visible.size(1), page_table.size(1) * S);
  check_pages(ctx, table, B, page_table.size(1), width, S, P);
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < P * S, "write slot out of range");
  const at::Tensor kv_rows = group_kv_index.reshape({-1});
  TORCH_CHECK(kv_rows.numel() == 0 || (kv_rows.min().item<int64_t>() >= 0 && kv_rows.max().item<int64_t>() < P * 2 * S),
              "group_kv_index out of range");
  const int64_t* dead = dead_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < dead_rows.numel(); ++i) TORCH_CHECK(dead[i] >= 0 && dead[i] < N, "dead row out of range");

  at::Tensor x = hidden.contiguous().clone();
  const int64_t QKV = (H + 2 * KVH) * D;
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  std::vector<float> h(N * E), qkv(N * QKV), attn(N * H * D), gate_up, act;
  float* xp = x.data_ptr<float>();
  const auto options = hidden.options();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = l * kWeightsPerLayer;
    const QWeight w_qkv = layer_qweight(weights, base + 1), w_o = layer_qweight(weights, base + 4);
    const QWeight w_gate_up = layer_qweight(weights, base + 8), w_down = layer_qweight(weights, base + 11);
    TORCH_CHECK(w_qkv.n == QKV && w_qkv.k == E && w_o.n == E && w_o.k == H * D && w_gate_up.k == E &&
                w_down.n == E && w_down.k * 2 == w_gate_up.n, "layer ", l, ": weight shapes do not fit");
    const int64_t F = w_down.k;
    gate_up.resize(N * 2 * F);
    act.resize(N * F);
    Pages p{kv[l].data_ptr<float>(), S, KVH, D, table, page_table.size(1), ctx, visible.data_ptr<uint8_t>(),
            visible.size(1)};

    rms_norm(xp, weights[base].data_ptr<float>(), N, E, eps, h.data());
    linear_into(h.data(), E, N, w_qkv, qkv.data(), QKV, false);
    for (int64_t r = 0; r < N; ++r) {
      float* row = qkv.data() + r * QKV;
      for (int64_t hd = 0; hd < H + KVH; ++hd) rope_head(row + hd * D, cs + r * D, sn + r * D, D);
      float* k_slot = p.cache + ((slots[r] / S * 2) * S + slots[r] % S) * KVH * D;
      std::copy(row + H * D, row + (H + KVH) * D, k_slot);
      std::copy(row + (H + KVH) * D, row + QKV, k_slot + S * KVH * D);
    }
    attention(qkv.data(), QKV, B, H, p, attn.data());  // the decode rows
    // The group's rows: [Bc, H, Tq, D] queries (strided views of qkv) over their gathered K/V.
    const at::Tensor q = at::from_blob(qkv.data() + B * QKV, {Bc, Tq, H, D}, {Tq * QKV, QKV, D, 1}, options);
    const at::Tensor ctx_kv = kv[l].view({-1, KVH, D}).index_select(0, kv_rows).view({Bc, 2, Tkv, KVH, D});
    const at::Tensor out = at::scaled_dot_product_attention(
        q.transpose(1, 2), ctx_kv.select(1, 0).transpose(1, 2), ctx_kv.select(1, 1).transpose(1, 2), group_mask,
        0.0, false, c10::nullopt, true);  // [Bc, H, Tq, D]
    at::from_blob(attn.data() + B * H * D, {Bc, Tq, H, D}, options).copy_(out.transpose(1, 2));
    for (int64_t i = 0; i < dead_rows.numel(); ++i) std::fill_n(attn.data() + dead[i] * H * D, H * D, 0.0f);
    linear_into(attn.data(), H * D, N, w_o, xp, E, true);
    rms_norm(xp, weights[base + 7].data_ptr<float>(), N, E, eps, h.data());
    linear_into(h.data(), E, N, w_gate_up, gate_up.data(), 2 * F, false);
    silu_mul(gate_up.data(), N, F, act.data());
    linear_into(act.data(), F, N, w_down, xp, E, true);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(l4m_cpu, lib) {
  lib.def("linear(Tensor x, Tensor qs, Tensor d, Tensor? m) -> Tensor", &linear);
  lib.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] kv, Tensor page_table, "
          "Tensor ctx_len, Tensor visible, int num_heads, float eps) -> Tensor", &decode_layers);
  lib.def("decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor ctx_len, Tensor visible, "
          "int num_heads) -> Tensor", &decode_attention);
  lib.def("mixed_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] kv, Tensor page_table, "
          "Tensor ctx_len, Tensor visible, Tensor write_slots, Tensor group_kv_index, Tensor group_mask, "
          "Tensor dead_rows, int num_heads, float eps) -> Tensor", &mixed_layers);
}
