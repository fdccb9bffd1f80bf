#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
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

// The KV cache's elements: float32, or float16 (the operator's opt-in, EngineConfig.kv_cache_dtype),
// read as float32 either way. uint16_t stands for float16's bits.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One slot's K or V row (n values) into the cache. float16 rounds to nearest even, a value beyond its finite
// range is clamped to +-65504 (as the torch path writes it), NaN stays NaN.
inline void store_kv(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_kv(const float* src, int64_t n, uint16_t* dst) {
  const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // min/max return their second operand where one is NaN: the NaN passes
    const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const float x = std::isnan(src[i]) ? src[i] : std::clamp(src[i], -65504.0f, 65504.0f);
    dst[i] = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  }
}

inline void store_kv(const float* src, int64_t n, void* cache, bool half, int64_t offset) {
  if (half) store_kv(src, n, static_cast<uint16_t*>(cache) + offset);
  else store_kv(src, n, static_cast<float*>(cache) + offset);
}

// A layer's KV cache tensor: float32 or float16 (TORCH_CHECK otherwise); true for float16.
bool kv_is_half(const at::Tensor& kv) {
  TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf,
              "kv: a cache of float32 or float16, got ", kv.scalar_type());
  return kv.scalar_type() == at::kHalf;
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

// parallel_chunks with one chunk of look-ahead: a thread claims its next chunk before it runs the
// current one and calls ahead(next) first, so that what the next chunk reads (prefetches) is on its way.
template <typename A, typename F>
void parallel_chunks_ahead(int64_t n, const A& ahead, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  auto run = [&]() {
    int64_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c < n) ahead(c);
    while (c < n) {
      const int64_t c2 = next.fetch_add(1, std::memory_order_relaxed);
      if (c2 < n) ahead(c2);
      f(c);
      c = c2;
    }
  };
  if (threads <= 1) return run();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { run(); });
}

// ---- quantized weights ---------------------------------------------------------------------------

enum Kind { kQ4_1 = 0, kQ8_0 = 1 };

// The scales d and m stay float16, as the GGUF stores them: at one row of x a linear streams its weights,
// and float32 scales made a Q4_1 block 24 bytes instead of 20.
struct QWeight {
  Kind kind;
  int64_t n, k;  // rows, columns
  const uint8_t* qs;
  const uint16_t* d;  // float16 bits
  const uint16_t* m;  // float16 bits, Q4_1 only
};

inline float half_at(const uint16_t* p, int64_t i) { return _cvtsh_ss(p[i]); }

QWeight make_qweight(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m) {
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous(), "d: contiguous float16 [N, K/32]");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(0) == d.size(0), "qs: contiguous [N, ...]");
  QWeight w;
  w.n = d.size(0);
  w.k = d.size(1) * 32;
  w.qs = static_cast<const uint8_t*>(qs.data_ptr());
  w.d = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  w.m = nullptr;
  if (qs.scalar_type() == at::kByte) {
    TORCH_CHECK(qs.size(1) * 2 == w.k, "Q4_1 qs must be [N, K/2]");
    TORCH_CHECK(m.has_value() && m->sizes() == d.sizes() && m->is_contiguous() && m->scalar_type() == at::kHalf,
                "Q4_1 needs m shaped like d, float16");
    w.kind = kQ4_1;
    w.m = reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>());
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
  const __m256 vd = _mm256_set1_ps(half_at(w.d, n * G + g));
  if (KIND == kQ4_1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.k / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m256 vm = _mm256_set1_ps(half_at(w.m, n * G + g));
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

// Weight rows ahead that the few-row tiles (tile_fused: 1-2 rows; tile_fused512: up to 8 rows of x)
// prefetch, blocks and scales alike. At 1-2 rows of x a linear streams its weights from memory, and the
// scales (d, m: one line per 32 blocks of a row) are streams of their own that the hardware prefetcher
// does not follow across short rows: without them prefetched, ~12 GB/s of weights per step; with them,
// 16 rows ahead, 20-27 GB/s (8 and 24 rows measured alike).
constexpr int64_t kAheadRows = 16;

// Asks for row n's block g (and, every 16 blocks, its scales' line: every 32 bytes, so that each line a
// row's scales touch is asked for whatever their alignment) ahead of use.
template <Kind KIND>
inline void prefetch_block(const QWeight& w, int64_t n, int64_t g) {
  const int64_t G = w.k / 32;
  _mm_prefetch(reinterpret_cast<const char*>(w.qs + (n * G + g) * (KIND == kQ4_1 ? 16 : 32)), _MM_HINT_T0);
  if (g % 16 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(w.d + n * G + g), _MM_HINT_T0);
    if (KIND == kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(w.m + n * G + g), _MM_HINT_T0);
  }
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
    for (int j = 0; j < NR; ++j) {
      prefetch_block<KIND>(w, n0 + j + kAheadRows, g);  // (a prefetch past the end never faults)
      block_values<KIND>(w, n0 + j, g, qv[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const float* xs = x + i * ldx + g * 32;
      const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
      const __m256 x2 = _mm256_loadu_ps(xs + 16), x3 = _mm256_loadu_ps(xs + 24);
      for (int j = 0; j < NR; ++j) {
        __m256 b = _mm256_mul_ps(qv[j][0], x0);
        b = _mm256_fmadd_ps(qv[j][1], x1, b);
        b = _mm256_fmadd_ps(qv[j][2], x2, b);
        b = _mm256_fmadd_ps(qv[j][3], x3, b);
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(half_at(w.d, (n0 + j) * G + g)), b, acc[i][j]);
        if (KIND == kQ4_1) offset[i][j] += half_at(w.m, (n0 + j) * G + g) * xsum[i * G + g];
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

// Panel p of 16 rows of x for the AVX-512 panels: xt[k * 16 + r] = x[16p + r][k], K a multiple of 8.
void pack_panel16(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t p, float* xt) {
  for (int64_t k = 0; k < K; k += 8)
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 16 * p + 8 * h + i;
        r[i] = row < M ? _mm256_loadu_ps(x + row * ldx + k) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(xt + (k + c) * 16 + 8 * h, r[c]);
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
      const __m256 vd = _mm256_set1_ps(half_at(w.d, n * G + g)), vm = _mm256_set1_ps(half_at(w.m, n * G + g));
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

// Asks for every cache line of weight rows n0..n1 (blocks and scales) at once: the rows are contiguous,
// but a chunk's worth is too short for the hardware prefetcher to ramp up before it is read.
inline void prefetch_rows(const QWeight& w, int64_t n0, int64_t n1) {
  const int64_t G = w.k / 32, row_bytes = w.kind == kQ4_1 ? w.k / 2 : w.k;
  auto lines = [](const void* start, int64_t bytes) {
    const char* p = static_cast<const char*>(start);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  };
  lines(w.qs + n0 * row_bytes, (n1 - n0) * row_bytes);
  lines(w.d + n0 * G, (n1 - n0) * G * 2);
  if (w.kind == kQ4_1) lines(w.m + n0 * G, (n1 - n0) * G * 2);
}

// ---- AVX-512: instruction sets chosen at run time -------------------------------------------------
//
// The code below the pragmas is compiled for AVX-512 by the pragmas only, the rest of the file stays
// AVX2 + FMA, and `linear_into` picks a path at run time (`g_isa`).

// Ordered: each runs the paths of those below it, and its own. `avx512` runs every float32 path of
// `avx512_bf16` (the same code, bit for bit); `avx512_bf16` adds x rounded to bf16 (`bf16_x`).
enum Isa { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };

// Every extension the first pragma below compiles for (libgcc also checks that the OS saves the zmm state).
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// And the second's.
bool cpu_has_avx512_bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }

// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) beside AVX-512 BF16, and the kernel's leave to
// use the tile data (Linux asks each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, 18; granted once, for every thread of the process). Asked once.
bool cpu_has_amx() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

int best_isa() {
  return cpu_has_amx() ? kAmx : cpu_has_avx512_bf16() ? kAvx512Bf16 : cpu_has_avx512() ? kAvx512 : kAvx2;
}

std::atomic<int> g_isa{best_isa()};

std::string isa() {
  const int chosen = g_isa.load();
  return chosen == kAmx ? "amx" : chosen == kAvx512Bf16 ? "avx512_bf16" : chosen == kAvx512 ? "avx512" : "avx2";
}

// "auto": the best this CPU runs; "avx2" (any x86-64 host the kernels build on); "avx512"; "avx512_bf16"; "amx".
std::string set_isa(const std::string& name) {
  if (name == "auto") {
    g_isa = best_isa();
  } else if (name == "avx2") {
    g_isa = kAvx2;
  } else if (name == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "CPU kernel ISA avx512: this CPU (or its OS) lacks one of ",
                "avx512f, avx512bw, avx512vl, avx512dq");
    g_isa = kAvx512;
  } else if (name == "avx512_bf16") {
    TORCH_CHECK(cpu_has_avx512_bf16(), "CPU kernel ISA avx512_bf16: this CPU (or its OS) lacks one of ",
                "avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16");
    g_isa = kAvx512Bf16;
  } else if (name == "amx") {
    TORCH_CHECK(cpu_has_amx(), "CPU kernel ISA amx: this CPU (or its OS) lacks one of avx512f, avx512bw, ",
                "avx512vl, avx512dq, avx512_bf16, amx_tile, amx_bf16, or the kernel refused the tile data ",
                "(arch_prctl ARCH_REQ_XCOMP_PERM)");
    g_isa = kAmx;
  } else {
    TORCH_CHECK(false, "unknown CPU kernel ISA '", name, "': expected auto, avx2, avx512, avx512_bf16 or amx");
  }
  return isa();
}

// bf16 terms of x in the AMX tiles' exact products: x = x1 + x2 + x3 exactly with x1 = bf16(x), x2 = bf16(x - x1),
// x3 = bf16(x - x1 - x2) (8 significand bits each, float32 has 24), and `tdpbf16ps` multiplies bf16 pairs
// exactly and sums them in float32, so three products give the float32 product to its rounding. (With
// `bf16_x`, one term: the product of bf16(x) with the weights. vcvtneps2bf16 flushes denormals: an |x|
// below ~1e-35 loses its lower terms.)
constexpr int kExactTerms = 3;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// ---- AVX-512 float32: few rows of x as per-block dot products --------------------------------------
//
// tile_fused's sums (d * sum_k x_k q_k + m * sum_k x_k per block) 16 lanes wide, in float32 FMAs. A Q4_1
// block's 16 bytes widen to 16 int32 lanes once; their low nibbles become floats by one 16-entry table
// lookup (`vpermps` reads the low 4 bits of each lane), the high nibbles by a shift and a conversion.
// Q8_0's 32 int8s widen and convert in two halves. The scales d are widened 16 blocks at a time and
// broadcast from memory. Up to kFewRows rows of x, with x as given or rounded to bf16 (`bf16_x`).
// Measured on an AVX-512 host with AMX (2 threads, weights from memory, bench/q4_gemm.py): a decode step's
// linears at 1 row 8.4 -> 4.8 ms against the bf16 dot products of three terms of x this replaced (its
// `vdpbf16ps` retired one per ~1.8 cycles there, where two FMAs retire per cycle, and multiplied every
// weight three times), at 2 rows 12.9 -> 6.1, at 8 rows 24 -> 15 (AVX2 8-row panels and bf16 products).
template <Kind KIND, int MR, int NR>
inline void tile_fused512(const float* x, int64_t ldx, const float* xsum, const QWeight& w, int64_t n0, float* out,
                          int64_t ldo, bool accumulate) {
  const int64_t G = w.k / 32;
  const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  alignas(64) float dbuf[NR][16];
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int64_t gn = std::min<int64_t>(16, G - g0);
    const __mmask16 valid = gn == 16 ? 0xFFFF : __mmask16((1u << gn) - 1);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j)
      _mm512_store_ps(dbuf[j], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.d + (n0 + j) * G + g0)));
    for (int64_t b = 0; b < gn; ++b) {
      const int64_t g = g0 + b;
      __m512 q0[NR], q1[NR];
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        prefetch_block<KIND>(w, n0 + j + kAheadRows, g);  // (a prefetch past the end never faults)
        if (KIND == kQ4_1) {
          const __m512i v = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + (n0 + j) * (w.k / 2) + g * 16)));
          q0[j] = _mm512_permutexvar_ps(v, table);                        // elements 0..15: low nibbles
          q1[j] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));             // 16..31: high nibbles
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + (n0 + j) * w.k + g * 32;
          q0[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
          q1[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        const __m512 x0 = _mm512_loadu_ps(x + i * ldx + g * 32), x1 = _mm512_loadu_ps(x + i * ldx + g * 32 + 16);
#pragma GCC unroll 16
        for (int j = 0; j < NR; ++j)
          acc[i][j] = _mm512_fmadd_ps(_mm512_fmadd_ps(q1[j], x1, _mm512_mul_ps(q0[j], x0)),
                                      _mm512_set1_ps(dbuf[j][b]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      __m512 s = acc[i][j];
      if (KIND == kQ4_1)
        for (int64_t g = 0; g < G; g += 16) {
          const __mmask16 valid = G - g >= 16 ? 0xFFFF : __mmask16((1u << (G - g)) - 1);
          s = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.m + (n0 + j) * G + g)),
                              _mm512_maskz_loadu_ps(valid, xsum + i * G + g), s);
        }
      const float r = _mm512_reduce_add_ps(s);
      float& o = out[i * ldo + n0 + j];
      o = accumulate ? o + r : r;
    }
}

template <Kind KIND, int MR>
void rows_fused512_m(const float* x, int64_t ldx, const float* xsum, const QWeight& w, int64_t n0, int64_t n1,
                     float* out, int64_t ldo, bool accumulate) {
  constexpr int NR = 4;  // 4 weight rows a tile (8 measured slower at every row count)
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile_fused512<KIND, MR, NR>(x, ldx, xsum, w, n, out, ldo, accumulate);
  for (; n < n1; ++n) tile_fused512<KIND, MR, 1>(x, ldx, xsum, w, n, out, ldo, accumulate);
}

// Weight rows n0..n1 for M rows of x (xsum: Q4_1's block sums of x, [M, G]), up to 4 rows a pass (2 a pass
// measured 1.2-1.3x slower at 3-8 rows).
template <Kind KIND>
void rows_fused512_kind(const float* x, int64_t ldx, const float* xsum, int64_t M, const QWeight& w, int64_t n0,
                        int64_t n1, float* out, int64_t ldo, bool accumulate) {
  const int64_t G = w.k / 32;
  for (int64_t i = 0; i < M; i += 4) {
    const float* xi = x + i * ldx;
    const float* si = KIND == kQ4_1 ? xsum + i * G : xsum;
    float* oi = out + i * ldo;
    switch (std::min<int64_t>(M - i, 4)) {
      case 1: rows_fused512_m<KIND, 1>(xi, ldx, si, w, n0, n1, oi, ldo, accumulate); break;
      case 2: rows_fused512_m<KIND, 2>(xi, ldx, si, w, n0, n1, oi, ldo, accumulate); break;
      case 3: rows_fused512_m<KIND, 3>(xi, ldx, si, w, n0, n1, oi, ldo, accumulate); break;
      default: rows_fused512_m<KIND, 4>(xi, ldx, si, w, n0, n1, oi, ldo, accumulate);
    }
  }
}

void rows_fused512(const float* x, int64_t ldx, const float* xsum, int64_t M, const QWeight& w, int64_t n0,
                   int64_t n1, float* out, int64_t ldo, bool accumulate) {
  if (w.kind == kQ4_1) rows_fused512_kind<kQ4_1>(x, ldx, xsum, M, w, n0, n1, out, ldo, accumulate);
  else rows_fused512_kind<kQ8_0>(x, ldx, xsum, M, w, n0, n1, out, ldo, accumulate);
}

// ---- AVX-512 panels: rows_panels' tiles at 16 rows of x per register ----
//
// From 16 rows of x, the dequantized-buffer panels as in rows_panels, with 16-row panels in zmm
// registers: twice the products per FMA, 2 x 12 tiles (24 accumulators of the 32 registers). Each
// output sums its products in the same order as rows_panels (k within a K block, then block by block).

template <int PV, int NR>
inline void tile_panels16(const float* xt, int64_t ldp, const float* wb, int64_t ldw, int64_t kc, float* ct,
                          int64_t P) {
  __m512 acc[PV][NR];
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[p][j] = _mm512_loadu_ps(ct + j * P * 16 + p * 16);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 xv[PV];
#pragma GCC unroll 16
    for (int p = 0; p < PV; ++p) xv[p] = _mm512_loadu_ps(xt + p * ldp + k * 16);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = _mm512_set1_ps(wb[j * ldw + k]);
#pragma GCC unroll 16
      for (int p = 0; p < PV; ++p) acc[p][j] = _mm512_fmadd_ps(xv[p], wv, acc[p][j]);
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(ct + j * P * 16 + p * 16, acc[p][j]);
}

template <int PV, int NR>
void panels16_rows(const float* xt, int64_t ldp, const float* wb, int64_t ldw, int64_t kc, int64_t rows, float* ct,
                   int64_t P) {
  int64_t n = 0;
  for (; n + NR <= rows; n += NR) tile_panels16<PV, NR>(xt, ldp, wb + n * ldw, ldw, kc, ct + n * P * 16, P);
  for (; n < rows; ++n) tile_panels16<PV, 1>(xt, ldp, wb + n * ldw, ldw, kc, ct + n * P * 16, P);
}

// Weight rows n0..n1 for M (a multiple of 16) rows of x packed by pack_panel16.
template <Kind KIND>
void rows_panels16(const float* xt, int64_t M, const QWeight& w, int64_t n0, int64_t n1, float* out, int64_t ldo,
                   bool accumulate) {
  thread_local std::vector<float> buffer, ct;
  const int64_t K = w.k, P = M / 16, rows = n1 - n0;
  buffer.resize(rows * K);
  ct.assign(rows * P * 16, 0.0f);
  for (int64_t n = n0; n < n1; ++n) dequant_row<KIND>(w, n, buffer.data() + (n - n0) * K);
  for (int64_t k0 = 0; k0 < K; k0 += kPanelKc) {
    const int64_t kc = std::min(kPanelKc, K - k0);
    int64_t p = 0;
    for (; p + 2 <= P; p += 2)
      panels16_rows<2, 12>(xt + p * K * 16 + k0 * 16, K * 16, buffer.data() + k0, K, kc, rows, ct.data() + p * 16, P);
    if (p < P)
      panels16_rows<1, 12>(xt + p * K * 16 + k0 * 16, K * 16, buffer.data() + k0, K, kc, rows, ct.data() + p * 16, P);
  }
  for (int64_t i = 0; i < M; ++i) {
    float* o = out + i * ldo + n0;
    const float* c = ct.data() + (i / 16) * 16 + i % 16;
    for (int64_t n = 0; n < rows; ++n) o[n] = accumulate ? o[n] + c[n * P * 16] : c[n * P * 16];
  }
}

void rows_panels16_any(const float* xt, int64_t M, const QWeight& w, int64_t n0, int64_t n1, float* out, int64_t ldo,
                       bool accumulate) {
  if (w.kind == kQ4_1) rows_panels16<kQ4_1>(xt, M, w, n0, n1, out, ldo, accumulate);
  else rows_panels16<kQ8_0>(xt, M, w, n0, n1, out, ldo, accumulate);
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

// Block sums of bf16(x): xsum[i * G + g] = sum of bf16(x[i][32g .. 32g + 31]), for `bf16_x`.
void block_sums_bf16(const float* x, int64_t ldx, int64_t M, int64_t G, float* xsum) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* xs = x + i * ldx + g * 32;
      const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xs + 16), _mm512_loadu_ps(xs));
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
      const __m512 hi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
      xsum[i * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

// x[M, K] as bf16(x) in float32 (out: row stride K), for `bf16_x` in the few-row tiles.
void round_to_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, float* out) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; k += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * ldx + k));
      _mm512_storeu_ps(out + i * K + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)));
    }
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// ---- AVX-512 BF16 with x rounded to bf16 (`bf16_x`): 16-row panels of bf16 pairs -----------------------
//
// An opt-in precision (the engine's `quantized_activations="bfloat16"`): y = bf16(x) @ W.T, W's values
// exact. A panel holds 16 rows of x as bf16 pairs, xt[(k / 2) * 32 + 2r + k % 2] = bf16(x[16p + r][k]),
// so one `vdpbf16ps` against a broadcast pair of a weight row's integer values (exact in bf16) adds 2
// products to each of 16 rows: 32 multiply-adds an instruction where the float32 panels do 16. The sums
// run per block (32 values), then d * sum + m * sum(bf16(x)) in float32, as llama.cpp scales its blocks.

// Panel p as bf16 pairs, from pack_panel16's float32 panel xf (xf[k * 16 + r]): `terms` panels of pairs,
// term t at xt + t * K * 16 (x = x1 + x2 + x3 for 3, bf16(x) for 1: see split_bf16); with `sums`, each block's
// sum per row of the values the terms add up to (x, or bf16(x) for one term) at sums[g * 16 + r].
void pairs_panel16(const float* xf, int64_t K, uint16_t* xt, int terms = 1, float* sums = nullptr) {
  const __m512i lo_index = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_index = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  auto widen = [](__m256bh h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)); };
  __m512 block_sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512 a = _mm512_loadu_ps(xf + k * 16), b = _mm512_loadu_ps(xf + (k + 1) * 16);
    if (sums != nullptr) {
      block_sum = _mm512_add_ps(block_sum, terms == 1 ? widen(_mm512_cvtneps_pbh(a)) : a);
      block_sum = _mm512_add_ps(block_sum, terms == 1 ? widen(_mm512_cvtneps_pbh(b)) : b);
      if ((k + 2) % 32 == 0) {
        _mm512_storeu_ps(sums + (k / 32) * 16, block_sum);
        block_sum = _mm512_setzero_ps();
      }
    }
    for (int t = 0; t < terms; ++t) {
      const __m512 lo = _mm512_permutex2var_ps(a, lo_index, b);  // rows 0..7: (x[r][k], x[r][k + 1])
      const __m512 hi = _mm512_permutex2var_ps(a, hi_index, b);  // rows 8..15
      _mm512_storeu_si512(xt + t * K * 16 + k * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      if (t + 1 < terms) {
        a = _mm512_sub_ps(a, widen(_mm512_cvtneps_pbh(a)));
        b = _mm512_sub_ps(b, widen(_mm512_cvtneps_pbh(b)));
      }
    }
  }
}

// Row n's float16 scales (and Q4_1's offsets) widened to float32, 16 at a time: d[0..G), m[0..G).
inline void widen_row_scales(const QWeight& w, int64_t n, float* d, float* m) {
  const int64_t G = w.k / 32;
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 valid = G - g >= 16 ? 0xFFFF : __mmask16((1u << (G - g)) - 1);
    _mm512_mask_storeu_ps(d + g, valid, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.d + n * G + g)));
    if (w.kind == kQ4_1)
      _mm512_mask_storeu_ps(m + g, valid, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, w.m + n * G + g)));
  }
}

// Row n of W's integer values as K bf16s, in the row's order (Q4_1: 0..15, Q8_0: -128..127).
template <Kind KIND>
inline void values_row_bf16(const QWeight& w, int64_t n, uint16_t* out) {
  const int64_t G = w.k / 32;
  if (KIND == kQ4_1) {
    // bf16(v) for v in 0..15: a 16-word vpermw reads the low 4 bits, so the low nibble needs no mask.
    const __m256i table = _mm256_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                           0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const uint8_t* q = w.qs + n * (w.k / 2);
    for (int64_t g = 0; g < G; ++g, q += 16, out += 32) {
      prefetch_block<KIND>(w, n + kAheadRows, g);  // the scales are streams of their own (see kAheadRows)
      const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutexvar_epi16(words, table));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16),
                          _mm256_permutexvar_epi16(_mm256_srli_epi16(words, 4), table));
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + n * w.k;
    for (int64_t g = 0; g < G; ++g, q += 32, out += 32) {
      prefetch_block<KIND>(w, n + kAheadRows, g);
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      const __m512 f1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
      _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
  }
}

// PV panels of x (xt, panel stride ldp) times NR weight rows (wq: values, row stride ldw; wd / wm: scales,
// row stride G), over all G blocks; xs[p * G * 16 + g * 16 + r]: panel p's block sums. Writes the
// tile's sums to ct[j][p][16] (stride P * 16 per weight row).
template <Kind KIND, int PV, int NR>
inline void tile_pairs16(const uint16_t* xt, int64_t ldp, const float* xs, const uint16_t* wq, int64_t ldw,
                         const float* wd, const float* wm, int64_t G, float* ct, int64_t P) {
  __m512 acc[PV][NR];
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[p][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[PV][NR];
#pragma GCC unroll 16
    for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) part[p][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int kp = 0; kp < 16; ++kp) {
      __m512bh xv[PV];
#pragma GCC unroll 16
      for (int p = 0; p < PV; ++p) xv[p] = load_bh(xt + p * ldp + (g * 16 + kp) * 32);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) {
        int32_t pair;
        std::memcpy(&pair, wq + j * ldw + g * 32 + 2 * kp, 4);
        const __m512bh wv = as_bh(_mm512_set1_epi32(pair));
#pragma GCC unroll 16
        for (int p = 0; p < PV; ++p) part[p][j] = _mm512_dpbf16_ps(part[p][j], xv[p], wv);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m512 dv = _mm512_set1_ps(wd[j * G + g]);
#pragma GCC unroll 16
      for (int p = 0; p < PV; ++p) acc[p][j] = _mm512_fmadd_ps(part[p][j], dv, acc[p][j]);
      if (KIND == kQ4_1) {
        const __m512 mv = _mm512_set1_ps(wm[j * G + g]);
#pragma GCC unroll 16
        for (int p = 0; p < PV; ++p)
          acc[p][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + p * G * 16 + g * 16), mv, acc[p][j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < PV; ++p)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(ct + j * P * 16 + p * 16, acc[p][j]);
}

template <Kind KIND, int PV, int NR>
void pairs16_rows(const uint16_t* xt, int64_t ldp, const float* xs, const uint16_t* wq, int64_t ldw, const float* wd,
                  const float* wm, int64_t G, int64_t rows, float* ct, int64_t P) {
  int64_t n = 0;
  for (; n + NR <= rows; n += NR)
    tile_pairs16<KIND, PV, NR>(xt, ldp, xs, wq + n * ldw, ldw, wd + n * G, wm + n * G, G, ct + n * P * 16, P);
  for (; n < rows; ++n)
    tile_pairs16<KIND, PV, 1>(xt, ldp, xs, wq + n * ldw, ldw, wd + n * G, wm + n * G, G, ct + n * P * 16, P);
}

// Weight rows n0..n1 for the M rows of x in P = ceil(M / 16) panels of pairs (xt, from pairs_panel16)
// with their block sums xs.
template <Kind KIND>
void rows_pairs16(const uint16_t* xt, const float* xs, int64_t M, const QWeight& w, int64_t n0, int64_t n1,
                  float* out, int64_t ldo, bool accumulate) {
  thread_local std::vector<uint16_t> values;
  thread_local std::vector<float> scales, offsets, ct;
  const int64_t K = w.k, G = K / 32, P = (M + 15) / 16, rows = n1 - n0;
  values.resize(rows * K);
  scales.resize(rows * G);
  offsets.resize(rows * G);
  ct.resize(rows * P * 16);
  for (int64_t n = n0; n < n1; ++n) {
    values_row_bf16<KIND>(w, n, values.data() + (n - n0) * K);
    widen_row_scales(w, n, scales.data() + (n - n0) * G, offsets.data() + (n - n0) * G);
  }
  int64_t p = 0;
  for (; p + 2 <= P; p += 2)
    pairs16_rows<KIND, 2, 6>(xt + p * K * 16, K * 16, xs + p * G * 16, values.data(), K, scales.data(), offsets.data(),
                             G, rows, ct.data() + p * 16, P);
  if (p < P)
    pairs16_rows<KIND, 1, 12>(xt + p * K * 16, K * 16, xs + p * G * 16, values.data(), K, scales.data(),
                              offsets.data(), G, rows, ct.data() + p * 16, P);
  for (int64_t i = 0; i < M; ++i) {
    float* o = out + i * ldo + n0;
    const float* c = ct.data() + (i / 16) * 16 + i % 16;
    for (int64_t n = 0; n < rows; ++n) o[n] = accumulate ? o[n] + c[n * P * 16] : c[n * P * 16];
  }
}

void rows_pairs16_any(const uint16_t* xt, const float* xs, int64_t M, const QWeight& w, int64_t n0, int64_t n1,
                      float* out, int64_t ldo, bool accumulate) {
  if (w.kind == kQ4_1) rows_pairs16<kQ4_1>(xt, xs, M, w, n0, n1, out, ldo, accumulate);
  else rows_pairs16<kQ8_0>(xt, xs, M, w, n0, n1, out, ldo, accumulate);
}

#pragma GCC pop_options

// ---- AMX: 16 x 16 tiles of bf16 products ----------------------------------------------------------
//
// From 16 rows of x on a CPU with AMX-BF16 (`amx`), in both precisions: x = x1 + x2 + x3 in bf16 terms
// (the float32 product to its rounding, as the few-row bf16 tiles above), or with `bf16_x` x1 alone. One
// `tdpbf16ps` multiplies 16 weight rows' values of one block (A: 16 rows x 32 bf16, exact: Q4_1's 0..15,
// Q8_0's -128..127) by one block of 16 rows of x as bf16 pairs (B: the panels of pairs above, 16 pair-rows
// x 32 bf16) and sums the 32 products of each (weight row, x row) in float32: C[j][r], 8,192 multiply-adds
// an instruction where `vdpbf16ps` does 32. Each term of x adds to the same C (the scaling is linear); then
// per block out += d * C (+ m * sum of the block's x, for Q4_1), as the other paths scale their blocks. The
// tiles' products are exact and their sums are float32's, in another order than the other paths' (and,
// as AMX does, with bf16 denormal inputs read as 0, so an |x| below ~1e-38 loses its lower terms).

constexpr int64_t kAmxRows = 16;        // weight rows per A tile; x rows per B tile
constexpr int64_t kAmxChunkRows = 32;   // weight rows per parallel chunk

// Tiles 0 (A: weight values), 1 (B: x pairs), 2 and 3 (C: float32 sums), each 16 rows of 64 bytes. Tile
// configuration is per thread; a thread loads it before its first tile instruction of a call.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16};
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

// Weight rows n0..n1 (at most kAmxChunkRows) for the M rows of x in P = ceil(M / 16) panels of `terms`
// pair-panels each (xt, panel stride terms * K * 16) with their block sums xs[(p * G + g) * 16 + r].
template <Kind KIND>
void rows_amx(const uint16_t* xt, const float* xs, int64_t M, int terms, const QWeight& w, int64_t n0, int64_t n1,
              float* out, int64_t ldo, bool accumulate) {
  thread_local std::vector<uint16_t> values;
  thread_local std::vector<float> scales, offsets;
  static const TileConfig config;
  const int64_t K = w.k, G = K / 32, P = (M + 15) / 16, rows = n1 - n0;
  const int64_t groups = (rows + kAmxRows - 1) / kAmxRows;
  values.resize(groups * kAmxRows * K);
  scales.resize(groups * kAmxRows * G);
  offsets.resize(groups * kAmxRows * G);
  for (int64_t n = n0; n < n1; ++n) {
    values_row_bf16<KIND>(w, n, values.data() + (n - n0) * K);
    widen_row_scales(w, n, scales.data() + (n - n0) * G, offsets.data() + (n - n0) * G);
  }
  // Rows past n1 in the last A tile: values 0, scales 0.
  std::fill(values.begin() + rows * K, values.end(), 0);
  std::fill(scales.begin() + rows * G, scales.end(), 0.0f);
  std::fill(offsets.begin() + rows * G, offsets.end(), 0.0f);
  _tile_loadconfig(&config);
  alignas(64) float c2[kAmxRows * 16], c3[kAmxRows * 16];  // the C tiles' copies
  for (int64_t h = 0; h < groups; ++h) {
    const uint16_t* a = values.data() + h * kAmxRows * K;
    const float* d = scales.data() + h * kAmxRows * G;
    const float* m = offsets.data() + h * kAmxRows * G;
    for (int64_t p = 0; p < P; ++p) {
      __m512 acc[kAmxRows];
#pragma GCC unroll 16
      for (int j = 0; j < kAmxRows; ++j) acc[j] = _mm512_setzero_ps();
      const uint16_t* b = xt + p * terms * K * 16;
      // Block g's sums (in tile 2 or 3) scaled into acc, from their copy c.
      auto scale = [&](const float* c, int64_t g) {
        const __m512 sum = KIND == kQ4_1 ? _mm512_loadu_ps(xs + (p * G + g) * 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int j = 0; j < kAmxRows; ++j) {
          acc[j] = _mm512_fmadd_ps(_mm512_load_ps(c + j * 16), _mm512_set1_ps(d[j * G + g]), acc[j]);
          if (KIND == kQ4_1) acc[j] = _mm512_fmadd_ps(sum, _mm512_set1_ps(m[j * G + g]), acc[j]);
        }
      };
      // Two C tiles in turn: block g + 1's products run while block g's sums are stored and scaled.
#define L4M_AMX_BLOCK(C, g)                              \
  do {                                                   \
    _tile_zero(C);                                       \
    _tile_loadd(0, a + (g) * 32, K * 2);                 \
    for (int t = 0; t < terms; ++t) {                    \
      _tile_loadd(1, b + t * K * 16 + (g) * 512, 64);    \
      _tile_dpbf16ps(C, 0, 1);                           \
    }                                                    \
  } while (0)
      L4M_AMX_BLOCK(2, 0);
      for (int64_t g = 0; g < G; g += 2) {
        if (g + 1 < G) L4M_AMX_BLOCK(3, g + 1);
        _tile_stored(2, c2, 64);
        scale(c2, g);
        if (g + 1 < G) {
          if (g + 2 < G) L4M_AMX_BLOCK(2, g + 2);
          _tile_stored(3, c3, 64);
          scale(c3, g + 1);
        }
      }
#undef L4M_AMX_BLOCK
      alignas(64) float tile[kAmxRows][16];
#pragma GCC unroll 16
      for (int j = 0; j < kAmxRows; ++j) _mm512_store_ps(tile[j], acc[j]);
      const int64_t weight_rows = std::min(kAmxRows, rows - h * kAmxRows);
      for (int64_t r = 0; r < 16 && 16 * p + r < M; ++r) {
        float* o = out + (16 * p + r) * ldo + n0 + h * kAmxRows;
        for (int64_t j = 0; j < weight_rows; ++j) o[j] = accumulate ? o[j] + tile[j][r] : tile[j][r];
      }
    }
  }
  _tile_release();
}

// out[M, N] (or +=) = x @ W.T for M >= 16 on AMX; with `bf16_x`, bf16(x) @ W.T.
void linear_amx(const float* x, int64_t ldx, int64_t M, const QWeight& w, float* out, int64_t ldo, bool accumulate,
                bool bf16_x) {
  const int terms = bf16_x ? 1 : kExactTerms;
  const int64_t K = w.k, G = K / 32, P = (M + 15) / 16;
  const std::unique_ptr<float[]> xf(new float[K * 16]);
  const std::unique_ptr<uint16_t[]> xt(new uint16_t[P * terms * K * 16]);
  std::vector<float> xs(w.kind == kQ4_1 ? P * G * 16 : 0);
  for (int64_t p = 0; p < P; ++p) {
    pack_panel16(x, ldx, M, K, p, xf.get());
    pairs_panel16(xf.get(), K, xt.get() + p * terms * K * 16, terms, xs.empty() ? nullptr : xs.data() + p * G * 16);
  }
  parallel_chunks((w.n + kAmxChunkRows - 1) / kAmxChunkRows, [&](int64_t c) {
    const int64_t n0 = c * kAmxChunkRows, n1 = std::min(w.n, n0 + kAmxChunkRows);
    if (w.kind == kQ4_1) rows_amx<kQ4_1>(xt.get(), xs.data(), M, terms, w, n0, n1, out, ldo, accumulate);
    else rows_amx<kQ8_0>(xt.get(), xs.data(), M, terms, w, n0, n1, out, ldo, accumulate);
  });
}

#pragma GCC pop_options

constexpr int64_t kPanelRowsAtOnce = 512;  // rows of x per pass over the weights (6,400 rows: 1.3-2x faster)
constexpr int64_t kChunkRows = 24;  // weight rows per parallel chunk (a multiple of 2, 3, 4, 6 and 12)

// Rows of x up to which the AVX-512 paths take the few-row tiles (rows_fused512); more take AMX's tiles
// (padded to 16 rows: at 9-15 rows 17 ms a decode step's linears against 22-29 on the few-row tiles or the
// AVX2 tiles) or, without AMX, the 16-row panels.
constexpr int64_t kFewRows = 8;

// Block sums of x: xsum[i * G + g] = sum of x[i][32g .. 32g + 31], for the fused Q4_1 tiles' m terms.
void block_sums(const float* x, int64_t ldx, int64_t M, int64_t G, float* xsum) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* xs = x + i * ldx + g * 32;
      xsum[i * G + g] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xs), _mm256_loadu_ps(xs + 8)),
                                           _mm256_add_ps(_mm256_loadu_ps(xs + 16), _mm256_loadu_ps(xs + 24))));
    }
}

// out[M, N] (row stride ldo) = (or +=) x[M, K] @ W.T; with `bf16_x`, bf16(x) @ W.T (AVX-512 BF16 only).
void linear_into(const float* x, int64_t ldx, int64_t M, const QWeight& w, float* out, int64_t ldo, bool accumulate,
                 bool bf16_x) {
  const int chosen = g_isa.load(std::memory_order_relaxed);
  const bool avx512 = chosen >= kAvx512;
  TORCH_CHECK(!bf16_x || chosen >= kAvx512Bf16, "x rounded to bf16 (quantized_activations=bfloat16) needs the CPU kernels' ",
              "avx512_bf16 instruction set; they run ", isa());
  if (M == 0) return;
  const int64_t G = w.k / 32;
  const int64_t chunks = (w.n + kChunkRows - 1) / kChunkRows;
  if (M > kPanelRowsAtOnce && avx512) {
    // Every weight chunk streams all the packed rows of x: at a prefill's thousands of rows they no
    // longer stay in cache, so the rows go in blocks (each block reads the weights again, from cache).
    for (int64_t m0 = 0; m0 < M; m0 += kPanelRowsAtOnce)
      linear_into(x + m0 * ldx, ldx, std::min(kPanelRowsAtOnce, M - m0), w, out + m0 * ldo, ldo, accumulate, bf16_x);
    return;
  }
  if (M > kFewRows && chosen == kAmx) return linear_amx(x, ldx, M, w, out, ldo, accumulate, bf16_x);
  if (avx512 && M <= kFewRows) {
    std::vector<float> rounded;  // bf16(x) in float32, for `bf16_x`
    if (bf16_x) {
      rounded.resize(M * w.k);
      round_to_bf16(x, ldx, M, w.k, rounded.data());
      x = rounded.data(), ldx = w.k;
    }
    std::vector<float> xsum(w.kind == kQ4_1 ? M * G : 0);  // Q4_1's block sums of x
    if (w.kind == kQ4_1) block_sums(x, ldx, M, G, xsum.data());
    parallel_chunks_ahead(
        chunks, [&](int64_t c) { prefetch_rows(w, c * kChunkRows, std::min(w.n, (c + 1) * kChunkRows)); },
        [&](int64_t c) {
          const int64_t n0 = c * kChunkRows, n1 = std::min(w.n, n0 + kChunkRows);
          rows_fused512(x, ldx, xsum.data(), M, w, n0, n1, out, ldo, accumulate);
        });
    return;
  }
  if (bf16_x) {  // 9 rows and more without AMX: x's bf16 pairs in 16-row panels
    std::vector<float> sums;  // block sums of bf16(x), for Q4_1's m terms (Q8_0 has none)
    if (w.kind == kQ4_1) {
      sums.resize(M * G);
      block_sums_bf16(x, ldx, M, G, sums.data());
    }
    const int64_t P = (M + 15) / 16;
    const std::unique_ptr<float[]> xf(new float[w.k * 16]);
    const std::unique_ptr<uint16_t[]> pairs(new uint16_t[P * w.k * 16]);
    std::vector<float> xs(P * G * 16, 0.0f);  // the sums per panel, block and row (rows past M, and Q8_0: 0)
    for (int64_t p = 0; p < P; ++p) {
      pack_panel16(x, ldx, M, w.k, p, xf.get());
      pairs_panel16(xf.get(), w.k, pairs.get() + p * w.k * 16);
      if (sums.empty()) continue;
      for (int64_t r = 0; r < 16 && 16 * p + r < M; ++r)
        for (int64_t g = 0; g < G; ++g) xs[(p * G + g) * 16 + r] = sums[(16 * p + r) * G + g];
    }
    parallel_chunks(chunks, [&](int64_t c) {
      const int64_t n0 = c * kChunkRows, n1 = std::min(w.n, n0 + kChunkRows);
      rows_pairs16_any(pairs.get(), xs.data(), M, w, n0, n1, out, ldo, accumulate);
    });
    return;
  }
  std::vector<float> xsum;  // block sums of x, for the fused Q4_1 tiles
  if (M <= 2 && w.kind == kQ4_1) {
    xsum.resize(M * G);
    block_sums(x, ldx, M, G, xsum.data());
  }
  if (M >= 16 && avx512) {
    // The whole 16-row panels here; the rows past them (1-15) by this function again (reading W again).
    const int64_t M16 = M / 16 * 16, P = M16 / 16;
    const std::unique_ptr<float[]> panels(new float[P * w.k * 16]);
    float* xt = panels.get();
    for (int64_t p = 0; p < P; ++p) pack_panel16(x, ldx, M16, w.k, p, xt + p * w.k * 16);
    parallel_chunks(chunks, [&](int64_t c) {
      const int64_t n0 = c * kChunkRows, n1 = std::min(w.n, n0 + kChunkRows);
      rows_panels16_any(xt, M16, w, n0, n1, out, ldo, accumulate);
    });
    if (M16 < M) linear_into(x + M16 * ldx, ldx, M - M16, w, out + M16 * ldo, ldo, accumulate, false);
    return;
  }
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

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                  bool bf16_x) {
  const QWeight w = make_qweight(qs, d, m);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == w.k,
              "x must be float32 [M, ", w.k, "]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, x.options());
  linear_into(x.data_ptr<float>(), w.k, x.size(0), w, out.data_ptr<float>(), w.n, false, bf16_x);
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
  void* cache;  // [P, 2, S, KVH, D] of float32, or of float16 where `half`
  bool half;
  int64_t S, KVH, D;
  const int64_t* table;  // [B, max_pages]
  int64_t max_pages;
  const int64_t* ctx_len;  // [B] tokens of the item, the new one included
  const uint8_t* visible;  // [B, width]: slot t of the item may be attended
  int64_t width;
  int64_t slot_offset(int64_t b, int64_t t, int kv) const {  // element offset of K (0) / V (1) of slot t
    const int64_t page = table[b * max_pages + t / S];
    return ((page * 2 + kv) * S + t % S) * KVH * D;
  }
};

template <int D, typename T>
void attention_task(const float* qkv, int64_t ld_qkv, int64_t H, const Pages& p, int64_t b, int64_t kh, float* out) {
  const T* cache = static_cast<const T*>(p.cache);
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
      if (g == 0)  // the first head reads K and V from memory: fetch 16 slots ahead (strided rows)
        for (int64_t t = i0 == 0 ? 0 : i0 + 16; t < std::min(i0 + 24, count); ++t)
          for (int c = 0; c < D; c += 64 / int(sizeof(T))) {  // a cache line at a time
            _mm_prefetch(reinterpret_cast<const char*>(cache + offsets[t] + c), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(cache + offsets[t] + v_shift + c), _MM_HINT_T0);
          }
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) {
        const T* k = cache + offsets[std::min(i0 + t, count - 1)];  // past the end: a repeat, unused
        __m256 a = _mm256_mul_ps(qv[0], load8(k));
        for (int c = 1; c < D / 8; ++c) a = _mm256_fmadd_ps(qv[c], load8(k + 8 * c), a);
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
      const T* v = cache + offsets[j] + v_shift;
      const __m256 w = _mm256_set1_ps(scores[j]);
      for (int c = 0; c < D / 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
}

// Task b * KVH + kh of attention(): item b's heads that share KV head kh.
void attention_one(const float* qkv, int64_t ld_qkv, int64_t H, const Pages& p, int64_t task, float* out) {
  const int64_t b = task / p.KVH, kh = task % p.KVH;
  switch (p.D * 2 + p.half) {
    case 128: attention_task<64, float>(qkv, ld_qkv, H, p, b, kh, out); break;
    case 129: attention_task<64, uint16_t>(qkv, ld_qkv, H, p, b, kh, out); break;
    case 256: attention_task<128, float>(qkv, ld_qkv, H, p, b, kh, out); break;
    case 257: attention_task<128, uint16_t>(qkv, ld_qkv, H, p, b, kh, out); break;
    default: TORCH_CHECK(false, "decode_layers supports head_dim 64 or 128, got ", p.D);
  }
}

void attention(const float* qkv, int64_t ld_qkv, int64_t B, int64_t H, const Pages& p, float* out) {
  parallel_chunks(B * p.KVH, [&](int64_t task) { attention_one(qkv, ld_qkv, H, p, task, out); });
}

// ---- a padded group's attention (a prefill chunk), K/V read straight from the pages ---------------
//
// The group's items attend as SDPA does over the padded path's gathered K/V (attention.py's
// `_padded_attention`), without the gather: each slot's K and V rows are read in place through the
// group's kv_index. A task is (item, KV head, block of query rows, span of slots): its query rows are
// the block's tokens times the `group` heads that share the KV head, so every K/V row loaded serves all
// of them. Per block of kGroupBk slots: K^T packed (8 x 8 transposes), scores as a small GEMM
// (6 rows x 16 slots of outputs in registers), the additive mask, an online softmax (running max and sum
// per row), then P x V into the task's running output. The spans of one (item, KV head, row block) are
// merged at the end, as flash-decoding does: split over slots, not only rows, so that 2 threads balance
// when the group is one item (3 KV heads). AVX2 only: torch's SDPA runs AVX-512 on a CPU that has it,
// so the win over it is the gather saved and the K/V reuse, not wider vectors.

constexpr int64_t kGroupBk = 128;  // slots per block (64 measured 2-7 % slower; K^T and scores in L1/L2)
constexpr int64_t kGroupRows = 64;  // query rows (tokens x heads of a KV head) per task at most (96 alike)
constexpr int64_t kGroupTasksPerThread = 8;

struct GroupAttention {
  const float* q;  // row r = b * Tq + t of the group: head h at q + r * ld_q + h * D (RoPE applied)
  int64_t ld_q;
  const void* cache;  // a layer's cache, rows of KVH * D values ([pages * 2 * S] rows), float16 where `half`
  bool half;
  int64_t KVH, D, H;
  const int64_t* kv_index;  // [Bc, 2, Tkv] rows of each slot's K (0) and V (1)
  const float* mask;        // [Bc, Tq, Tkv] additive: 0 = attend, -inf = hidden
  int64_t Bc, Tq, Tkv;
  float* out;  // row r, head h at out + r * ld_out + h * D
  int64_t ld_out;
};

// The work split: tokens per row block, row blocks per item, slot spans per (item, KV head, row block).
struct GroupSplit {
  int64_t tokens_per_block, row_blocks, span, spans;
  GroupSplit(const GroupAttention& a, int64_t threads) {
    const int64_t group = a.H / a.KVH;
    const int64_t most = std::max<int64_t>(1, kGroupRows / group);  // tokens per block at most, cut evenly
    row_blocks = (a.Tq + most - 1) / most;
    tokens_per_block = std::max<int64_t>(1, (a.Tq + row_blocks - 1) / std::max<int64_t>(1, row_blocks));
    // Enough tasks for the threads to balance, each span at least one block.
    const int64_t heads = std::max<int64_t>(1, a.Bc * a.KVH * row_blocks);
    const int64_t blocks = std::max<int64_t>(1, (a.Tkv + kGroupBk - 1) / kGroupBk);
    const int64_t wanted = std::clamp<int64_t>((kGroupTasksPerThread * threads + heads - 1) / heads, 1, blocks);
    span = (blocks + wanted - 1) / wanted * kGroupBk;
    spans = std::max<int64_t>(1, (a.Tkv + span - 1) / span);
  }
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// sc[r][8v + lane] = qp[r] . K[slot 8v + lane] for MR rows and NV vectors of 8 slots (kt: [D][kGroupBk]).
template <int D, int MR, int NV>
inline void score_tile(const float* qp, const float* kt, float* sc) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 kv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) kv[v] = _mm256_loadu_ps(kt + d * kGroupBk + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 qb = _mm256_broadcast_ss(qp + r * D + d);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(qb, kv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(sc + r * kGroupBk + 8 * v, acc[r][v]);
}

template <int D, int MR>
void score_rows(const float* qp, const float* kt, int64_t vectors, float* sc) {
  int64_t v = 0;
  for (; v + 2 <= vectors; v += 2) score_tile<D, MR, 2>(qp, kt + 8 * v, sc + 8 * v);
  if (v < vectors) score_tile<D, MR, 1>(qp, kt + 8 * v, sc + 8 * v);
}

// o[r][c0 .. c0 + 32) += sum_j p[r][j] V[j][c0 .. c0 + 32) for MR rows over n slots.
template <int D, int MR, typename T>
inline void pv_tile(const float* p, const T* const* v_rows, int64_t n, float* o, int64_t c0) {
  __m256 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(o + r * D + c0 + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = v_rows[j] + c0;
    __m256 pr[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) pr[r] = _mm256_broadcast_ss(p + r * kGroupBk + j);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 vv = load8(v + 8 * c);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(pr[r], vv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + r * D + c0 + 8 * c, acc[r][c]);
}

template <int D, int MR, typename T>
void pv_rows(const float* p, const T* const* v_rows, int64_t n, float* o) {
  for (int64_t c0 = 0; c0 < D; c0 += 32) pv_tile<D, MR, T>(p, v_rows, n, o, c0);
}

// One row's block of scores: the mask added (slots past n hidden), the running max and sum updated, the
// scores turned into exp(s - max) (0 where hidden), the row's output rescaled to the new max.
template <int D>
void softmax_row(float* s, const float* mask_row, int64_t n, float& m_run, float& l_run, float* o) {
  const int64_t vectors = (n + 7) / 8;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 vmax = neg_inf;
  for (int64_t v = 0; v < vectors; ++v) {
    __m256 mk;
    if (8 * v + 8 <= n) {
      mk = _mm256_loadu_ps(mask_row + 8 * v);
    } else {
      alignas(32) float tail[8];
      for (int k = 0; k < 8; ++k) tail[k] = 8 * v + k < n ? mask_row[8 * v + k] : -INFINITY;
      mk = _mm256_load_ps(tail);
    }
    const __m256 x = _mm256_add_ps(_mm256_loadu_ps(s + 8 * v), mk);
    _mm256_storeu_ps(s + 8 * v, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  const float m_new = std::max(m_run, hmax(vmax));
  if (m_new == -INFINITY) {  // nothing seen yet: no weight, no change
    std::fill_n(s, vectors * 8, 0.0f);
    return;
  }
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t v = 0; v < vectors; ++v) {
    const __m256 x = _mm256_loadu_ps(s + 8 * v);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, vm)), _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + 8 * v, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const float alpha = m_run == -INFINITY ? 0.0f : std::exp(m_run - m_new);
  l_run = l_run * alpha + hsum(vsum);
  if (alpha != 1.0f) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), va));
  }
  m_run = m_new;
}

template <int D, typename T>
inline void prefetch_row(const T* row) {
  for (int c = 0; c < D; c += 64 / int(sizeof(T))) _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T0);
}

// One task: item b, KV head kh, tokens t0 .. t0 + nt, slots s0 .. s1. Its rows (i = (t - t0) * group + g
// for head kh * group + g) leave their unnormalized output, running max and sum in o, m_run, l_run.
template <int D, typename T>
void group_attention_span(const GroupAttention& a, int64_t b, int64_t kh, int64_t t0, int64_t nt, int64_t s0,
                          int64_t s1, float* o, float* m_run, float* l_run) {
  const T* cache = static_cast<const T*>(a.cache);
  const int64_t group = a.H / a.KVH, M = nt * group, row = a.KVH * D;
  thread_local std::vector<float> qp, kt, sc;
  qp.resize(M * D);
  kt.resize(D * kGroupBk);
  sc.resize(M * kGroupBk);
  const float scale = 1.0f / std::sqrt(float(D));
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const float* q = a.q + (b * a.Tq + t0 + t) * a.ld_q + (kh * group + g) * D;
      float* dst = qp.data() + (t * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = q[d] * scale;
    }
  std::fill_n(o, M * D, 0.0f);
  std::fill_n(m_run, M, -INFINITY);
  std::fill_n(l_run, M, 0.0f);
  const int64_t* k_index = a.kv_index + b * 2 * a.Tkv;
  const int64_t* v_index = k_index + a.Tkv;
  const float* mask = a.mask + (b * a.Tq + t0) * a.Tkv;
  const T* v_rows[kGroupBk];
  for (int64_t j0 = s0; j0 < s1; j0 += kGroupBk) {
    const int64_t n = std::min(kGroupBk, s1 - j0), vectors = (n + 7) / 8;
    bool seen = false;  // a block every row's mask hides costs nothing (the causal tail, hidden pages)
    for (int64_t t = 0; t < nt && !seen; ++t)
      for (int64_t j = 0; j < n; ++j)
        if (mask[t * a.Tkv + j0 + j] != -INFINITY) {
          seen = true;
          break;
        }
    if (!seen) continue;
    // The rows come from memory (a layer's K/V is read once per step; one thread measured 1.07 ms
    // per layer against 0.81 on a warm cache): ask now for this block's V rows, used after the scores,
    // and the next block's K rows (1.02 ms).
    for (int64_t j = 0; j < n; ++j) prefetch_row<D>(cache + v_index[j0 + j] * row + kh * D);
    for (int64_t j = j0 + kGroupBk; j < std::min(s1, j0 + 2 * kGroupBk); ++j)
      prefetch_row<D>(cache + k_index[j] * row + kh * D);
    for (int64_t v = 0; v < vectors; ++v)  // kt[d][j] = K[j][d], 8 slots x 8 dims at a time
      for (int64_t d8 = 0; d8 < D; d8 += 8) {
        __m256 r[8];
        for (int k = 0; k < 8; ++k) {
          const int64_t j = 8 * v + k;
          r[k] = j < n ? load8(cache + k_index[j0 + j] * row + kh * D + d8) : _mm256_setzero_ps();
        }
        transpose8(r);
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(kt.data() + (d8 + c) * kGroupBk + 8 * v, r[c]);
      }
    for (int64_t j = 0; j < n; ++j) v_rows[j] = cache + v_index[j0 + j] * row + kh * D;
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) score_rows<D, 6>(qp.data() + i * D, kt.data(), vectors, sc.data() + i * kGroupBk);
    for (; i < M; ++i) score_rows<D, 1>(qp.data() + i * D, kt.data(), vectors, sc.data() + i * kGroupBk);
    for (i = 0; i < M; ++i)
      softmax_row<D>(sc.data() + i * kGroupBk, mask + (i / group) * a.Tkv + j0, n, m_run[i], l_run[i], o + i * D);
    for (i = 0; i + 3 <= M; i += 3) pv_rows<D, 3, T>(sc.data() + i * kGroupBk, v_rows, n, o + i * D);
    for (; i < M; ++i) pv_rows<D, 1, T>(sc.data() + i * kGroupBk, v_rows, n, o + i * D);
  }
}

// The spans' partial rows merged into the output: rescaled to their common max, divided by the sum;
// a row that saw nothing gets 0 (as the general path gives its dead rows).
template <int D>
void group_attention_merge(const GroupAttention& a, const GroupSplit& split, const float* parts, int64_t rows_cap,
                           int64_t b, int64_t kh, int64_t rb) {
  const int64_t group = a.H / a.KVH, t0 = rb * split.tokens_per_block;
  const int64_t M = std::min(split.tokens_per_block, a.Tq - t0) * group, part = rows_cap * (D + 2);
  for (int64_t i = 0; i < M; ++i) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < split.spans; ++s) mx = std::max(mx, parts[s * part + rows_cap * D + i]);
    float* dst = a.out + (b * a.Tq + t0 + i / group) * a.ld_out + (kh * group + i % group) * D;
    if (mx == -INFINITY) {
      std::fill_n(dst, D, 0.0f);
      continue;
    }
    __m256 acc[D / 8];
    for (int c = 0; c < D / 8; ++c) acc[c] = _mm256_setzero_ps();
    float sum = 0.0f;
    for (int64_t s = 0; s < split.spans; ++s) {
      const float* o = parts + s * part;
      const float m = o[rows_cap * D + i];
      if (m == -INFINITY) continue;
      const float w = std::exp(m - mx);
      sum += w * o[rows_cap * D + rows_cap + i];
      const __m256 vw = _mm256_set1_ps(w);
      for (int c = 0; c < D / 8; ++c) acc[c] = _mm256_fmadd_ps(vw, _mm256_loadu_ps(o + i * D + 8 * c), acc[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(acc[c], inv));
  }
}

// One group's attention as tasks for parallel_chunks, so that mixed_layers runs them in the same
// parallel region as the decode rows' attention (one barrier per layer, not three). Task
// ((b * KVH + kh) * row_blocks + rb) * spans + s is a span; the last span of its rows to finish merges
// them (a counter per rows: no second pass). `parts` holds the spans' partial rows, kept by the caller
// across layers (a fresh buffer per layer measured page faults in a profile).
class GroupRun {
 public:
  GroupRun(const GroupAttention& a, std::vector<float>& parts)
      : a_(a), split_(a, at::get_num_threads()), rows_cap_(std::max(kGroupRows, a.H / a.KVH)),
        part_(rows_cap_ * (a.D + 2)), heads_(a.Bc * a.Tq == 0 ? 0 : a.Bc * a.KVH * split_.row_blocks),
        remaining_(new std::atomic<int64_t>[heads_]) {
    TORCH_CHECK(a.D == 64 || a.D == 128, "the group attention supports head_dim 64 or 128, got ", a.D);
    parts.resize(heads_ * split_.spans * part_);  // every task writes its own part whole
    parts_ = parts.data();
    for (int64_t h = 0; h < heads_; ++h) remaining_[h].store(split_.spans, std::memory_order_relaxed);
  }

  int64_t num_tasks() const { return heads_ * split_.spans; }

  void run(int64_t task) {
    if (a_.D == 64) a_.half ? run_d<64, uint16_t>(task) : run_d<64, float>(task);
    else a_.half ? run_d<128, uint16_t>(task) : run_d<128, float>(task);
  }

 private:
  template <int D, typename T>
  void run_d(int64_t task) {
    const int64_t s = task % split_.spans, h = task / split_.spans, rb = h % split_.row_blocks;
    const int64_t kh = h / split_.row_blocks % a_.KVH, b = h / (split_.row_blocks * a_.KVH);
    const int64_t t0 = rb * split_.tokens_per_block, nt = std::min(split_.tokens_per_block, a_.Tq - t0);
    float* p = parts_ + task * part_;
    group_attention_span<D, T>(a_, b, kh, t0, nt, s * split_.span, std::min(a_.Tkv, (s + 1) * split_.span), p,
                            p + rows_cap_ * D, p + rows_cap_ * D + rows_cap_);
    // acq_rel: the last span sees every other span's part.
    if (remaining_[h].fetch_sub(1, std::memory_order_acq_rel) == 1)
      group_attention_merge<D>(a_, split_, parts_ + h * split_.spans * part_, rows_cap_, b, kh, rb);
  }

  const GroupAttention a_;
  const GroupSplit split_;
  const int64_t rows_cap_, part_, heads_;
  std::unique_ptr<std::atomic<int64_t>[]> remaining_;
  float* parts_;
};

void group_attention(const GroupAttention& a, std::vector<float>& parts) {
  GroupRun run(a, parts);
  parallel_chunks(run.num_tasks(), [&](int64_t task) { run.run(task); });
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
                         const at::Tensor& ctx_len, const at::Tensor& visible, int64_t num_heads, double eps,
                         const c10::optional<at::Tensor>& final_norm, bool bf16_x) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [B, E]");
  const int64_t B = hidden.size(0), E = hidden.size(1), L = kv.size();
  TORCH_CHECK(int64_t(weights.size()) == L * kWeightsPerLayer, "expected ", kWeightsPerLayer, " weights per layer");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 && page_table.size(0) == B &&
              page_table.is_contiguous(), "page_table: contiguous int64 [B, max_pages]");
  TORCH_CHECK(ctx_len.scalar_type() == at::kLong && ctx_len.numel() == B && ctx_len.is_contiguous());
  TORCH_CHECK(visible.scalar_type() == at::kByte && visible.dim() == 2 && visible.size(0) == B &&
              visible.is_contiguous(), "visible: contiguous uint8 [B, width]");
  TORCH_CHECK(!final_norm.has_value() || (final_norm->scalar_type() == at::kFloat && final_norm->is_contiguous() &&
                                          final_norm->numel() == E),
              "final_norm: contiguous float32 [E]");  // checked before any layer writes the cache
  at::Tensor x = hidden.contiguous().clone();
  float* xp = x.data_ptr<float>();
  auto normed = [&]() {  // the model's last norm here when asked: one torch op fewer after the weights' stream
    if (final_norm.has_value()) rms_norm(xp, final_norm->data_ptr<float>(), B, E, eps, xp);
    return x;
  };
  if (L == 0 || B == 0) return normed();
  const int64_t S = kv[0].size(2), KVH = kv[0].size(3), D = kv[0].size(4), H = num_heads;
  const bool half = kv_is_half(kv[0]);
  for (const at::Tensor& layer : kv)  // checked before any layer writes the cache
    TORCH_CHECK(layer.dim() == 5 && layer.is_contiguous() && layer.scalar_type() == kv[0].scalar_type() &&
                layer.sizes() == kv[0].sizes(), "kv caches must be contiguous float32 or float16 alike");
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
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = l * kWeightsPerLayer;
    const QWeight w_qkv = layer_qweight(weights, base + 1), w_o = layer_qweight(weights, base + 4);
    const QWeight w_gate_up = layer_qweight(weights, base + 8), w_down = layer_qweight(weights, base + 11);
    TORCH_CHECK(w_qkv.n == QKV && w_qkv.k == E && w_o.n == E && w_o.k == H * D && w_gate_up.k == E &&
                w_down.n == E && w_down.k * 2 == w_gate_up.n, "layer ", l, ": weight shapes do not fit");
    const int64_t F = w_down.k;
    gate_up.resize(B * 2 * F);
    act.resize(B * F);
    Pages p{kv[l].data_ptr(), half, S, KVH, D, page_table.data_ptr<int64_t>(), page_table.size(1), ctx,
            visible.data_ptr<uint8_t>(), visible.size(1)};

    rms_norm(xp, weights[base].data_ptr<float>(), B, E, eps, h.data());
    linear_into(h.data(), E, B, w_qkv, qkv.data(), QKV, false, bf16_x);
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv.data() + b * QKV;
      for (int64_t hd = 0; hd < H + KVH; ++hd) rope_head(row + hd * D, cs + b * D, sn + b * D, D);
      const int64_t t = ctx[b] - 1;
      store_kv(row + H * D, KVH * D, p.cache, half, p.slot_offset(b, t, 0));
      store_kv(row + (H + KVH) * D, KVH * D, p.cache, half, p.slot_offset(b, t, 1));
    }
    attention(qkv.data(), QKV, B, H, p, attn.data());
    linear_into(attn.data(), H * D, B, w_o, xp, E, true, bf16_x);
    rms_norm(xp, weights[base + 7].data_ptr<float>(), B, E, eps, h.data());
    linear_into(h.data(), E, B, w_gate_up, gate_up.data(), 2 * F, false, bf16_x);
    silu_mul(gate_up.data(), B, F, act.data());
    linear_into(act.data(), F, B, w_down, xp, E, true, bf16_x);
  }
  return normed();
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
  const bool half = kv_is_half(kv);
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv: a layer's contiguous cache [pages, 2, S, KVH, D]");
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
  Pages p{kv.data_ptr(), half, S, KVH, D, table, page_table.size(1), ctx, visible.data_ptr<uint8_t>(),
          visible.size(1)};
  attention(q.data_ptr<float>(), H * D, B, H, p, out.data_ptr<float>());
  return out;
}

// Every row of a group's kv_index is one of the layer cache's [pages * 2 * S] rows.
void check_rows(const at::Tensor& kv_index, int64_t num_rows) {
  TORCH_CHECK(kv_index.numel() == 0 || (kv_index.min().item<int64_t>() >= 0 &&
                                        kv_index.max().item<int64_t>() < num_rows), "group_kv_index out of range");
}

// mixed_layers' attention of the group alone (tests and benchmarks): q [Bc * Tq, H * D] float32 with
// RoPE applied, the group's K/V already in the pages -> [Bc * Tq, H * D], as SDPA over the gathered K/V
// with group_mask ([Bc, 1, Tq, Tkv] additive); a row whose mask hides every slot gets 0.
at::Tensor group_attention_op(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& group_kv_index,
                              const at::Tensor& group_mask, int64_t num_heads) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [Bc * Tq, H * D]");
  const bool half = kv_is_half(kv);
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv: a layer's contiguous cache [pages, 2, S, KVH, D]");
  const int64_t S = kv.size(2), KVH = kv.size(3), D = kv.size(4), H = num_heads;
  TORCH_CHECK(H > 0 && H % KVH == 0 && q.size(1) == H * D, "q's width must be num_heads * head_dim");
  TORCH_CHECK(group_mask.dim() == 4 && group_mask.scalar_type() == at::kFloat && group_mask.size(1) == 1,
              "group_mask: float32 [Bc, 1, Tq, Tkv]");
  const int64_t Bc = group_mask.size(0), Tq = group_mask.size(2), Tkv = group_mask.size(3);
  TORCH_CHECK(q.size(0) == Bc * Tq, "q's rows must be the group's Bc * Tq, got ", q.size(0), " for Bc = ", Bc,
              ", Tq = ", Tq);
  TORCH_CHECK(group_kv_index.scalar_type() == at::kLong && group_kv_index.dim() == 3 &&
              group_kv_index.size(0) == Bc && group_kv_index.size(1) == 2 && group_kv_index.size(2) == Tkv,
              "group_kv_index: int64 [Bc, 2, Tkv]");
  const at::Tensor kv_rows = group_kv_index.contiguous(), mask = group_mask.contiguous();
  check_rows(kv_rows, kv.size(0) * 2 * S);
  at::Tensor out = at::empty({Bc * Tq, H * D}, q.options());
  std::vector<float> parts;
  group_attention(GroupAttention{q.data_ptr<float>(), H * D, kv.data_ptr(), half, KVH, D, H,
                                 kv_rows.data_ptr<int64_t>(), mask.data_ptr<float>(), Bc, Tq, Tkv,
                                 out.data_ptr<float>(), H * D}, parts);
  return out;
}

// decode_layers for a mixed batch: hidden's first B rows are single-token items (one row each of
// page_table, ctx_len and visible, attending as in decode_layers), its other rows one padded group of
// Bc items of Tq new tokens each (a prefill chunk), attending as attention.py's padded path does
// (group_kv_index [Bc, 2, Tkv]: rows of a layer's cache viewed [pages * 2 * S, KVH, D]; group_mask
// [Bc, 1, Tq, Tkv] additive), through group_attention (K/V read in place, no gather). Every linear
// runs once over all rows: the decode steps keep the fused stack without reading the weights twice.
// write_slots [N]: page * S + offset of each row's new K/V; dead_rows: rows whose mask hides everything
// (attention output 0).
at::Tensor mixed_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        std::vector<at::Tensor> weights, std::vector<at::Tensor> kv, const at::Tensor& page_table,
                        const at::Tensor& ctx_len, const at::Tensor& visible, const at::Tensor& write_slots,
                        const at::Tensor& group_kv_index, const at::Tensor& group_mask, const at::Tensor& dead_rows,
                        int64_t num_heads, double eps, bool bf16_x) {
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
  const bool half = kv_is_half(kv[0]);
  for (const at::Tensor& layer : kv)
    TORCH_CHECK(layer.dim() == 5 && layer.is_contiguous() && layer.scalar_type() == kv[0].scalar_type() &&
                layer.sizes() == kv[0].sizes(), "kv caches must be contiguous float32 or float16 alike [pages, 2, S, KVH, D]");
  const int64_t P = kv[0].size(0), S = kv[0].size(2), KVH = kv[0].size(3), D = kv[0].size(4), H = num_heads;
  TORCH_CHECK(H > 0 && H % KVH == 0 && D <= 512, "bad head layout");
  TORCH_CHECK(D == 64 || D == 128, "mixed_layers supports head_dim 64 or 128, got ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == N && cos.size(1) == D && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin: contiguous [N, head_dim]");
  const int64_t* ctx = ctx_len.data_ptr<int64_t>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t width = std::min(visible.size(1), page_table.size(1) * S);
  check_pages(ctx, table, B, page_table.size(1), width, S, P);
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(slots[r] >= 0 && slots[r] < P * S, "write slot out of range");
  const at::Tensor kv_rows = group_kv_index.contiguous();
  check_rows(kv_rows, P * 2 * S);
  const int64_t* kv_index = kv_rows.data_ptr<int64_t>();
  const at::Tensor mask_rows = group_mask.contiguous();
  const float* mask = mask_rows.data_ptr<float>();
  const int64_t* dead = dead_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < dead_rows.numel(); ++i) TORCH_CHECK(dead[i] >= 0 && dead[i] < N, "dead row out of range");

  at::Tensor x = hidden.contiguous().clone();
  const int64_t QKV = (H + 2 * KVH) * D;
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  std::vector<float> h(N * E), qkv(N * QKV), attn(N * H * D), gate_up, act, group_parts;
  float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = l * kWeightsPerLayer;
    const QWeight w_qkv = layer_qweight(weights, base + 1), w_o = layer_qweight(weights, base + 4);
    const QWeight w_gate_up = layer_qweight(weights, base + 8), w_down = layer_qweight(weights, base + 11);
    TORCH_CHECK(w_qkv.n == QKV && w_qkv.k == E && w_o.n == E && w_o.k == H * D && w_gate_up.k == E &&
                w_down.n == E && w_down.k * 2 == w_gate_up.n, "layer ", l, ": weight shapes do not fit");
    const int64_t F = w_down.k;
    gate_up.resize(N * 2 * F);
    act.resize(N * F);
    Pages p{kv[l].data_ptr(), half, S, KVH, D, table, page_table.size(1), ctx, visible.data_ptr<uint8_t>(),
            visible.size(1)};

    rms_norm(xp, weights[base].data_ptr<float>(), N, E, eps, h.data());
    linear_into(h.data(), E, N, w_qkv, qkv.data(), QKV, false, bf16_x);
    for (int64_t r = 0; r < N; ++r) {
      float* row = qkv.data() + r * QKV;
      for (int64_t hd = 0; hd < H + KVH; ++hd) rope_head(row + hd * D, cs + r * D, sn + r * D, D);
      const int64_t k_slot = ((slots[r] / S * 2) * S + slots[r] % S) * KVH * D;
      store_kv(row + H * D, KVH * D, p.cache, half, k_slot);
      store_kv(row + (H + KVH) * D, KVH * D, p.cache, half, k_slot + S * KVH * D);
    }
    // The group's spans first (the long tasks), then the decode rows' (item, KV head) tasks.
    GroupRun group(GroupAttention{qkv.data() + B * QKV, QKV, p.cache, half, KVH, D, H, kv_index, mask, Bc, Tq, Tkv,
                                  attn.data() + B * H * D, H * D}, group_parts);
    const int64_t group_tasks = group.num_tasks();
    parallel_chunks(group_tasks + B * KVH, [&](int64_t task) {
      if (task < group_tasks) group.run(task);
      else attention_one(qkv.data(), QKV, H, p, task - group_tasks, attn.data());
    });
    for (int64_t i = 0; i < dead_rows.numel(); ++i) std::fill_n(attn.data() + dead[i] * H * D, H * D, 0.0f);
    linear_into(attn.data(), H * D, N, w_o, xp, E, true, bf16_x);
    rms_norm(xp, weights[base + 7].data_ptr<float>(), N, E, eps, h.data());
    linear_into(h.data(), E, N, w_gate_up, gate_up.data(), 2 * F, false, bf16_x);
    silu_mul(gate_up.data(), N, F, act.data());
    linear_into(act.data(), F, N, w_down, xp, E, true, bf16_x);
  }
  return x;
}

}  // namespace

// ---- greedy sampling --------------------------------------------------------------------------------
//
// Each row of logits [M, V]: the first index of its maximum, as torch.argmax gives it, and the log-softmax
// there, -log(sum_v exp(l_v - max)). One call where the sampler's torch path makes ~7 (log_softmax, two
// row selections, argmax, gather, ...): after a decode step has streamed its weights through the caches,
// the first call of each distinct torch op costs 45-80 us of cold code. A NaN anywhere in a row makes it
// the argmax (as torch's) and the logprob NaN.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be contiguous float32 [M, V], V >= 1");
  const int64_t M = logits.size(0), V = logits.size(1), V8 = V / 8 * 8;
  at::Tensor ids = at::empty({M}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({M}, logits.options());
  const float* base = logits.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = base + r * V;
      __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
      for (int64_t v = 0; v < V8; v += 8) {
        const __m256 x = _mm256_loadu_ps(row + v);
        vmax = _mm256_max_ps(vmax, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      }
      float best = hmax(vmax);
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (int64_t v = V8; v < V; ++v) {
        has_nan |= std::isnan(row[v]);
        best = std::max(best, row[v]);
      }
      if (has_nan) {
        int64_t v = 0;
        while (!std::isnan(row[v])) ++v;
        id[r] = v;
        lp[r] = NAN;
        continue;
      }
      int64_t arg = 0;
      while (row[arg] != best) ++arg;  // the first maximum (best is one of the row's values)
      id[r] = arg;
      if (std::isinf(best)) {  // every value -inf, or some +inf: torch's log_softmax gives NaN too
        lp[r] = NAN;
        continue;
      }
      const __m256 vb = _mm256_set1_ps(best);
      __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();  // in double: 49,152 terms
      for (int64_t v = 0; v < V8; v += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + v), vb));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
      }
      alignas(32) double parts[4];
      _mm256_store_pd(parts, _mm256_add_pd(lo, hi));
      double sum = (parts[0] + parts[1]) + (parts[2] + parts[3]);
      for (int64_t v = V8; v < V; ++v) sum += std::exp(double(row[v]) - double(best));
      lp[r] = float(-std::log(sum));
    }
  });
  return {ids, logprobs};
}

TORCH_LIBRARY(l4m_cpu, lib) {
  lib.def("linear(Tensor x, Tensor qs, Tensor d, Tensor? m, bool bf16_x=False) -> Tensor", &linear);
  lib.def("isa() -> str", &isa);
  lib.def("set_isa(str isa) -> str", &set_isa);
  lib.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] kv, Tensor page_table, "
          "Tensor ctx_len, Tensor visible, int num_heads, float eps, Tensor? final_norm=None, bool bf16_x=False) -> Tensor",
          &decode_layers);
  lib.def("decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor ctx_len, Tensor visible, "
          "int num_heads) -> Tensor", &decode_attention);
  lib.def("mixed_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor[] kv, Tensor page_table, "
          "Tensor ctx_len, Tensor visible, Tensor write_slots, Tensor group_kv_index, Tensor group_mask, "
          "Tensor dead_rows, int num_heads, float eps, bool bf16_x=False) -> Tensor", &mixed_layers);
  lib.def("group_attention(Tensor q, Tensor kv, Tensor group_kv_index, Tensor group_mask, int num_heads) -> Tensor",
          &group_attention_op);
  lib.def("greedy(Tensor logits) -> (Tensor, Tensor)", &greedy);
}
