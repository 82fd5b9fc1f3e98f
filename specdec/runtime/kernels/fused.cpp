// The per-layer glue of a decode/verify step, fused: what sits between the matmuls.
//
// A SmolLM2 forward(1) spent ~40% of its time outside the matmuls, in ~35 small torch ops per
// layer (RMSNorm as 4 ops, RoPE as chunk/mul/cat on q and k, the KV index_put, the mask, the
// transposes around attention).  Each op costs a few microseconds of dispatch for microseconds of
// work.  Three calls replace them:
//
//   add_rms_norm(x, d, w, eps)   x += d (in place, d optional); returns rms_norm(x) * w
//   attend(qkv, positions, ...)  RoPE on q and k, k/v written into the cache at their positions,
//                                grouped-query attention of the new rows over the cache
//   silu_mul(gu)                 silu(gate) * up, gu = [gate | up] from the fused matmul
//
// Every row (a token; for attention a token and a head) is computed on its own, in an order that
// depends only on that row's data and the slots it may see: a row's bits do not depend on the
// batch size, the number of new tokens (T), the cache length or the thread count, which greedy
// speculative decoding == plain decoding needs.  The elementwise arithmetic is the torch
// reference's, operation for operation (built with -ffp-contract=off); reductions (the
// RMSNorm sum of squares, dot products, softmax sums) and exp use their own fixed order and
// polynomial, so results differ from torch by fp32 rounding only.
//
// Attention semantics (as specdec.model documents): query (b, t) at position p sees the cache
// slots <= p (causal), or, with mask [B, T, T], the slots before the block's first position
// plus the slots of the new tokens the mask allows.  Slots are visited in increasing order.
// A draft tree (slots [B, T], with a mask) separates a new token's KV slot from its RoPE
// position: siblings share a position but not a slot; the block's history is then the slots
// before its first slot.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// ============================ Shared: sums, exp, checks =====================
inline float hsum(__m256 v) {  // fixed order: (lo + hi) then pairwise
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of four vectors at once, the same additions in the same order as hsum on each (so the
// same bits): the lo + hi halves of two vectors in one add, then the pairwise steps four lanes
// at a time; returns hsum(a0), hsum(a1), hsum(a2), hsum(a3) in lanes 0-3.  ~14 operations for
// four sums against ~24 (hsum's extracts and shuffles were a third of a score's operations).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 x = _mm256_add_ps(_mm256_permute2f128_ps(a0, a2, 0x20), _mm256_permute2f128_ps(a0, a2, 0x31));
  const __m256 y = _mm256_add_ps(_mm256_permute2f128_ps(a1, a3, 0x20), _mm256_permute2f128_ps(a1, a3, 0x31));
  // x = [b0 | b2], y = [b1 | b3], b = lo + hi; then s + movehl(s) for all four: lanes 0-1 of c_r
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  // z = [c0 c0 c1 c1 | c2 c2 c3 c3]; then c_0 + c_1 (add_ss with movehdup) in lanes 0, 2, 4, 6
  const __m256 r = _mm256_add_ps(z, _mm256_movehdup_ps(z));
  return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
}

// exp(x) for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial),
// ~1 ulp; x < -87.3 gives 0, as softmax and silu want.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(), name,
              " must be a contiguous fp32 CPU tensor");
}

// ============================ Attention: tiles of queries over the cache ====
// o[0:D] = sum_i e[i] v[slot i] for D a multiple of 8 up to 8 * NV, in registers.
template <int NV>
inline void weighted_sum(const float* e, const int32_t* js, int64_t n, const float* vb, int64_t vs,
                         int64_t D, float scale, float* out) {
  __m256 acc[NV];
  for (int r = 0; r < NV; ++r) acc[r] = _mm256_setzero_ps();
  const int nv = static_cast<int>(D / 8);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 ev = _mm256_set1_ps(e[i]);
    const float* vr = vb + js[i] * vs;
#pragma GCC unroll 16
    for (int r = 0; r < NV; ++r)
      if (r < nv) acc[r] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr + 8 * r), acc[r]);
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int r = 0; r < NV; ++r)
    if (r < nv) _mm256_storeu_ps(out + 8 * r, _mm256_mul_ps(acc[r], sv));
}

// rotate-half RoPE of one head, as x1 * cos - x2 * sin | x2 * cos + x1 * sin (each product rounded)
inline void rope_rot(const float* x, const float* c, const float* s, float* y, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(y + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(y + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    y[i] = a * c[i] - b * s[i];
    y[half + i] = b * c[i] + a * s[i];
  }
}

// max(-inf, x[0], ..., x[n-1]) skipping NaNs, as the loop m = std::max(m, x[j]) gives: 8 lanes
// at a time (maxps returns its second operand, the running max, where x is NaN), then the
// lanes and the tail.  A max is exact in any order; only a tie of -0 and +0 may come out with
// the other sign, and every use subtracts it (x - 0 is x either way, exp(+-0) = 1).
inline float max_of(const float* x, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(x + j), mv);
  alignas(32) float lane[8];
  _mm256_store_ps(lane, mv);
  float m = -INFINITY;
  for (int l = 0; l < 8; ++l) m = std::max(m, lane[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// The shortest and longest history of a tile's queries.
inline void tile_span(int nt, const int64_t* n, int64_t& nmin, int64_t& nmax) {
  nmin = nmax = n[0];
  for (int i = 1; i < nt; ++i) nmin = std::min(nmin, n[i]), nmax = std::max(nmax, n[i]);
}

// The key and value rows 8 slots past the pair at j, into L1 (the first tile of a head meets
// them in DRAM: the cache of all layers is larger than L3's share).
inline void prefetch_rows(const float* kb, int64_t ks, const float* vb, int64_t vs, int64_t j, int64_t nmax, int64_t D) {
  for (int64_t r = j + 8; r < std::min(j + 10, nmax); ++r)
    for (int64_t d = 0; d < D; d += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(kb + r * ks + d), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vb + r * vs + d), _MM_HINT_T0);
    }
}

// A query tile's softmax, per query over its own n[i] scores sc[i * n8 ..] -> e[i * n8 ..] (the
// weights before normalisation) and inv[i] = 1 / their sum; with a draft tree's vis, each query's
// visible scores are first gathered into its own order (vis[i][u] >= u: the reads stay ahead).
inline void tile_softmax(int nt, const int64_t* n, float* sc, float* e, int64_t n8, float* inv,
                         const int32_t* const* vis, int64_t shared) {
  if (vis)
    for (int i = 0; i < nt; ++i)
      for (int64_t u = shared; u < n[i]; ++u) sc[i * n8 + u] = sc[i * n8 + vis[i][u]];
  for (int i = 0; i < nt; ++i) {
    float* si = sc + i * n8;
    float* ei = e + i * n8;
    const int64_t ni = n[i], ni8 = (ni + 7) / 8 * 8;
    const float m = max_of(si, ni);
    for (int64_t j = ni; j < ni8; ++j) si[j] = -INFINITY;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 lv = _mm256_setzero_ps();
    for (int64_t j = 0; j < ni8; j += 8) {
      const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + j), mv));
      _mm256_storeu_ps(ei + j, ev);
      lv = _mm256_add_ps(lv, ev);
    }
    inv[i] = 1.0f / hsum(lv);
  }
}

// The output pass's shared slots j0 .. j1-1 for NS <= 6 queries (rows e[i * n8 ..]): 2 x NS
// accumulators (16 lanes from c) in registers, loaded from and stored back to a0, a1.
constexpr int64_t kSlotBlock = 64;  // 64 slots x 16 lanes of values: 4 KiB

template <int NS>
inline void shared_slots(const float* e, int64_t n8, const float* vb, int64_t vs, int64_t c, bool w2, int64_t j0,
                         int64_t j1, __m256* a0, __m256* a1) {
  __m256 acc0[NS], acc1[NS];
#pragma GCC unroll 8
  for (int i = 0; i < NS; ++i) acc0[i] = a0[i], acc1[i] = a1[i];
  for (int64_t j = j0; j < j1; ++j) {
    const float* vr = vb + j * vs + c;
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = w2 ? _mm256_loadu_ps(vr + 8) : v0;
#pragma GCC unroll 8
    for (int i = 0; i < NS; ++i) {
      const __m256 ev = _mm256_set1_ps(e[i * n8 + j]);
      acc0[i] = _mm256_fmadd_ps(ev, v0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(ev, v1, acc1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NS; ++i) a0[i] = acc0[i], a1[i] = acc1[i];
}

// Causal attention of a tile of NT queries that share one KV head (a draft tree's mask: vis,
// below): query i sees slots 0 .. n[i]-1.  Per query the arithmetic is attend's per-query loop, operation for operation: each
// score is one FMA chain over d (8 lanes) then hsum, times scale; the softmax over the query's own
// n; each output lane one FMA chain over the slots in order, times 1 / sum.  So the bits are the
// same whatever the tile holds; only the loop nest differs: each key and value row is loaded once
// for the tile, not once per query.  (At T = 5 a Qwen 1.5B KV head has 30 queries, and their
// re-reads of its keys and values, from L2, were most of the attention time.)  NT <= 12: the
// score pass runs 2 keys x NT queries for NT <= 6, 4 keys x 2 queries (8 independent FMA chains,
// the 4 sums in one hsum4) above, the output pass 6 queries x 2 (12 chains in flight hide the FMA latency; 8 barely do) in 15 of the
// 16 ymm registers, a tile of more than 6 in two parts over blocks of slots; every loop over
// the tile is unrolled, or GCC keeps the accumulators in memory (a store per slot).  Hot in
// cache, one thread, Qwen shapes (D = 128, 200 slots), cycles per query and slot: 48 (NT = 4,
// accumulators stored every slot), 34 (NT = 4 unrolled), 27.6 (NT = 6 unrolled).  A long prompt
// reads its keys and values from L3 (SmolLM2's 3 KV heads at 2,048 slots: 1 MiB each), so a
// tile of 12 halves those reads against 6.
// q: the tile's rotated queries [NT][D]; sc, e: [NT][n8] scratch (n8 = max n, or top with vis,
// rounded up to 8).
// A draft tree (vis): query i sees the n[i] slots vis[i][0..n[i]) (increasing): the shared
// history 0 .. shared-1 (the same for every query of the tile), then its own visible new slots,
// all below top.  Every slot below top is scored for every query, and each query's scores are
// then gathered into its visible order: the per-query loop's list, so the same bits.
template <int NT>
void attend_tile(const float* q, const int64_t* n, int64_t D, const float* kb, int64_t ks, const float* vb,
                 int64_t vs, float scale, float* sc, float* e, int64_t n8, float* const* out,
                 const int32_t* const* vis = nullptr, int64_t shared = 0, int64_t top = 0) {
  int64_t nmin, nmax;
  tile_span(NT, n, nmin, nmax);
  if (vis) nmin = shared, nmax = top;  // (scores for slots 0 .. top-1; shared read by every query)
  // scores.  Up to 6 queries (a decode step's KV head): two keys per pass over d for all of
  // them (2 x NT independent FMA chains), each sum by hsum.  More (a prompt's or a verify's
  // tile): four keys per pass for two queries at a time (8 chains; the four keys' rows are read
  // from L1 again by the tile's other pairs), the four sums of a query in one hsum4, the same
  // bits.  (Four keys for tiles of up to 6 too made a decode step's attention 10% slower with
  // its keys in DRAM: Qwen 1.5B, T = 1, 200 slots.)  A key past a query's own n (or a row past
  // nmax, read as the last one) is scored but never read, and the writes stay below n8 (a
  // multiple of 8 >= nmax).  The rows 8 slots on are prefetched, values too (the first tile of
  // a head meets them in DRAM: the cache of all layers is larger than L3's share)
  if constexpr (NT <= 6) {
    for (int64_t j = 0; j < nmax; j += 2) {
      const bool two = j + 1 < nmax;
      const float* k0 = kb + j * ks;
      const float* k1 = kb + (two ? j + 1 : j) * ks;
      prefetch_rows(kb, ks, vb, vs, j, nmax, D);
      __m256 a0[NT], a1[NT];
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv0 = _mm256_loadu_ps(k0 + d), kv1 = _mm256_loadu_ps(k1 + d);
#pragma GCC unroll 8
        for (int i = 0; i < NT; ++i) {
          const __m256 qv = _mm256_loadu_ps(q + i * D + d);
          a0[i] = _mm256_fmadd_ps(qv, kv0, a0[i]);
          a1[i] = _mm256_fmadd_ps(qv, kv1, a1[i]);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < NT; ++i) {
        sc[i * n8 + j] = hsum(a0[i]) * scale;
        if (two) sc[i * n8 + j + 1] = hsum(a1[i]) * scale;
      }
    }
  } else {
    const __m128 sv = _mm_set1_ps(scale);
    for (int64_t j = 0; j < nmax; j += 4) {
      const float* kr[4];
      for (int r = 0; r < 4; ++r) kr[r] = kb + std::min(j + r, nmax - 1) * ks;
      prefetch_rows(kb, ks, vb, vs, j, nmax, D);
      prefetch_rows(kb, ks, vb, vs, j + 2, nmax, D);
#pragma GCC unroll 6
      for (int i0 = 0; i0 < NT; i0 += 2) {
        const bool pair = i0 + 1 < NT;
        const float* q0 = q + i0 * D;
        const float* q1 = q + (pair ? i0 + 1 : i0) * D;
        __m256 a[2][4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) a[0][r] = a[1][r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv0 = _mm256_loadu_ps(q0 + d), qv1 = _mm256_loadu_ps(q1 + d);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            const __m256 kv = _mm256_loadu_ps(kr[r] + d);
            a[0][r] = _mm256_fmadd_ps(qv0, kv, a[0][r]);
            a[1][r] = _mm256_fmadd_ps(qv1, kv, a[1][r]);
          }
        }
        _mm_storeu_ps(sc + i0 * n8 + j, _mm_mul_ps(hsum4(a[0][0], a[0][1], a[0][2], a[0][3]), sv));
        if (pair) _mm_storeu_ps(sc + (i0 + 1) * n8 + j, _mm_mul_ps(hsum4(a[1][0], a[1][1], a[1][2], a[1][3]), sv));
      }
    }
  }
  float inv[NT];
  tile_softmax(NT, n, sc, e, n8, inv, vis, shared);
  // outputs, 16 lanes of every query per pass over the slots: the shared slots for all, then
  // each query's own tail.  A tile of more than 6 queries runs its two parts (6 and NT - 6) in
  // turn over blocks of kSlotBlock slots, so each block of values comes from L1 for the second
  // part; every accumulator still adds its slots in increasing order, from 0: the same bits.
  for (int64_t c = 0; c < D; c += 16) {
    const bool w2 = c + 8 < D;
    __m256 acc0[NT], acc1[NT];
#pragma GCC unroll 12
    for (int i = 0; i < NT; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    if constexpr (NT <= 6) {
      shared_slots<NT>(e, n8, vb, vs, c, w2, 0, nmin, acc0, acc1);
    } else {
      for (int64_t j0 = 0; j0 < nmin; j0 += kSlotBlock) {
        const int64_t j1 = std::min(j0 + kSlotBlock, nmin);
        shared_slots<6>(e, n8, vb, vs, c, w2, j0, j1, acc0, acc1);
        shared_slots<NT - 6>(e + 6 * n8, n8, vb, vs, c, w2, j0, j1, acc0 + 6, acc1 + 6);
      }
    }
#pragma GCC unroll 12
    for (int i = 0; i < NT; ++i) {
      for (int64_t j = nmin; j < n[i]; ++j) {
        const float* vr = vb + (vis ? vis[i][j] : j) * vs + c;
        const __m256 ev = _mm256_set1_ps(e[i * n8 + j]);
        acc0[i] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr), acc0[i]);
        if (w2) acc1[i] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr + 8), acc1[i]);
      }
      const __m256 sv = _mm256_set1_ps(inv[i]);
      _mm256_storeu_ps(out[i] + c, _mm256_mul_ps(acc0[i], sv));
      if (w2) _mm256_storeu_ps(out[i] + c + 8, _mm256_mul_ps(acc1[i], sv));
    }
  }
}

// The same tile on AVX-512 (D a multiple of 16), up to kWideTile queries: the same arithmetic per
// lane, so the same bits.  The score pass runs two keys in one zmm, key j in lanes 0-7 and key
// j + 1 in lanes 8-15, against the query's 8 lanes broadcast to both halves: each half is the
// 256-bit routine's chain for its key, and its hsum the same 8-lane sum.  The output pass keeps
// 16 output lanes of a query in one zmm (the 256-bit routine's acc0, acc1 side by side).  With
// 32 registers it holds 12 queries in one pass (two positions of a Qwen 1.5B KV head's 6 query
// heads; the 256-bit tile of 12 needs two parts), so each key and value row is read once per 12
// queries: in a long prompt those rows come from L3 (a KV head's 2,048 slots are 2 MiB), and
// their reads, not the FMAs, were most of the attention time.
constexpr int kWideTile = 12;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma")
template <int NT>
void attend_tile512(const float* q, const int64_t* n, int64_t D, const float* kb, int64_t ks, const float* vb,
                    int64_t vs, float scale, float* sc, float* e, int64_t n8, float* const* out,
                    const int32_t* const* vis, int64_t shared, int64_t top) {
  int64_t nmin, nmax;
  tile_span(NT, n, nmin, nmax);
  if (vis) nmin = shared, nmax = top;
  for (int64_t j = 0; j < nmax; j += 2) {
    const bool two = j + 1 < nmax;
    const float* k0 = kb + j * ks;
    const float* k1 = kb + (two ? j + 1 : j) * ks;
    prefetch_rows(kb, ks, vb, vs, j, nmax, D);
    __m512 a[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m512 kv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k0 + d)), _mm256_loadu_ps(k1 + d), 1);
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i)
        a[i] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(q + i * D + d)), kv, a[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) {
      sc[i * n8 + j] = hsum(_mm512_castps512_ps256(a[i])) * scale;
      if (two) sc[i * n8 + j + 1] = hsum(_mm512_extractf32x8_ps(a[i], 1)) * scale;
    }
  }
  float inv[NT];
  tile_softmax(NT, n, sc, e, n8, inv, vis, shared);
  for (int64_t c = 0; c < D; c += 16) {
    __m512 acc[NT];
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nmin; ++j) {
      const __m512 v = _mm512_loadu_ps(vb + j * vs + c);
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(e[i * n8 + j]), v, acc[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NT; ++i) {
      for (int64_t j = nmin; j < n[i]; ++j)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(e[i * n8 + j]), _mm512_loadu_ps(vb + (vis ? vis[i][j] : j) * vs + c), acc[i]);
      _mm512_storeu_ps(out[i] + c, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv[i])));
    }
  }
}
#pragma GCC pop_options

using TileFn = void (*)(const float*, const int64_t*, int64_t, const float*, int64_t, const float*, int64_t, float,
                        float*, float*, int64_t, float* const*, const int32_t* const*, int64_t, int64_t);

template <int... I>
constexpr std::array<TileFn, sizeof...(I)> wide_tiles(std::integer_sequence<int, I...>) {
  return {&attend_tile512<I + 1>...};
}
constexpr auto kWideTiles = wide_tiles(std::make_integer_sequence<int, kWideTile>{});

// The 256-bit tile: up to kTile queries (two parts of up to 6 in its output pass).
constexpr int kTile = 12;

template <int... I>
constexpr std::array<TileFn, sizeof...(I)> tiles256(std::integer_sequence<int, I...>) {
  return {&attend_tile<I + 1>...};
}
constexpr auto kTiles = tiles256(std::make_integer_sequence<int, kTile>{});

// The AVX-512 tile where the CPU has AVX-512 F/DQ/VL, unless SPECDEC_KERNEL=avx2 (A/B runs):
// read per call, like the matmuls' setting.
bool wide_attention() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  const char* k = std::getenv("SPECDEC_KERNEL");
  return cpu && !(k != nullptr && std::strcmp(k, "avx2") == 0);
}

}  // namespace

// ============================ add_rms_norm ==================================
// x [R, C] (updated in place: x += d), d [R, C] or None, w [C]; returns rms_norm(x) * w [R, C].
torch::Tensor add_rms_norm(torch::Tensor x, const c10::optional<torch::Tensor>& d_opt,
                           const torch::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t C = w.numel();
  TORCH_CHECK(x.numel() % std::max<int64_t>(C, 1) == 0 && x.size(-1) == C, "x and w disagree");
  const int64_t R = C ? x.numel() / C : 0;
  const bool has_d = d_opt.has_value() && d_opt->defined();
  if (has_d) {
    check_f32(*d_opt, "d");
    TORCH_CHECK(d_opt->numel() == x.numel(), "d must have x's shape");
  }
  auto out = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = has_d ? d_opt->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps), invc = 1.0f / static_cast<float>(C);
#pragma omp parallel for schedule(static) if (R * C >= (1 << 16))
  for (int64_t r = 0; r < R; ++r) {
    float* xr = xp + r * C;
    __m256 ss = _mm256_setzero_ps();
    int64_t c = 0;
    if (has_d) {
      const float* dr = dp + r * C;
      for (; c + 8 <= C; c += 8) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(dr + c));
        _mm256_storeu_ps(xr + c, v);
        ss = _mm256_fmadd_ps(v, v, ss);
      }
      for (int64_t t = c; t < C; ++t) xr[t] += dr[t];
    } else {
      for (; c + 8 <= C; c += 8) {
        const __m256 v = _mm256_loadu_ps(xr + c);
        ss = _mm256_fmadd_ps(v, v, ss);
      }
    }
    float s = hsum(ss);
    for (; c < C; ++c) s += xr[c] * xr[c];
    const float rs = 1.0f / std::sqrt(s * invc + epsf);
    float* orow = op + r * C;
    const __m256 rv = _mm256_set1_ps(rs);
    c = 0;
    for (; c + 8 <= C; c += 8)
      _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), rv), _mm256_loadu_ps(wp + c)));
    for (; c < C; ++c) orow[c] = (xr[c] * rs) * wp[c];
  }
  return out;
}

// ============================ silu_mul ======================================
// gu [..., 2I] = [gate | up] -> silu(gate) * up [..., I], silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_f32(gu, "gu");
  const int64_t I2 = gu.size(-1), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0, "gu's last dim must be even");
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gu.options());
  const int64_t R = I ? gu.numel() / I2 : 0;
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
// Two threads from 16384 outputs (T >= 2 rows of Qwen 1.5B's 8960): 28 calls at T = 5 took 0.52 ms
// against 0.84 on one; at T = 1 one thread is as fast (0.19 ms).
#pragma omp parallel for schedule(static) if (R * I >= (1 << 14))
  for (int64_t r = 0; r < R; ++r) {
    const float* g = gp + r * I2;
    const float* u = g + I;
    float* o = op + r * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < I; ++i) o[i] = (g[i] / (1.0f + exp1(-g[i]))) * u[i];
  }
  return out;
}

// ============================ attend: RoPE, KV write, attention =============
// qkv [B, T, (H + 2 Hkv) D] (the fused projection, bias added); positions [B, T] int64;
// cos, sin [P, D/2]; kc, vc [Bc, Hkv, S, D] one layer's cache (last dim contiguous);
// rows [B] int64 cache row of each batch row, or None for 0..B-1; mask [B, T, T] bool or None;
// slots [B, T] int64 (with a mask only) the cache slot of each new token, or None: its position.
// Writes rope(k), v at (rows[b], :, slots[b, t]) and returns attention output [B, T, H D].
torch::Tensor attend(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, torch::Tensor kc, torch::Tensor vc,
                     const c10::optional<torch::Tensor>& rows_opt, const c10::optional<torch::Tensor>& mask_opt,
                     int64_t H, int64_t Hkv, int64_t nthreads,
                     const c10::optional<torch::Tensor>& slots_opt) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(qkv.dim() == 3 && H > 0 && Hkv > 0 && H % Hkv == 0, "qkv must be [B, T, (H + 2 Hkv) D]");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / (H + 2 * Hkv), half = D / 2;
  TORCH_CHECK(D * (H + 2 * Hkv) == qkv.size(2) && D % 2 == 0, "qkv's last dim is not (H + 2 Hkv) D, D even");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T,
              "positions must be contiguous int64 [B, T]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(), "cos/sin must be [P, D/2]");
  TORCH_CHECK(kc.scalar_type() == torch::kFloat32 && vc.scalar_type() == torch::kFloat32 && kc.dim() == 4 &&
                  kc.sizes() == vc.sizes() && kc.size(1) == Hkv && kc.size(3) == D && kc.stride(3) == 1 &&
                  vc.stride(3) == 1,
              "kc, vc must be fp32 [Bc, Hkv, S, D] with a contiguous last dim");
  const int64_t Bc = kc.size(0), S = kc.size(2), P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  std::vector<int64_t> row(B);
  const bool has_rows = rows_opt.has_value() && rows_opt->defined();
  if (has_rows) {
    TORCH_CHECK(rows_opt->scalar_type() == torch::kInt64 && rows_opt->numel() == B, "rows must be int64 [B]");
    const torch::Tensor rc = rows_opt->contiguous();
    std::copy(rc.data_ptr<int64_t>(), rc.data_ptr<int64_t>() + B, row.begin());
  } else {
    for (int64_t b = 0; b < B; ++b) row[b] = b;
  }
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(row[b] >= 0 && row[b] < Bc, "cache row out of range");
  torch::Tensor mask;
  const bool has_mask = mask_opt.has_value() && mask_opt->defined();
  const bool has_slots = slots_opt.has_value() && slots_opt->defined();
  TORCH_CHECK(!has_slots || has_mask, "slots need a mask (a draft tree's)");
  torch::Tensor slots_t;
  if (has_slots) {
    slots_t = slots_opt->to(torch::kInt64).contiguous();
    TORCH_CHECK(slots_t.dim() == 2 && slots_t.size(0) == B && slots_t.size(1) == T, "slots must be [B, T]");
  }
  const int64_t* sl = has_slots ? slots_t.data_ptr<int64_t>() : pos;
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < P && sl[i] >= 0 && sl[i] < S, "position ", pos[i], " (slot ", sl[i],
                ") outside the cache (", S, " slots) or the RoPE table (", P, ")");
  if (has_mask) mask = mask_opt->to(torch::kBool).expand({B, T, T}).contiguous();
  const bool* mp = has_mask ? mask.data_ptr<bool>() : nullptr;

  const int64_t N = qkv.size(2), group = H / Hkv;
  const float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  auto out = torch::empty({B, T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
  const int64_t work = B * T * H;
  const int64_t run = std::max<int64_t>(1, group / 2);
  // The grouped causal path (attend_tile) computes what the per-query loop below does with
  // weighted_sum (D a multiple of 8 up to 128), to the bit; masks and other D take the loop.
  // Qwen 1.5B shapes, 28 calls at 200 slots, caches flushed between forwards, 2 threads, in one
  // process: T = 1 1.28 ms grouped against 2.22 per query; T = 5 3.32 against 4.16 (the previous
  // grouped path: tiles of 4, dynamic schedule, no prefetch).
  // A draft tree's mask takes it too (attend_tile's vis), unless some query sees no slot at all.
  bool seen_by_all = true;
  for (int64_t b = 0; b < B && has_mask; ++b)
    for (int64_t t = 0; t < T && sl[b * T] == 0; ++t)
      seen_by_all = seen_by_all && std::any_of(mp + (b * T + t) * T, mp + (b * T + t + 1) * T, [](bool v) { return v; });
  const bool grouped = seen_by_all && D % 8 == 0 && D <= 128;
  // grouped: the T x group queries of a KV head, t-major, in tiles of NQ; one tile per work item
  // (NQ = kTile on the 256-bit tile, kWideTile on the AVX-512 one: 12 either way)
  const bool wide = grouped && D % 16 == 0 && wide_attention();
  constexpr int NQMAX = kWideTile > kTile ? kWideTile : kTile;
  const int NQ = wide ? kWideTile : kTile;
  const int64_t nqh = T * group, tiles = (nqh + NQ - 1) / NQ, items = B * Hkv * tiles;
  // The grouped path's items cut into one contiguous run per thread of about equal work: an
  // item costs about its queries times the slots its longest query sees (cost[it + 1] - cost[it],
  // + 64 for its fixed part).  A causal prompt's later tiles see more slots, so equal counts of
  // items (static) left a thread idle: SmolLM2's 3 KV heads over 2 threads split 1.25 : 1.75.
  std::vector<int64_t> cost(grouped ? items + 1 : 0, 0);
  for (int64_t it = 0; grouped && it < items; ++it) {
    const int64_t b = it / (Hkv * tiles), q0 = it % tiles * NQ, tile = std::min<int64_t>(NQ, nqh - q0);
    int64_t nmax = 0;
    for (int64_t i = 0; i < tile; ++i) nmax = std::max(nmax, pos[b * T + (q0 + i) / group] + 1);
    cost[it + 1] = cost[it] + tile * nmax + 64;
  }
#pragma omp parallel num_threads(nt) if (nt > 1 && work > 1)
  {
    // 1. the new keys (rotated) and values into the cache
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < B * T * Hkv; ++idx) {
      const int64_t bt = idx / Hkv, h = idx % Hkv, b = bt / T, p = pos[bt], s = sl[bt];
      const float* src = qp + bt * N + (H + h) * D;
      rope_rot(src, cp + p * half, sp + p * half, kp + row[b] * ks0 + h * ks1 + s * ks2, half);
      std::copy(src + Hkv * D, src + Hkv * D + D, vp + row[b] * vs0 + h * vs1 + s * vs2);
    }
    // (implicit barrier: every new key is in place before any query reads the cache)
    std::vector<float> sc, e;
    if (grouped) {
      // Causal (a tree's mask as vis): a work item is (batch row, KV head, tile of up to NQ of its queries)
      // (attend_tile).  In item order, one run of about equal work per thread (cost, above): a
      // thread takes whole heads where it can, so a head's keys and values come from DRAM once
      // and from its own L2 for the later tiles (dynamic handed both threads tiles of the same
      // head: 3.65 ms against 3.00 at T = 5).  No query's arithmetic depends on its tile or thread.
      std::vector<float> qt(NQMAX * D);
      std::vector<int32_t> vl[NQMAX];  // with a mask: each query's visible slots
      const int32_t* vis[NQMAX];
      const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
      const auto cut = [&](int t) {  // the first item of thread t's run
        return std::lower_bound(cost.begin(), cost.end() - 1, cost.back() * t / nth) - cost.begin();
      };
      const int64_t it0 = tid == 0 ? 0 : cut(tid), it1 = tid + 1 == nth ? items : cut(tid + 1);
      for (int64_t it = it0; it < it1; ++it) {
        const int64_t b = it / (Hkv * tiles), kh = it / tiles % Hkv, q0 = it % tiles * NQ;
        const float* kb = kp + row[b] * ks0 + kh * ks1;
        const float* vb = vp + row[b] * vs0 + kh * vs1;
        const int tile = static_cast<int>(std::min<int64_t>(NQ, nqh - q0));
        int64_t n[NQMAX], nmax = 0, p0 = has_mask ? sl[b * T] : 0, top = p0;
        float* orow[NQMAX];
        for (int i = 0; i < tile; ++i) {
          const int64_t t = (q0 + i) / group, h = kh * group + (q0 + i) % group, bt = b * T + t, p = pos[bt];
          n[i] = p + 1;
          if (has_mask) {  // the history, then the new slots the mask allows, increasing
            vl[i].resize(p0);
            for (int64_t j = 0; j < p0; ++j) vl[i][j] = static_cast<int32_t>(j);
            const size_t own = vl[i].size();
            for (int64_t u = 0; u < T; ++u)
              if (mp[bt * T + u]) vl[i].push_back(static_cast<int32_t>(sl[b * T + u]));
            std::sort(vl[i].begin() + own, vl[i].end());
            n[i] = static_cast<int64_t>(vl[i].size());
            vis[i] = vl[i].data();
            top = std::max<int64_t>(top, vl[i].back() + 1);
          }
          nmax = std::max(nmax, n[i]);
          rope_rot(qp + bt * N + h * D, cp + p * half, sp + p * half, qt.data() + i * D, half);
          orow[i] = op + bt * H * D + h * D;
        }
        const int64_t n8 = (std::max(nmax, top) + 7) / 8 * 8;
        sc.resize(NQ * n8);
        e.resize(NQ * n8);
        const int32_t* const* v = has_mask ? vis : nullptr;
        (wide ? kWideTiles : kTiles)[tile - 1](qt.data(), n, D, kb, ks2, vb, vs2, scale, sc.data(), e.data(), n8,
                                                orow, v, p0, top);
      }
    } else {
    std::vector<float> q(D);
    std::vector<int32_t> js;
    std::vector<char> seen;
    // Dynamic, in runs of half a KV group (consecutive heads share their keys and values in
    // cache): a thread on a starved vCPU takes fewer runs.  No row's arithmetic depends on it.
#pragma omp for schedule(dynamic, run)
    for (int64_t idx = 0; idx < work; ++idx) {
      const int64_t bt = idx / H, h = idx % H, b = bt / T, t = bt % T, p = pos[bt], kh = h / group;
      // the slots this query sees, increasing
      js.clear();
      if (!has_mask) {
        for (int64_t j = 0; j <= p; ++j) js.push_back(static_cast<int32_t>(j));
      } else {
        const int64_t p0 = sl[b * T];
        int64_t top = p0;
        for (int64_t u = 0; u < T; ++u) top = std::max(top, sl[b * T + u] + 1);
        seen.assign(top, 0);
        for (int64_t j = 0; j < p0; ++j) seen[j] = 1;
        for (int64_t u = 0; u < T; ++u) seen[sl[b * T + u]] = mp[(b * T + t) * T + u];
        for (int64_t j = 0; j < top; ++j)
          if (seen[j]) js.push_back(static_cast<int32_t>(j));
      }
      const int64_t n = static_cast<int64_t>(js.size());
      float* orow = op + bt * H * D + h * D;
      if (n == 0) {  // nothing visible: zeros (as the reference kernel gives)
        std::fill(orow, orow + D, 0.f);
        continue;
      }
      rope_rot(qp + bt * N + h * D, cp + p * half, sp + p * half, q.data(), half);
      const float* kb = kp + row[b] * ks0 + kh * ks1;
      const float* vb = vp + row[b] * vs0 + kh * vs1;
      const int64_t n8 = (n + 7) / 8 * 8;
      sc.resize(n8);
      e.resize(n8);
      // scores, four keys at a time (independent FMA chains)
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) {
        const float* k0 = kb + js[i] * ks2;
        const float* k1 = kb + js[i + 1] * ks2;
        const float* k2 = kb + js[i + 2] * ks2;
        const float* k3 = kb + js[i + 3] * ks2;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q.data() + d);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
        }
        float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
        for (; d < D; ++d) {
          s0 += q[d] * k0[d];
          s1 += q[d] * k1[d];
          s2 += q[d] * k2[d];
          s3 += q[d] * k3[d];
        }
        sc[i] = s0 * scale;
        sc[i + 1] = s1 * scale;
        sc[i + 2] = s2 * scale;
        sc[i + 3] = s3 * scale;
      }
      for (; i < n; ++i) {
        const float* k0 = kb + js[i] * ks2;
        __m256 a0 = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.data() + d), _mm256_loadu_ps(k0 + d), a0);
        float s0 = hsum(a0);
        for (; d < D; ++d) s0 += q[d] * k0[d];
        sc[i] = s0 * scale;
      }
      const float m = max_of(sc.data(), n);
      for (i = n; i < n8; ++i) sc[i] = -INFINITY;  // exp gives 0: padding adds nothing
      const __m256 mv = _mm256_set1_ps(m);
      __m256 lv = _mm256_setzero_ps();
      for (i = 0; i < n8; i += 8) {
        const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc.data() + i), mv));
        _mm256_storeu_ps(e.data() + i, ev);
        lv = _mm256_add_ps(lv, ev);
      }
      const float inv = 1.0f / hsum(lv);
      if (D % 8 == 0 && D <= 64) {
        weighted_sum<8>(e.data(), js.data(), n, vb, vs2, D, inv, orow);
      } else if (D % 8 == 0 && D <= 128) {
        weighted_sum<16>(e.data(), js.data(), n, vb, vs2, D, inv, orow);
      } else {
        std::fill(orow, orow + D, 0.f);
        for (i = 0; i < n; ++i) {
          const float* vr = vb + js[i] * vs2;
          for (int64_t d = 0; d < D; ++d) orow[d] += e[i] * vr[d];
        }
        for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
      }
    }
    }
  }
  return out;
}

// ============================ Python binding ================================
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += d; rms_norm(x) * w");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attend", &attend, "RoPE, KV cache write and attention for a few query rows");
  m.def("attend_tile_queries", [] { return wide_attention() ? kWideTile : kTile; },
        "queries per tile of the grouped attention path (12 on either ISA)");
}
