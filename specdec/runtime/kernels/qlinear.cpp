// Few-row matmul on GGUF-quantised weights: out[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// with W kept in its GGUF block format (repacked, still quantised) and x quantised
// to int8 blocks (32 elements; 256 with per-32 power-of-two refinements against the
// K-quants), so the inner loop is an integer dot product.
//
// Why int8 activations: with fp32 activations every weight costs M FMAs after it
// is dequantised, and at 4-6 bits per weight the FMAs, not the bytes, set the
// time from M ~ 2 on.  maddubs multiplies 32 byte pairs per instruction, so one
// decoded weight vector serves M rows at ~2 instructions per row.
//
// Math (exact integers, then fp32): per weight sub-block b (16 or 32 k) the
// GGUF formats all dequantise as w = ws[n,b] * q + wm[n,b] with q a small
// unsigned (signed for Q8_0) integer; x[m, k] ~ dx[m, B] * xq[m, k] with
// xq in [-127, 127] and B the activation block holding k.
//   32-k formats (Q8_0, Q4_0, Q4_1, Q5_0): B = 32 = the weight block, and
//     y[m, n] = sum_b  ws * (dx * I) + wm * (dx * S),   I = sum q * xq,  S = sum xq
//   with the float steps per block, in this order: t = float(I) * dx;
//   acc = fma(ws, t, acc); acc = fma(wm, dxS, acc) (dxS = dx * float(S), once per row and block).
//   K-quants (Q4_K, Q6_K): one scale D per 256 = the super-block, and per 32-block a
//   power-of-two refinement: dx = D * 2^-e with e in [0, XE] the largest exponent that keeps
//   |xq| <= 127 (a block 16x smaller than the super-block's largest still gets a fine
//   scale; plain per-256 scales, llama.cpp's Q8_K, quadrupled Qwen 1.5B's logit error
//   against fp32: relative RMS 1.4% -> 5.3%; XE = 3 keeps S << sh within int16).  The weight
//   sub-block scales are small integers: ws = d * sc, wm = -dmin * mn (Q4_K) or
//   -32 * d * sc (Q6_K), d and dmin fp16 per super-block.  So everything folds into exact
//   int32 sums (sh = XE - e of the 32-block holding b):
//     Q4_K: C = sum_b (sc_b * I_b) << sh,  Cm = sum_b mn_b * (S_b << sh)
//     Q6_K: C = sum_32-blocks (sum_b in it sc_b * (I_b - 32 * S_b)) << sh
//   (the AVX2 path folds the -32 * S_b into its int16 sub-block sums, see i16_steps; the same C)
//   and the float steps per record are t = float(C) * D'; acc = fma(d, t, acc)
//   (Q4_K then tm = float(Cm) * D'; acc = fma(-dmin, tm, acc)), D' = D * 2^-XE: 2-4 float
//   operations per 256 k instead of 4 per 16 or 32 k.  (Measured: the per-sub-block float
//   steps were ~17% of a Q4_K M = 1 call and ~30% of a Q6_K M = 5 call.)  Bounds: |C| <=
//   8 * 63 * (32 * 15 * 127) * 8 (Q4_K), 8 * 128 * (32 * 32 * 127) * 8 < 2^31 (Q6_K).
// Each output's chain runs over blocks (records) in order from 0.0f, then
// "+ bias"; it depends only on row m's own data, never on M, the row grouping
// or the thread split: row m of an M-row call is bit-identical to the row
// computed alone.
//
// Layout (built by quant.py): per format, outputs are padded to panels of 16,
// and each panel is a sequence of records, one per RK k (RK = 32, or 256 for
// the K-quants): [scales | low plane | high plane].
//   low plane, per k-step of 4 k: 32 bytes; byte 4j+i holds k-step element i
//     of output j (low nibble) and of output 8+j (high nibble).  8-bit
//     formats: 64 bytes, outputs 0-7 then 8-15.  So one 32-bit lane = one
//     output x 4 k, and maddubs + madd against a broadcast 4-byte x gives
//     each output's partial dot product in its own lane, no shuffles.
//   high plane (5-bit: 1 bit, 6-bit: 2 bits per weight): 32-byte vectors whose
//     byte p holds, for 4 (5-bit) or 2 (6-bit) consecutive k-steps, the high
//     bits of byte p of the low-nibble (field 2t) and high-nibble (field 2t+1)
//     halves; field f occupies bits [f*b, f*b + b).
//   scales: the format's own fp16 / 6-bit / int8 scale fields, unchanged in
//     value, reordered to 16 outputs per vector (see quant.py).
//   Q6_K2 (Q6_K for the AVX2 routine, packed where that routine runs): the same scales, and
//     in place of the two planes one plane of k-step pairs (see decode_half).
// Three implementations: AVX2 (+F16C; maddubs/madd, what Zen 3 runs), AVX-512 VNNI
// (vpdpbusd), and AMX int8 tiles for calls of many rows (see "AMX int8 tiles"), chosen at run
// time.  Integer sums are exact and the fp32 epilogue is the same per-lane code, so all give
// the same bits.

#include <torch/extension.h>

#include <immintrin.h>
#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// ============================ Formats: block layouts and traits =============
constexpr int NR = 16;  // outputs per panel

// Q6_K2: Q6_K's values in the AVX2 layout of its code planes (see decode_half); AVX2 only.
enum Fmt : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q4_K = 4, Q6_K = 5, Q6_K2 = 6 };

template <int F>
struct Traits;
// rk: k per record; sb: k per scale sub-block; bits: weight code width;
// sbytes: scale bytes per record; has_m: wm != 0.
template <> struct Traits<Q8_0> { static constexpr int rk = 32, sb = 32, bits = 8, sbytes = 32; static constexpr bool has_m = false; };
template <> struct Traits<Q4_0> { static constexpr int rk = 32, sb = 32, bits = 4, sbytes = 32; static constexpr bool has_m = true; };
template <> struct Traits<Q4_1> { static constexpr int rk = 32, sb = 32, bits = 4, sbytes = 64; static constexpr bool has_m = true; };
template <> struct Traits<Q5_0> { static constexpr int rk = 32, sb = 32, bits = 5, sbytes = 32; static constexpr bool has_m = true; };
template <> struct Traits<Q4_K> { static constexpr int rk = 256, sb = 32, bits = 4, sbytes = 320; static constexpr bool has_m = true; };
template <> struct Traits<Q6_K> { static constexpr int rk = 256, sb = 16, bits = 6, sbytes = 288; static constexpr bool has_m = true; };
template <> struct Traits<Q6_K2> : Traits<Q6_K> {};

template <int F>
constexpr int lo_bytes() { return Traits<F>::rk / 4 * (Traits<F>::bits == 8 ? 64 : 32); }
template <int F>
constexpr int hi_bytes() {
  return Traits<F>::bits == 5 ? Traits<F>::rk * 2 : Traits<F>::bits == 6 ? Traits<F>::rk * 4 : 0;
}
template <int F>
constexpr int rec_bytes() { return Traits<F>::sbytes + lo_bytes<F>() + hi_bytes<F>(); }

inline __m256 h2f(const uint8_t* p) {  // 8 fp16 -> fp32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Scale fields of one 32-k format record -> ws, wm [16] fp32 (the K-quants': Rec::load).
template <int F>
inline void scales(const uint8_t* s, float* ws, float* wm) {
  for (int h = 0; h < 2; ++h) {
    const int o = 8 * h;
    if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
      const __m256 d = h2f(s + 2 * o);
      _mm256_storeu_ps(ws + o, d);
      const float off = F == Q4_0 ? -8.f : -16.f;
      _mm256_storeu_ps(wm + o, _mm256_mul_ps(d, _mm256_set1_ps(off)));  // exact: power of 2
    } else {
      static_assert(F == Q4_1, "K-quant scales are Rec::load's");
      _mm256_storeu_ps(ws + o, h2f(s + 2 * o));
      _mm256_storeu_ps(wm + o, h2f(s + 32 + 2 * o));
    }
  }
}

inline __m256i shift16(__m256i v, int sh) {
  return sh >= 0 ? _mm256_slli_epi16(v, sh) : _mm256_srli_epi16(v, -sh);
}

// Weight codes of k-step s (of the record) for outputs 8H .. 8H+7 (H = 0, 1).
//
// Q6_K2 (Q6_K's codes for the AVX2 routine): no low and high planes but one plane of k-step
// pairs, 96 bytes each: V0, V1, V2 hold whole 6-bit codes in bits 0-5 (k-step 2i halves 0 and
// 1, k-step 2i+1 half 0) and the fourth vector's code (k-step 2i+1, half 1) two bits each in
// bits 6-7 (its bits 0-1 in V0, 2-3 in V1, 4-5 in V2).  Decoding the four vectors takes 11
// operations, the low + high planes 17 (Q6_K at M = 5, weights in L1, one thread: 0.90x the
// time, Zen 3).  AVX-512 keeps the planes (its decode is a different sequence, and there is no
// machine here to test a new one on).
template <int F, int H>
inline __m256i decode_half(const uint8_t* lo, const uint8_t* hi, int s) {
  constexpr int bits = Traits<F>::bits;
  if constexpr (F == Q6_K2) {
    const uint8_t* v = lo + (s / 2) * 96;
    auto ld = [v](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * i)); };
    const __m256i m6 = _mm256_set1_epi8(0x3F);
    if (s % 2 == 0) return _mm256_and_si256(ld(H), m6);
    if (H == 0) return _mm256_and_si256(ld(2), m6);
    // (the 16-bit shifts pull the next byte's low bits in above bit 5; the masks drop them)
    const __m256i c0 = _mm256_and_si256(_mm256_srli_epi16(ld(0), 6), _mm256_set1_epi8(0x03));
    const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(ld(1), 4), _mm256_set1_epi8(0x0C));
    const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(ld(2), 2), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(_mm256_or_si256(c0, c1), c2);
  } else if constexpr (bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + s * 64 + 32 * H));
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + s * 32));
    __m256i w = _mm256_and_si256(H == 0 ? v : _mm256_srli_epi16(v, 4), m4);
    if constexpr (bits == 5 || bits == 6) {
      constexpr int g = bits == 5 ? 4 : 2;  // k-steps per high-plane vector
      constexpr int b = bits - 4;           // high bits per weight
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + (s / g) * 32));
      const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << b) - 1) << 4));
      const int f = 2 * (s % g) + H;  // this half's field
      w = _mm256_or_si256(w, _mm256_and_si256(shift16(h, 4 - f * b), mask));
    }
    return w;
  }
}

// ============================ Activations: int8 blocks of a call ============
// Quantised activations, in 32-blocks for the 32-k formats and 256-blocks for the K-quants
// (a call quantises x once per block size its segments need).
struct Act {
  int64_t K;
  // 32-blocks: xq [M, K]; s32, dx, dxs32 [M, K/32] (s32 = sum of xq: the AVX-512 Q8_0 correction)
  const int8_t* xq;
  const int32_t* s32;
  const float* dx;
  const float* dxs32;
  // 256-blocks: xq8 [M, K], dx8 [M, K/256] = D * 2^-XE; per 32-block [M, K/32]: sh = XE - e,
  // sp16 = the int16 pair (S16 of the first 16 k, of the next 16; S16 = sum of xq over 16 k; the
  // AVX-512 Q6_K correction); tp [M, K/64] = the int16 pair (T of this 32-block, of the next),
  // T = (sum of xq) << sh, |T| <= 32 * 127 * 8.
  const int8_t* xq8;
  const float* dx8;
  const int32_t* sh;
  const int32_t* sp16;
  const int32_t* tp;
  // per 16-k sub-block [M, K/16] (the AVX2 Q6_K offset, see i16_steps): cq = the int16 pair
  // 32 * (sum of xq at k = 0, 1 mod 4, at k = 2, 3 mod 4), each |.| <= 32 * 8 * 127 = 32512.
  const int32_t* cq;
  // AMX K-quants, Mp * K bytes each, tile-major (see amx::split): A' = xq8 << sh, exact in int16,
  // as 16 * ah + al with ah in [-64, 63], al in [0, 15].  Only where a Q4_K or Q6_K segment runs
  // on AMX.  (A row block's pointer m0 * K is its first tile's block: m0 is a multiple of 16.)
  const int8_t* ah;
  const uint8_t* al;
  // Row groups of <= MR rows, near-equal sizes (16 -> 4+4+4+4 on AVX2, 8+8 on AVX-512;
  // grouping never changes a row's sums): group g is rows grp[g] .. grp[g+1]-1.
  const int64_t* grp;
  int64_t ng;
  // AVX-512 wide K-quant calls (see avx512::panel_wide), per row group of R rows starting at row
  // g0 (of the row block): xw at g0 * K, xq8's bytes group-major (k-step s, row r at 4 (s R + r));
  // at g0 * (K / 32), per 32-block b and row r at b R + r: shw = 64 sh (a byte offset into a
  // record's scale table) and nsw = the int16 pair (-(S16 << sh) of the first 16 k, of the next 16).
  const int8_t* xw = nullptr;
  const int32_t* shw = nullptr;
  const int32_t* nsw = nullptr;
};

constexpr int XE = 3;  // largest per-32 exponent inside a 256-block (see the header)

template <int F>
constexpr bool kquant() { return F == Q4_K || F == Q6_K || F == Q6_K2; }

// A record's scales as the row loops use them.  32-k formats: fp32 ws, wm per sub-block.
// K-quants: ws = d, wm = -dmin (Q4_K) per output; sc = the sub-block scales as int32
// multipliers of the int32 sub-block sums (AVX2, W = false: the int16 pair (sc, sc), for
// madd over an int16 pair of partial sums; AVX-512: plain int32, for mullo); mp = int16 pairs
// of adjacent sub-blocks' mins (Q4_K, against tp) or scales (Q6_K, against sp16).
template <int F, bool W>
struct Rec {
  static constexpr int nsub = Traits<F>::rk / Traits<F>::sb;
  static constexpr bool kq = kquant<F>();
  alignas(64) float ws[kq ? NR : nsub * NR];
  alignas(64) float wm[kq ? NR : nsub * NR];
  alignas(64) int32_t sc[kq ? nsub * NR : 1];
  alignas(64) int32_t mp[kq ? nsub / 2 * NR : 1];

  void load(const uint8_t* s) {
    if constexpr (!kq) {
      scales<F>(s, ws, wm);
    } else {
      // Each field is 16 bytes (outputs 0..15) per sub-block.
      constexpr int sc_off = F == Q4_K ? 64 : 32, mp_off = F == Q4_K ? 192 : 32;
      auto field = [&](int off, int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off + j * NR)); };
      auto widen = [](__m128i b) { return F == Q4_K ? _mm256_cvtepu8_epi16(b) : _mm256_cvtepi8_epi16(b); };
      for (int h = 0; h < 2; ++h) _mm256_store_ps(ws + 8 * h, h2f(s + 16 * h));
      if constexpr (F == Q4_K)
        for (int h = 0; h < 2; ++h)
          _mm256_store_ps(wm + 8 * h, _mm256_xor_ps(h2f(s + 32 + 16 * h), _mm256_set1_ps(-0.0f)));
      for (int j = 0; j < nsub; ++j) {
        const __m128i b = field(sc_off, j);
        if constexpr (W) {  // AVX-512: plain int32 per output
          for (int h = 0; h < 2; ++h) {
            const __m128i b8 = h ? _mm_unpackhi_epi64(b, b) : b;
            _mm256_store_si256(reinterpret_cast<__m256i*>(sc + j * NR + 8 * h),
                               F == Q4_K ? _mm256_cvtepu8_epi32(b8) : _mm256_cvtepi8_epi32(b8));
          }
        } else {
          // AVX2, the int16 pair (sc, sc): widen all 16 to int16, [o0..o7 | o8..o15] ->
          // [o0-3, o8-11 | o4-7, o12-15]; the in-lane unpacks then give outputs 0-7 and 8-15
          const __m256i v = _mm256_permute4x64_epi64(widen(b), 0xD8);
          _mm256_store_si256(reinterpret_cast<__m256i*>(sc + j * NR), _mm256_unpacklo_epi16(v, v));
          _mm256_store_si256(reinterpret_cast<__m256i*>(sc + j * NR + 8), _mm256_unpackhi_epi16(v, v));
        }
      }
      if constexpr (F == Q4_K || W) {  // (AVX2 Q6_K folds its offset into the int16 sums: no mp)
        for (int i = 0; i < nsub / 2; ++i) {  // bytes (a_o, b_o) -> the int16 pair of output o
          const __m128i a = field(mp_off, 2 * i), b = field(mp_off, 2 * i + 1);
          _mm256_store_si256(reinterpret_cast<__m256i*>(mp + i * NR), widen(_mm_unpacklo_epi8(a, b)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(mp + i * NR + 8), widen(_mm_unpackhi_epi8(a, b)));
        }
      }
    }
  }
};

// k-steps whose maddubs results can be summed in int16 before widening, exactly: one
// k-step adds at most 2 * qmax * 127 to a lane (qmax = 15, 31 for 4-, 5-bit codes,
// |xq| <= 127), so 8 (4-bit: 30480) or 4 (5-bit: 31496) of them stay below 32767.  Q8_0
// (|w| up to 128: 32512 per k-step) widens every k-step.  Q6_K (codes q <= 63) sums its
// whole 16-k sub-block, 4 k-steps, in wrapping int16 and then subtracts cq, 32 * the lane's
// sum of xq: what remains is sum (q - 32) * xq, |.| <= 4 * 2 * 32 * 127 = 32512, so the
// wrapped int16 holds it exactly (2 k-steps per widening before: 6 multiply-pipe ops per 16 k
// and row-half instead of 5, and the -32 * S terms apart).  Integer sums are exact in any
// order, so this changes the instruction count, not a single bit.
template <int F>
constexpr int i16_steps() {
  constexpr int bits = Traits<F>::bits, ns = Traits<F>::sb / 4;
  constexpr int g = bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 4 : 1;
  return g < ns ? g : ns;
}

// Software prefetch of share i of a record cut into `parts` whole-line shares; pf = the record
// + the routine's pf_ahead.  The K-quant routines spread a record's prefetches this way, one
// share per 32-block (AVX2) or sub-block (AVX-512), instead of one burst (see panel).
template <int F, int parts>
inline void prefetch_share(const uint8_t* pf, int i) {
  constexpr int step = (rec_bytes<F>() / parts + 63) / 64 * 64;
  for (int off = 0; off < step; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(pf + i * step + off), _MM_HINT_T0);
}

// ============================ AVX2 routine: rows of one record ==============
// One record, R <= 5 rows.  The 16 outputs are two halves of 8 (one ymm each), run
// together: each decoded weight and each broadcast x serve both halves.  (Q6_K used to run
// the halves one after the other at R > 2, when its float epilogue per 16-k sub-block kept
// fp32 sums live too; since the scales fold into integer sums, together is ~12% faster at
// M = 5, measured on Zen 3.)
// The per-lane fp32 steps are the AVX-512 path's (see the header), so the same bits.
template <int F, int R>
struct Avx2Rows {
  static constexpr bool wide = false;
  static constexpr int pf_ahead = 4096;  // K-quant prefetch distance, bytes (see panel)
  static constexpr int NH = 2;  // output halves
  static constexpr int G = i16_steps<F>(), NS = Traits<F>::sb / 4;
  static_assert(NS % G == 0, "k-steps per sub-block must be a multiple of the int16 run");

  // s[r][h] = sum over the G k-steps t0 .. t0+G-1 (of the record) of row r's maddubs products
  // with half h's codes, in int16 (exact, see i16_steps).
  static inline void i16_run(const uint8_t* lo, const uint8_t* hi, const int8_t* x, int64_t K, int t0,
                             __m256i (&s)[R][NH]) {
#pragma GCC unroll 8
    for (int t = t0; t < t0 + G; ++t) {
      __m256i w[NH], u[NH];
      w[0] = decode_half<F, 0>(lo, hi, t);
      w[1] = decode_half<F, 1>(lo, hi, t);
      for (int h = 0; h < NH; ++h)  // maddubs wants unsigned x signed; Q8_0's signed codes go as |w| x sign(x, w)
        u[h] = F == Q8_0 ? _mm256_abs_epi8(w[h]) : w[h];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, x + r * K + 4 * (t % NS), 4);
        const __m256i xb = _mm256_set1_epi32(x4);
        for (int h = 0; h < NH; ++h) {
          // codes <= 63, |xq| <= 127: pair sums <= 16002, no saturation
          const __m256i p = _mm256_maddubs_epi16(u[h], F == Q8_0 ? _mm256_sign_epi8(xb, w[h]) : xb);
          s[r][h] = t == t0 ? p : _mm256_add_epi16(s[r][h], p);
          // Keep the sums a chain in k-step order: without this barrier GCC
          // re-associates the unrolled adds into a tree, computes every k-step's
          // products first and spills them (~4x slower at R = 5).  Same sums.
          asm("" : "+x"(s[r][h]));
        }
      }
    }
  }

  template <bool Pre = false>  // (decoded records are the AVX-512 routine's only)
  static void run(const uint8_t* lo, const uint8_t* hi, const Act& a, int64_t m0, int64_t k0,
                  const Rec<F, false>& rs, float* acc, const uint8_t* pf) {
    static_assert(!Pre, "the AVX2 routine decodes its own codes");
    if constexpr (kquant<F>()) {
      run_kq(lo, hi, a, m0, k0, rs, acc, pf);
    } else {
      static_assert(Traits<F>::rk == Traits<F>::sb, "32-k formats: one sub-block per record");
      const int64_t n32 = a.K / 32, K = a.K, b32 = k0 / 32;
      const __m256i ones = _mm256_set1_epi16(1);
      const int8_t* x = a.xq + m0 * K + k0;
      __m256i cj[R][NH];
#pragma GCC unroll 8
      for (int t0 = 0; t0 < NS; t0 += G) {
        __m256i s[R][NH];
        i16_run(lo, hi, x, K, t0, s);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h) {
            const __m256i w32 = _mm256_madd_epi16(s[r][h], ones);
            cj[r][h] = t0 == 0 ? w32 : _mm256_add_epi32(cj[r][h], w32);
          }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m256 dx = _mm256_set1_ps(a.dx[m * n32 + b32]);
        for (int h = 0; h < NH; ++h) {
          float* out = acc + m * NR + 8 * h;
          __m256 f = _mm256_fmadd_ps(_mm256_load_ps(rs.ws + 8 * h), _mm256_mul_ps(_mm256_cvtepi32_ps(cj[r][h]), dx),
                                     _mm256_loadu_ps(out));
          if constexpr (Traits<F>::has_m)
            f = _mm256_fmadd_ps(_mm256_load_ps(rs.wm + 8 * h), _mm256_set1_ps(a.dxs32[m * n32 + b32]), f);
          _mm256_storeu_ps(out, f);
        }
      }
    }
  }

  // K-quants, one 32-block (8 k-steps: one Q4_K sub-block, two Q6_K ones) per iteration: the
  // int16 runs (Q6_K's offset by cq, see i16_steps) widen through madd by the sub-block scale
  // into the 32-block's sum, which is shifted by sh once into C.  Q4_K's min terms are summed
  // once per record in the epilogue, as Cm = sum of mp pairs x tp pairs.
  static void run_kq(const uint8_t* lo, const uint8_t* hi, const Act& a, int64_t m0, int64_t k0,
                     const Rec<F, false>& rs, float* acc, const uint8_t* pf) {
    constexpr int spb = 32 / Traits<F>::sb;  // sub-blocks per 32-block
    constexpr int nb = Traits<F>::rk / 32;   // 32-blocks per record
    const int64_t n32 = a.K / 32, K = a.K, b0 = k0 / 32;
    __m256i c[R][NH];  // the record's C
#pragma GCC unroll 1
    for (int jb = 0; jb < nb; ++jb) {
      const int8_t* x = a.xq8 + m0 * K + k0 + 32 * jb;
      // Prefetch: this 32-block's share of the record 4 KiB ahead, spread through the record.
      // A burst of the whole record at its start (all ~50 lines; the 32-k formats' way) left the
      // loads waiting once this routine got faster: single-thread streaming A/B on 100 MB of
      // Qwen rows, Q6_K M = 1 took 1.23x the time with the burst, 0.75x spread, against the
      // previous routine; two threads: Q4_K M = 1 0.86x (it had no software prefetch), Q6_K
      // M = 1 0.80x, M = 5 0.93x.
      if (pf != nullptr) prefetch_share<F, nb>(pf, jb);
      __m256i c32[R][NH];  // this 32-block's sum
#pragma GCC unroll 2
      for (int js = 0; js < spb; ++js) {
        const int j = jb * spb + js;  // sub-block
        __m256i mul[NH];  // the sub-block scale as an int16 pair per output
        for (int h = 0; h < NH; ++h) mul[h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(rs.sc + j * NR + 8 * h));
#pragma GCC unroll 8
        for (int t0 = 0; t0 < NS; t0 += G) {
          __m256i s[R][NH];
          i16_run(lo, hi, x + js * Traits<F>::sb, K, j * NS + t0, s);
          if constexpr (Traits<F>::bits == 6) {
            static_assert(G == NS, "the Q6_K offset is per sub-block");
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i cr = _mm256_set1_epi32(a.cq[(m0 + r) * (K / 16) + (k0 + 32 * jb) / 16 + js]);
              for (int h = 0; h < NH; ++h) s[r][h] = _mm256_sub_epi16(s[r][h], cr);  // wraps back: exact
            }
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < NH; ++h) {
              // |s| <= 32767, |sc| <= 128: each product pair fits int32 with room to spare
              const __m256i w32 = _mm256_madd_epi16(s[r][h], mul[h]);
              c32[r][h] = js == 0 && t0 == 0 ? w32 : _mm256_add_epi32(c32[r][h], w32);
            }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i shv = _mm256_set1_epi32(a.sh[(m0 + r) * n32 + b0 + jb]);
        for (int h = 0; h < NH; ++h) {
          const __m256i v = _mm256_sllv_epi32(c32[r][h], shv);
          c[r][h] = jb == 0 ? v : _mm256_add_epi32(c[r][h], v);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256 dx = _mm256_set1_ps(a.dx8[m * (K / 256) + k0 / 256]);
      for (int h = 0; h < NH; ++h) {
        const int o = 8 * h;
        float* out = acc + m * NR + o;
        __m256 fv = _mm256_fmadd_ps(_mm256_load_ps(rs.ws + o), _mm256_mul_ps(_mm256_cvtepi32_ps(c[r][h]), dx),
                                    _mm256_loadu_ps(out));
        if constexpr (F == Q4_K) {
          __m256i cm = _mm256_setzero_si256();  // sum_b mn_b * (S_b << sh), tp pairs per 64 k
          for (int i = 0; i < 4; ++i)
            cm = _mm256_add_epi32(cm, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(rs.mp + i * NR + o)),
                                                        _mm256_set1_epi32(a.tp[m * (K / 64) + k0 / 64 + i])));
          fv = _mm256_fmadd_ps(_mm256_load_ps(rs.wm + o), _mm256_mul_ps(_mm256_cvtepi32_ps(cm), dx), fv);
        }
        _mm256_storeu_ps(out, fv);
      }
    }
  }
};

// ============================ AVX-512 VNNI ==================================
// Same layout, same integer sums (exact), same per-lane fp32 epilogue: the bits equal the
// AVX2 path's.  One zmm holds 16 outputs x 4 k; vpdpbusd adds the four u8 x s8 products of
// each lane into int32 without int16 saturation.  Q8_0 codes are signed, so they are offset
// to u8 (w + 128) and 128 * sum(xq) is subtracted from each block's integer sum.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace avx512 {

template <int F>
inline __m512i decode(const uint8_t* lo, const uint8_t* hi, int s) {
  constexpr int bits = Traits<F>::bits;
  if constexpr (bits == 8) {
    return _mm512_xor_si512(_mm512_loadu_si512(lo + s * 64), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // [v, v] straight from memory (a load-port broadcast, no shuffle uop)
    const __m512i vz = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + s * 32)));
    const __m512i cnt = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i w = _mm512_and_si512(_mm512_srlv_epi16(vz, cnt), _mm512_set1_epi8(0x0F));
    if constexpr (bits == 5 || bits == 6) {
      constexpr int g = bits == 5 ? 4 : 2, b = bits - 4;
      const __m512i hz = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + (s / g) * 32)));
      const int f0 = 2 * (s % g);
      const __m512i hc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(f0 * b)),
                                            _mm256_set1_epi16((f0 + 1) * b), 1);
      const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(hz, hc), _mm512_set1_epi8((1 << b) - 1));
      w = _mm512_or_si512(w, _mm512_slli_epi16(hb, 4));  // fields <= 3: no carry across bytes
    }
    return w;
  }
}

// A record's codes, decoded: 64 bytes per k-step at codes (64-byte aligned).  pf: a record's
// worth of lines to prefetch, one per k-step (as the narrow routine spreads its prefetches; a
// burst of a record's lines stalls on the fill buffers), or nullptr.
template <int F>
void decode_record(const uint8_t* lo, const uint8_t* hi, uint8_t* codes, const uint8_t* pf = nullptr) {
#pragma GCC unroll 8
  for (int t = 0; t < Traits<F>::rk / 4; ++t) {
    if (pf != nullptr && 64 * t < rec_bytes<F>()) _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * t), _MM_HINT_T0);
    _mm512_store_si512(codes + 64 * t, decode<F>(lo, hi, t));
  }
}

// Pre: lo is the record's codes already decoded, 64 bytes per k-step (see panel).
template <int F, int R>
struct Rows {  // one record, R <= 8 rows
  static constexpr bool wide = true;
  static constexpr int pf_ahead = 6144;  // K-quant prefetch distance, bytes (see panel)
  template <bool Pre = false>
  static void run(const uint8_t* lo, const uint8_t* hi, const Act& a, int64_t m0, int64_t k0,
                  const Rec<F, true>& rs, float* acc, const uint8_t* pf) {
    constexpr int sb = Traits<F>::sb, ns = sb / 4, nsub = Traits<F>::rk / sb;
    constexpr bool kq = kquant<F>();
    const int64_t K = a.K, n32 = K / 32;
    __m512 f[R];  // the rows' running sums stay in registers for the whole record
    __m512i c[R], c32[R];  // K-quants: the record's C; the current 32-block's sum
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) f[r] = _mm512_loadu_ps(acc + (m0 + r) * NR);
    for (int j = 0; j < nsub; ++j) {
      if constexpr (kq)
        if (pf != nullptr) prefetch_share<F, nsub>(pf, j);
      const int64_t kb = k0 + j * sb;
      __m512i cj[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) cj[r] = _mm512_setzero_si512();
      const int8_t* x = (kq ? a.xq8 : a.xq) + m0 * K + kb;
#pragma GCC unroll 8
      for (int t = 0; t < ns; ++t) {
        const __m512i w = Pre ? _mm512_load_si512(lo + 64 * (j * ns + t)) : decode<F>(lo, hi, j * ns + t);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, x + r * K + 4 * t, 4);
          cj[r] = _mm512_dpbusd_epi32(cj[r], w, _mm512_set1_epi32(x4));
        }
      }
      if constexpr (kq) {  // the AVX2 path's integers, exactly
        const __m512i scv = _mm512_load_si512(rs.sc + j * NR);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i p = _mm512_mullo_epi32(cj[r], scv);
          c32[r] = F == Q6_K && j % 2 ? _mm512_add_epi32(c32[r], p) : p;
        }
        if (F == Q4_K || j % 2 == 1) {
          const int64_t b32 = kb / 32;
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int64_t m = m0 + r;
            __m512i v = c32[r];
            if constexpr (F == Q6_K)
              v = _mm512_sub_epi32(v, _mm512_slli_epi32(_mm512_madd_epi16(_mm512_load_si512(rs.mp + (j / 2) * NR),
                                                                          _mm512_set1_epi32(a.sp16[m * n32 + b32])), 5));
            v = _mm512_sllv_epi32(v, _mm512_set1_epi32(a.sh[m * n32 + b32]));
            c[r] = j == (F == Q6_K ? 1 : 0) ? v : _mm512_add_epi32(c[r], v);
          }
        }
      } else {
        // The fp32 operations per lane, in the AVX2 path's order (see Avx2Rows).
        const __m512 wsv = _mm512_load_ps(rs.ws + j * NR), wmv = _mm512_load_ps(rs.wm + j * NR);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int64_t m = m0 + r;
          if constexpr (F == Q8_0)
            cj[r] = _mm512_sub_epi32(cj[r], _mm512_set1_epi32(128 * a.s32[m * n32 + kb / 32]));
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(cj[r]), _mm512_set1_ps(a.dx[m * n32 + kb / 32]));
          f[r] = _mm512_fmadd_ps(wsv, t, f[r]);
          if constexpr (Traits<F>::has_m)
            f[r] = _mm512_fmadd_ps(wmv, _mm512_set1_ps(a.dxs32[m * n32 + kb / 32]), f[r]);
        }
      }
    }
    if constexpr (kq) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512 dx = _mm512_set1_ps(a.dx8[m * (K / 256) + k0 / 256]);
        f[r] = _mm512_fmadd_ps(_mm512_load_ps(rs.ws), _mm512_mul_ps(_mm512_cvtepi32_ps(c[r]), dx), f[r]);
        if constexpr (F == Q4_K) {
          __m512i cm = _mm512_setzero_si512();
          for (int i = 0; i < nsub / 2; ++i)
            cm = _mm512_add_epi32(cm, _mm512_madd_epi16(_mm512_load_si512(rs.mp + i * NR),
                                                        _mm512_set1_epi32(a.tp[m * (K / 64) + k0 / 64 + i])));
          f[r] = _mm512_fmadd_ps(_mm512_load_ps(rs.wm), _mm512_mul_ps(_mm512_cvtepi32_ps(cm), dx), f[r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * NR, f[r]);
  }
};

// ---------------------------- Wide K-quant calls: groups of up to 12 rows --------------------
// Calls of more than 8 rows (prompt chunks, batched verification) are compute-bound, and the
// narrow routine above spends about a third of its vector operations outside vpdpbusd: per row
// and sub-block a mullo by the scales, a shift by the activation's exponent and an add, and
// scalar address arithmetic for 8 row pointers.  Here, per record, a table holds each sub-block's
// scales shifted by every exponent (sc << s, s = 0 .. XE), so the shift rides in the multiplier:
//   (I * sc) << sh = I * (sc << sh)   (exact in int32: the same products, wrapped the same way);
// Q6_K's offset term (-32 * sc * S16 per 16 k, shifted) is one vpdpwssd per row and 32-block
// against int16 pairs the activation side precomputes (nsw: -(S16 << sh), |.| <= 2032 * 8) with
// the scales times 32 (|.| <= 4096): C = sum I * (sc << sh) + sum (32 sc) . (-(S16 << sh)), the
// narrow routine's C term for term, summed in another order (integer sums wrap mod 2^32 and the
// total is within int32: the same bits).  The activations are packed per row group (xw, shw,
// nsw: one base pointer, constant offsets) and the record's codes decoded once for all groups.
// Up to 12 rows share a decoded weight vector: 12 independent vpdpbusd chains hide its latency
// (8 chains cap it at 1.6 per cycle on a 2-per-cycle, latency-5 unit).
template <int F>
struct WideRec {
  static constexpr int nsub = Traits<F>::rk / Traits<F>::sb;
  alignas(64) int32_t tab[nsub][XE + 1][NR];  // sc_j << s
  alignas(64) int32_t mp32[F == Q6_K ? nsub / 2 : 1][NR];  // Q6_K: the scale pairs times 32 (int16 pairs)
  void load(const Rec<F, true>& rs) {
    for (int j = 0; j < nsub; ++j) {
      const __m512i sc = _mm512_load_si512(rs.sc + j * NR);
      for (int e = 0; e <= XE; ++e) _mm512_store_si512(tab[j][e], _mm512_slli_epi32(sc, static_cast<unsigned>(e)));
    }
    if constexpr (F == Q6_K)
      for (int i = 0; i < nsub / 2; ++i) _mm512_store_si512(mp32[i], _mm512_slli_epi16(_mm512_load_si512(rs.mp + i * NR), 5));
  }
};

template <int F, int R>
struct WideRows {  // one record, R <= 12 rows of one group
  static void run(const uint8_t* codes, const Act& a, int64_t g0, int64_t k0, const Rec<F, true>& rs,
                  const WideRec<F>& wr, float* acc) {
    constexpr int sb = Traits<F>::sb, ns = sb / 4, nsub = Traits<F>::rk / sb;
    const int64_t K = a.K, n32 = K / 32;
    const int8_t* x = a.xw + g0 * K + k0 * R;  // the record's first k-step (k0 / 4 steps of 4 R bytes)
    const int32_t* shw = a.shw + g0 * n32 + (k0 / 32) * R;
    const int32_t* nsw = a.nsw + g0 * n32 + (k0 / 32) * R;
    const uint8_t* tab = reinterpret_cast<const uint8_t*>(wr.tab);
    __m512i c[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_si512();
    for (int j = 0; j < nsub; ++j) {
      __m512i cj[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) cj[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < ns; ++t) {
        const __m512i w = _mm512_load_si512(codes + 64 * (j * ns + t));
        const int8_t* xs = x + 4 * R * (j * ns + t);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xs + 4 * r, 4);
          cj[r] = _mm512_dpbusd_epi32(cj[r], w, _mm512_set1_epi32(x4));
        }
      }
      const int b = j * sb / 32;  // the 32-block of the record holding sub-block j
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i scs = _mm512_load_si512(tab + j * (XE + 1) * 64 + shw[b * R + r]);
        c[r] = _mm512_add_epi32(c[r], _mm512_mullo_epi32(cj[r], scs));
      }
      if constexpr (F == Q6_K)
        if (j % 2 == 1) {
          const __m512i m32 = _mm512_load_si512(wr.mp32[j / 2]);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) c[r] = _mm512_dpwssd_epi32(c[r], m32, _mm512_set1_epi32(nsw[b * R + r]));
        }
    }
    // The record's fp32 steps, the narrow routine's (Rows::run) operation for operation.
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t m = g0 + r;
      const __m512 dx = _mm512_set1_ps(a.dx8[m * (K / 256) + k0 / 256]);
      __m512 f = _mm512_fmadd_ps(_mm512_load_ps(rs.ws), _mm512_mul_ps(_mm512_cvtepi32_ps(c[r]), dx),
                                 _mm512_loadu_ps(acc + m * NR));
      if constexpr (F == Q4_K) {
        __m512i cm = _mm512_setzero_si512();
        for (int i = 0; i < nsub / 2; ++i)  // (vpdpwssd: madd + add in one, the same exact sums)
          cm = _mm512_dpwssd_epi32(cm, _mm512_load_si512(rs.mp + i * NR), _mm512_set1_epi32(a.tp[m * (K / 64) + k0 / 64 + i]));
        f = _mm512_fmadd_ps(_mm512_load_ps(rs.wm), _mm512_mul_ps(_mm512_cvtepi32_ps(cm), dx), f);
      }
      _mm512_storeu_ps(acc + m * NR, f);
    }
  }
};

// One panel (16 outputs) of a K-quant for all M rows of a wide call (the row groups of a.grp).
template <int F>
void panel_wide(const uint8_t* p, int64_t nrec, const Act& a, int64_t M, float* acc) {
  static_assert(F == Q4_K || F == Q6_K, "the wide routine is the K-quants'");
  constexpr int rb = rec_bytes<F>();
  std::memset(acc, 0, sizeof(float) * M * NR);
  Rec<F, true> rs;
  WideRec<F> wr;
  alignas(64) uint8_t codes[Traits<F>::rk / 4 * 64];
  for (int64_t rec = 0; rec < nrec; ++rec) {
    const uint8_t* s = p + rec * rb;
    rs.load(s);
    wr.load(rs);
    const uint8_t* lo = s + Traits<F>::sbytes;
    decode_record<F>(lo, lo + lo_bytes<F>(), codes, s + Rows<F, 1>::pf_ahead);
    const int64_t k0 = rec * Traits<F>::rk;
    for (int64_t g = 0; g < a.ng; ++g) {
      const int64_t g0 = a.grp[g];
      switch (a.grp[g + 1] - g0) {
#define SPECDEC_WIDE(R) case R: WideRows<F, R>::run(codes, a, g0, k0, rs, wr, acc); break;
        SPECDEC_WIDE(1) SPECDEC_WIDE(2) SPECDEC_WIDE(3) SPECDEC_WIDE(4) SPECDEC_WIDE(5) SPECDEC_WIDE(6)
        SPECDEC_WIDE(7) SPECDEC_WIDE(8) SPECDEC_WIDE(9) SPECDEC_WIDE(10) SPECDEC_WIDE(11)
        default: WideRows<F, 12>::run(codes, a, g0, k0, rs, wr, acc); break;
#undef SPECDEC_WIDE
      }
    }
  }
}

// Pack 256-blocks u0 .. u1-1 (row-major over M rows, as quantise_rows<256>) into the wide layout
// (see Act): gs[m] = the first row of row m's group, gn[m] = its rows.
void wide_pack(const int8_t* xq8, const int32_t* sh, const int32_t* sp16, int64_t K, int64_t u0, int64_t u1,
               const int64_t* gs, const int64_t* gn, int8_t* xw, int32_t* shw, int32_t* nsw) {
  const int64_t n32 = K / 32;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t m = u / (K / 256), b = u % (K / 256), g0 = gs[m], R = gn[m], r = m - g0;
    const int32_t* src = reinterpret_cast<const int32_t*>(xq8 + m * K + b * 256);
    int32_t* dst = reinterpret_cast<int32_t*>(xw + g0 * K) + r;
    for (int64_t t = b * 64; t < b * 64 + 64; ++t) dst[t * R] = src[t - b * 64];
    for (int64_t c = b * 8; c < b * 8 + 8; ++c) {
      const int32_t e = sh[m * n32 + c], v = sp16[m * n32 + c];
      const int32_t lo = -((static_cast<int32_t>(static_cast<int16_t>(v & 0xFFFF))) << e);
      const int32_t hi = -((v >> 16) << e);
      shw[g0 * n32 + c * R + r] = 64 * e;
      nsw[g0 * n32 + c * R + r] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
    }
  }
}

}  // namespace avx512
#pragma GCC pop_options

// ============================ AMX int8 tiles: many rows per weight record ===
// Where the CPU has AMX (Intel Sapphire Rapids and later), a call with many rows runs each
// panel through int8 tiles: a record's codes are decoded once into the tile B layout (one
// 64-byte row per k-step = 16 outputs x 4 k, the layout AVX-512's decode already gives) and
// serve every 16-row tile of the activations.  One tile product per (16 rows, sub-block)
// gives the sub-block's exact int32 sums I for 16 rows x 16 outputs (Q8_0: signed x signed,
// so no +128 offset; the rest: signed activations x unsigned codes); from there each row runs
// the AVX-512 routine's own integer steps and fp32 epilogue in the same order (finish_row),
// so a row's bits equal the narrow paths' whatever M is.  The K-quants fold their sub-block
// scales into the products instead (panel_folded); the rest run `panel` below.
//   Cost per 16 rows and 32-k record (panel): 1 tile product + a 1 KiB tile store + ~4 vector
// ops per row, against 2 instructions per row and k-step on VNNI (256 vs ~70).
//   Tiles (palette 1): 0, 1: A, 16 rows x sb bytes; 2, 3: B, sb / 4 rows x 64 bytes; 4-7: C,
// 16 rows x 16 int32.  A and B alternate between two tiles and C rotates over four, so four
// products are in flight (the tile registers are not renamed).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace amx {

constexpr int TM = 16;  // rows per tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

thread_local int configured_sb = 0;  // the sub-block width this thread's tiles are set for (0: none)

void configure(int sb) {
  if (configured_sb == sb) return;
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = TM, c.colsb[t] = static_cast<uint16_t>(sb);
  for (int t : {2, 3}) c.rows[t] = static_cast<uint8_t>(sb / 4), c.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) c.rows[t] = TM, c.colsb[t] = 64;
  // GCC 12's ldtilecfg builtin does not count as reading c: without this barrier the stores
  // above are dropped as dead, the all-zero config leaves every tile unconfigured and the
  // first tile instruction faults (SIGILL) -- the fault llama.cpp's AMX build shows here.
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
  configured_sb = sb;
}

void release() {  // at the end of each parallel region that used tiles
  if (configured_sb != 0) {
    _tile_release();
    configured_sb = 0;
  }
}

// Row m's share of one 32-k record from its integer sums ib (16 int32): the fp32 epilogue of
// avx512::Rows::run, operation for operation.
template <int F>
inline void finish_row(const int32_t* ib, const Rec<F, true>& rs, const Act& a, int64_t m, int64_t k0,
                       float* accrow) {
  static_assert(!kquant<F>(), "the K-quants run panel_folded");
  const int64_t n32 = a.K / 32;
  __m512 f = _mm512_loadu_ps(accrow);
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ib)), _mm512_set1_ps(a.dx[m * n32 + k0 / 32]));
  f = _mm512_fmadd_ps(_mm512_load_ps(rs.ws), t, f);
  if constexpr (Traits<F>::has_m)
    f = _mm512_fmadd_ps(_mm512_load_ps(rs.wm), _mm512_set1_ps(a.dxs32[m * n32 + k0 / 32]), f);
  _mm512_storeu_ps(accrow, f);
}

// The K-quants' activations for folded tile products: 256-blocks u0 .. u1-1 of xq8 (row-major, as
// quantise_rows<256>) -> A' = xq8 << sh (|A'| <= 127 * 8, exact in int16) as ah = A' >> 4
// (arithmetic) and al = A' & 15, so A' = 16 * ah + al, each a byte.  ah and al are tile-major:
// a 1 KiB block per 16 rows x 64 k (row r at byte 64 r), a row tile's blocks in k order, so a
// tile load reads one contiguous KiB.
void split(const int8_t* xq8, const int32_t* sh, int64_t K, int64_t u0, int64_t u1, int8_t* ah, uint8_t* al) {
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t m = u / (K / 256), b = u % (K / 256);
    for (int c = 0; c < 8; ++c) {
      const int64_t o = m * K + b * 256 + 32 * c, k = b * 256 + 32 * c;
      // tile-major: 16 rows x 64 k per 1 KiB block, blocks of a row tile in k order
      const int64_t t = ((m / 16) * (K / 64) + k / 64) * 1024 + (m % 16) * 64 + k % 64;
      const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq8 + o)));
      const __m512i a = _mm512_sllv_epi16(v, _mm512_set1_epi16(static_cast<int16_t>(sh[o / 32])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ah + t), _mm512_cvtepi16_epi8(_mm512_srai_epi16(a, 4)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(al + t),
                          _mm512_cvtepi16_epi8(_mm512_and_si512(a, _mm512_set1_epi16(15))));
    }
  }
}

// The K-quants on tiles with the scales folded in, one tile product per 64 k instead of one
// per sub-block: the record's C (the narrow routines' integer, see the header) is
// sum_k A'_k * W'_k with A' = xq8 << sh (per row and 32-block) and W' the weight code times its
// sub-block scale: Q4_K W' = sc_b * q_k in [0, 945]; Q6_K W' = sc_b * (q_k - 32) in
// [-4096, 4096] (its -32 * sc * S terms come along).  Neither side fits a byte, so both split:
// A' = 16 ah + al (ah in [-64, 63], al in [0, 15]), W' = 64 wh + wl (wl in [0, 63]; wh in
// [0, 14] for Q4_K, [-64, 64] for Q6_K), and four tile products summed over the record's 256 k,
//   C = (ah.wh << 10) + (al.wh << 6) + (ah.wl << 4) + al.wl,
// exact in int32 (|ah.wh| <= 256 * 64 * 64 = 2^20, so << 10 <= 2^30, and the four terms sum to
// less than 2^31 in magnitude).  Each row's epilogue is then the record's fp32 steps only (Q4_K's
// min term as in the narrow routine), no per-sub-block operations.  Q4_K's wh <= 14 leaves
// 16 wh a byte, so its first two terms are one tile's sum, ah.(16 wh) + al.wh = A'.wh, and
//   C = (A'.wh << 6) + (ah.wl << 4) + al.wl
// takes three product tiles (one store and two vector operations per row fewer).
// Tiles: Q6_K 0 ah, 1 al (16 rows x 64 k), 2 wh, 3 wl (16 k-steps x 64 bytes), 4-7 the products;
// Q4_K 0 ah, 1 al, 2 16 wh, 3 wh, 4 wl, 5-7 the products.
//   Where the time goes (Intel AMX host, 2 threads, Qwen 1.5B shapes): a tile product and vector
// work do not overlap here (16 products then 200 independent vector operations take the sum of
// their times, whichever ports the vector operations use), so the per-row epilogue and the
// decode add to the products' time; and the A tiles are read in 1 KiB blocks (split writes them
// tile-major) with each record's next one prefetched a line per k-step: against A read at a
// stride of K and the next record prefetched in one burst, 0.75-0.9x the time of a call.
template <int F>
void panel_folded(const uint8_t* p, int64_t nrec, const Act& a, int64_t M, float* acc) {
  static_assert(F == Q4_K || F == Q6_K, "the K-quants' activations are split");
  constexpr int rb = rec_bytes<F>(), spsub = Traits<F>::sb / 4;  // k-steps per sub-block
  configure(64);
  std::memset(acc, 0, sizeof(float) * M * NR);
  Rec<F, true> rs;
  alignas(64) uint8_t wh[64 * 64], wl[64 * 64], wh16[F == Q4_K ? 64 * 64 : 64];  // [k-step][16 outputs x 4 k]
  alignas(64) int32_t ib[4 * TM * NR];
  const int64_t K = a.K, tiles = (M + TM - 1) / TM;
  for (int64_t rec = 0; rec < nrec; ++rec) {
    const uint8_t* s = p + rec * rb;
    rs.load(s);
    const uint8_t* lo = s + Traits<F>::sbytes;
    const uint8_t* hi = lo + lo_bytes<F>();
    const __m512i m8 = _mm512_set1_epi16(0x00FF), m6 = _mm512_set1_epi16(63);
    for (int j = 0; j < 256 / Traits<F>::sb; ++j) {
      // sub-block j's scale of output o on both 16-bit halves of o's 4-byte lane (sign kept)
      const __m512i sc32 = _mm512_load_si512(rs.sc + j * NR);
      const __m512i sc = _mm512_or_si512(_mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(sc32, 16));
#pragma GCC unroll 8
      for (int t = spsub * j; t < spsub * (j + 1); ++t) {
        // the next record, a line per k-step (a burst of its ~40-50 lines stalled on the fill
        // buffers: ~10% of the time at 40 rows)
        if (64 * t < rb) _mm_prefetch(reinterpret_cast<const char*>(s + rb + 64 * t), _MM_HINT_T0);
        const __m512i q = avx512::decode<F>(lo, hi, t);  // codes, one byte each
        __m512i qe = _mm512_and_si512(q, m8), qo = _mm512_srli_epi16(q, 8);
        if constexpr (F == Q6_K) {
          qe = _mm512_sub_epi16(qe, _mm512_set1_epi16(32));
          qo = _mm512_sub_epi16(qo, _mm512_set1_epi16(32));
        }
        const __m512i we = _mm512_mullo_epi16(qe, sc), wo = _mm512_mullo_epi16(qo, sc);  // W', exact in int16
        _mm512_store_si512(wl + 64 * t, _mm512_or_si512(_mm512_and_si512(we, m6), _mm512_slli_epi16(_mm512_and_si512(wo, m6), 8)));
        const __m512i h = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(we, 6), m8), _mm512_slli_epi16(_mm512_srai_epi16(wo, 6), 8));
        _mm512_store_si512(wh + 64 * t, h);
        if constexpr (F == Q4_K) _mm512_store_si512(wh16 + 64 * t, _mm512_slli_epi16(h, 4));  // 16 wh <= 224: still a byte
      }
    }
    const int64_t k0 = rec * 256;
    for (int64_t ti = 0; ti < tiles; ++ti) {
      const int64_t r0 = ti * TM;
      auto load_a = [&](int c) {  // row tile ti's ah, al over the record's 64 k block c (1 KiB each)
        const int64_t blk = (ti * (K / 64) + k0 / 64 + c) * 1024;
        _tile_loadd(0, a.ah + blk, 64);
        _tile_loadd(1, a.al + blk, 64);
      };
      if constexpr (F == Q4_K) {  // tiles 0 ah, 1 al, 2 16 wh, 3 wh, 4 wl; 5 C1, 6 C2, 7 C3
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          load_a(c);
          _tile_loadd(2, wh16 + 16 * 64 * c, 64);
          _tile_loadd(3, wh + 16 * 64 * c, 64);
          _tile_loadd(4, wl + 16 * 64 * c, 64);
          _tile_dpbsud(5, 0, 2);
          _tile_dpbuud(5, 1, 3);
          _tile_dpbsud(6, 0, 4);
          _tile_dpbuud(7, 1, 4);
        }
        _tile_stored(5, ib, 64);
        _tile_stored(6, ib + TM * NR, 64);
        _tile_stored(7, ib + 2 * TM * NR, 64);
      } else {  // Q6_K: tiles 0 ah, 1 al, 2 wh (signed), 3 wl; 4-7 the four products
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          load_a(c);
          _tile_loadd(2, wh + 16 * 64 * c, 64);
          _tile_loadd(3, wl + 16 * 64 * c, 64);
          _tile_dpbssd(4, 0, 2);
          _tile_dpbusd(5, 1, 2);
          _tile_dpbsud(6, 0, 3);
          _tile_dpbuud(7, 1, 3);
        }
        _tile_stored(4, ib, 64);
        _tile_stored(5, ib + TM * NR, 64);
        _tile_stored(6, ib + 2 * TM * NR, 64);
        _tile_stored(7, ib + 3 * TM * NR, 64);
      }
      const int rows = static_cast<int>(std::min<int64_t>(TM, M - r0));
      for (int r = 0; r < rows; ++r) {
        const int64_t m = r0 + r;
        auto ld = [&](int i) { return _mm512_load_si512(ib + i * TM * NR + r * NR); };
        const __m512i cv = F == Q4_K ? _mm512_add_epi32(_mm512_slli_epi32(ld(0), 6), _mm512_add_epi32(_mm512_slli_epi32(ld(1), 4), ld(2)))
                                     : _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(ld(0), 10), _mm512_slli_epi32(ld(1), 6)),
                                                        _mm512_add_epi32(_mm512_slli_epi32(ld(2), 4), ld(3)));
        float* out = acc + m * NR;
        const __m512 dx = _mm512_set1_ps(a.dx8[m * (K / 256) + k0 / 256]);
        __m512 f = _mm512_fmadd_ps(_mm512_load_ps(rs.ws), _mm512_mul_ps(_mm512_cvtepi32_ps(cv), dx), _mm512_loadu_ps(out));
        if constexpr (F == Q4_K) {
          __m512i cm = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i)  // (vpdpwssd: madd + add in one, the same exact sums)
            cm = _mm512_dpwssd_epi32(cm, _mm512_load_si512(rs.mp + i * NR), _mm512_set1_epi32(a.tp[m * (K / 64) + k0 / 64 + i]));
          f = _mm512_fmadd_ps(_mm512_load_ps(rs.wm), _mm512_mul_ps(_mm512_cvtepi32_ps(cm), dx), f);
        }
        _mm512_storeu_ps(out, f);
      }
    }
  }
}

// A 32-k format's panel (16 outputs) for all M rows, as ::panel; the activations hold whole
// 16-row tiles (qlinear pads xq to a multiple of 16 rows).
template <int F>
void panel(const uint8_t* p, int64_t nrec, const Act& a, int64_t M, float* acc) {
  static_assert(!kquant<F>(), "the K-quants run panel_folded");
  constexpr int rb = rec_bytes<F>(), rk = Traits<F>::rk;  // one 32-k sub-block per record
  constexpr int G = 4;  // row tiles per pass: 4 tile products in flight
  configure(rk);
  std::memset(acc, 0, sizeof(float) * M * NR);
  Rec<F, true> rs;
  alignas(64) uint8_t codes[rk / 4 * 64];
  alignas(64) int32_t ib[G * TM * NR];
  const int64_t K = a.K, tiles = (M + TM - 1) / TM;
  for (int64_t rec = 0; rec < nrec; ++rec) {
    const uint8_t* s = p + rec * rb;
    for (int off = 0; off < rb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(s + rb + off), _MM_HINT_T0);
    rs.load(s);
    const uint8_t* lo = s + Traits<F>::sbytes;
    const uint8_t* bsrc = lo;  // Q8_0: the low plane is already the B layout (signed codes)
    if constexpr (F != Q8_0) {
      const uint8_t* hi = lo + lo_bytes<F>();
#pragma GCC unroll 8
      for (int t = 0; t < rk / 4; ++t) _mm512_store_si512(codes + 64 * t, avx512::decode<F>(lo, hi, t));
      bsrc = codes;
    }
    const int64_t k0 = rec * rk;
    for (int64_t t0 = 0; t0 < tiles; t0 += G) {
      const int g = static_cast<int>(std::min<int64_t>(G, tiles - t0));
      // job i: row tile t0 + i; its sums go to ib + i * TM * NR
#define SPECDEC_AMX_JOB(TA, TB, TC, I)                                       \
  do {                                                                       \
    _tile_zero(TC);                                                          \
    _tile_loadd(TA, a.xq + (t0 + (I)) * TM * K + k0, K);                     \
    _tile_loadd(TB, bsrc, 64);                                               \
    if constexpr (F == Q8_0) _tile_dpbssd(TC, TA, TB); else _tile_dpbsud(TC, TA, TB); \
    _tile_stored(TC, ib + (I) * TM * NR, 64);                                \
  } while (0)
      int i = 0;
      for (; i + 4 <= g; i += 4) {
        SPECDEC_AMX_JOB(0, 2, 4, i);
        SPECDEC_AMX_JOB(1, 3, 5, i + 1);
        SPECDEC_AMX_JOB(0, 2, 6, i + 2);
        SPECDEC_AMX_JOB(1, 3, 7, i + 3);
      }
      for (; i < g; ++i) SPECDEC_AMX_JOB(0, 2, 4, i);
#undef SPECDEC_AMX_JOB
      for (int gi = 0; gi < g; ++gi)
        for (int r = 0; r < TM; ++r) {
          const int64_t m = (t0 + gi) * TM + r;
          if (m >= M) break;
          finish_row<F>(ib + (gi * TM + r) * NR, rs, a, m, k0, acc + m * NR);
        }
    }
  }
}

}  // namespace amx
#pragma GCC pop_options


// ============================ Panels: one routine over a panel's records ====
// One panel (16 outputs) for all M rows: acc [M][16] = the panel's sums.
// Rows: the ISA's record routine for groups of <= MR rows.
// Row group g of the record at lo, hi (Pre: lo = its decoded codes).
template <int F, template <int, int> class Rows, int MR, bool Pre>
inline void run_group(const uint8_t* lo, const uint8_t* hi, const Act& a, int64_t g, int64_t k0,
                      const Rec<F, Rows<F, 1>::wide>& rs, float* acc, const uint8_t* pf) {
  const int64_t m0 = a.grp[g], r = a.grp[g + 1] - m0;
  switch (r) {
    case 1: Rows<F, 1>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 2: Rows<F, 2>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 3: Rows<F, 3>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 4: Rows<F, 4>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 5: Rows<F, 5>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 6: Rows<F, MR >= 6 ? 6 : 1>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    case 7: Rows<F, MR >= 7 ? 7 : 1>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
    default: Rows<F, MR >= 8 ? 8 : 1>::template run<Pre>(lo, hi, a, m0, k0, rs, acc, pf); break;
  }
}

// AVX-512, several row groups (M > 8): each record's codes are decoded once into `codes` (64
// bytes per k-step, the vectors the routine would decode) and every group reads them, instead of
// each group decoding them again.  The same vectors, so the same sums and bits.
template <int F, template <int, int> class Rows, int MR>
void panel(const uint8_t* p, int64_t nrec, const Act& a, int64_t M, float* acc) {
  constexpr int rb = rec_bytes<F>();
  std::memset(acc, 0, sizeof(float) * M * NR);
  Rec<F, Rows<F, 1>::wide> rs;
  alignas(64) uint8_t codes[Rows<F, 1>::wide ? Traits<F>::rk / 4 * 64 : 64];
  const bool pre = Rows<F, 1>::wide && a.ng > 1;
  for (int64_t rec = 0; rec < nrec; ++rec) {
    const uint8_t* s = p + rec * rb;
    // One sequential stream per thread, prefetched (past the end is harmless).  The K-quant
    // routines spread their prefetches over the record, a few lines per 32-block (AVX2, 4 KiB
    // ahead) or sub-block (AVX-512, 6 KiB ahead).  The 32-k formats fetch the record 8 KiB
    // ahead in one burst here.  (AVX-512 Q4_K used to leave its single plane to the hardware
    // prefetcher: on Zen 5 that streamed 24 GB/s against AVX2's 41 at M = 1, and Qwen 1.5B's
    // forward(1) took 1.4x as long as with a 4 KiB burst; spread 6 KiB ahead vs the burst, one
    // process, 21 repeats: T = 1 0.97x, T = 5 0.92x.)
    if constexpr (!kquant<F>())
      for (int off = 0; off < rb; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(s + 8192 + off), _MM_HINT_T0);
    rs.load(s);
    const uint8_t* lo = s + Traits<F>::sbytes;
    const uint8_t* hi = lo + lo_bytes<F>();
    const int64_t k0 = rec * Traits<F>::rk;
    if constexpr (Rows<F, 1>::wide) {
      if (pre) {
        avx512::decode_record<F>(lo, hi, codes);
        for (int64_t g = 0; g < a.ng; ++g)
          run_group<F, Rows, MR, true>(codes, nullptr, a, g, k0, rs, acc, g == 0 ? s + Rows<F, 1>::pf_ahead : nullptr);
        continue;
      }
    }
    for (int64_t g = 0; g < a.ng; ++g)  // the first group prefetches
      run_group<F, Rows, MR, false>(lo, hi, a, g, k0, rs, acc, g == 0 ? s + Rows<F, 1>::pf_ahead : nullptr);
  }
}

using PanelFn = void (*)(const uint8_t*, int64_t, const Act&, int64_t, float*);

constexpr int kMrAvx2 = 5, kMrAvx512 = 8, kMrWide = 12;  // rows per group (register budget of each routine)

// The ISAs a call can run on (the isa argument): 2 AVX2, 512 AVX-512 VNNI, 1024 AMX int8 tiles.
constexpr int64_t kAvx2 = 2, kAvx512 = 512, kAmx = 1024;
// Rows from which isa = 0 (auto) runs a format on AMX where the CPU has it (the same bits
// either way).  Below them AVX-512 VNNI is as fast or faster: AMX decodes each record into tile
// layout whatever the rows (measured on the Intel AMX host, 2 threads, Qwen 1.5B and SmolLM2
// shapes, both ISAs in one process: AMX / VNNI time at 16 rows Q4_K 0.95, Q6_K 0.87, Q8_0 0.82,
// Q5_0 0.89; Q4_1 1.17 at 16 and 0.46 at 40).
int64_t amx_min_rows(int64_t fmt) { return fmt == Q4_0 || fmt == Q4_1 ? 32 : 16; }

template <int F>
PanelFn panel_for(int64_t isa) {
  if (isa == kAmx) {
    if constexpr (F == Q4_K || F == Q6_K) return &amx::panel_folded<F>;
    else return &amx::panel<F>;
  }
  return isa == kAvx512 ? &panel<F, avx512::Rows, kMrAvx512> : &panel<F, Avx2Rows, kMrAvx2>;
}

PanelFn panel_fn(int64_t fmt, int64_t isa) {
  switch (fmt) {
    case Q8_0: return panel_for<Q8_0>(isa);
    case Q4_0: return panel_for<Q4_0>(isa);
    case Q4_1: return panel_for<Q4_1>(isa);
    case Q5_0: return panel_for<Q5_0>(isa);
    case Q4_K: return panel_for<Q4_K>(isa);
    case Q6_K: return panel_for<Q6_K>(isa);
    case Q6_K2: TORCH_CHECK(isa == kAvx2, "Q6_K2 has only an AVX2 routine"); return &panel<Q6_K2, Avx2Rows, kMrAvx2>;
    default: TORCH_CHECK(false, "unknown quant format ", fmt);
  }
}

// ============================ CPU dispatch and record sizes =================
bool cpu_has_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

// AMX int8 tiles: the CPU has them (CPUID.7.0:EDX bits 24, 25) and the kernel grants this
// process the tile state (Linux asks for it once per process: arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA; without it the first tile instruction faults).
bool cpu_has_amx() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx512_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The fastest ISA this CPU has: 1024 (AMX, for calls of kAmxMinRows rows and more; AVX-512
// VNNI below), 512 (AVX-512 VNNI) or 2 (AVX2).
int64_t best_isa() { return cpu_has_amx() ? kAmx : cpu_has_avx512_vnni() ? kAvx512 : kAvx2; }

// Every ISA the kernel can run here (tests compare them all).
std::vector<int64_t> isas() {
  std::vector<int64_t> v{kAvx2};
  if (cpu_has_avx512_vnni()) v.push_back(kAvx512);
  if (cpu_has_amx()) v.push_back(kAmx);
  return v;
}

int64_t record_bytes(int64_t fmt) {
  switch (fmt) {
    case Q8_0: return rec_bytes<Q8_0>();
    case Q4_0: return rec_bytes<Q4_0>();
    case Q4_1: return rec_bytes<Q4_1>();
    case Q5_0: return rec_bytes<Q5_0>();
    case Q4_K: return rec_bytes<Q4_K>();
    case Q6_K: return rec_bytes<Q6_K>();
    case Q6_K2: return rec_bytes<Q6_K2>();
    default: TORCH_CHECK(false, "unknown quant format ", fmt);
  }
}

int64_t record_k(int64_t fmt) { return fmt == Q4_K || fmt == Q6_K || fmt == Q6_K2 ? 256 : 32; }

// x [M, K] fp32 -> int8 blocks.  B = 32: d = amax / 127, xq = round_half_even(x * (127 / amax)),
// filling xq, dx, s32, dxs32.  B = 256: d = amax / 127 over the 256, and per 32-block the largest
// e <= XE with amax32 * 2^e <= amax: xq = round_half_even(x * ((127 / amax) * 2^e)) (exact
// power-of-two scalings), filling xq, dx = d * 2^-XE [M, K/256], sh = XE - e and sp16 [M, K/32], cq [M, K/16],
// tp [M, K/64].  quant.py's torch fallback does the same fp32 operations (same bits): max
// is exact in any order, and cvtps_epi32 rounds in the current mode (nearest-even), as
// nearbyint does.
constexpr float kTiny = 7.888609052210118e-31f;  // 2^-100

// ============================ Activation quantisation =======================
// Blocks u0 .. u1-1 of the M * (K / B) (row-major: block u is row u / (K / B)); each block's
// outputs depend on its own 32 or 256 inputs only, so threads may split the blocks freely.
template <int B>
void quantise_rows(const float* x, int64_t K, int64_t u0, int64_t u1, int8_t* xq, float* dx, int32_t* s32,
                   float* dxs32, int32_t* sh, int32_t* sp16, int32_t* tp, int32_t* cq) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane interleave
  auto hmax = [](__m256 mx) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
  };
  auto pair = [](int32_t lo, int32_t hi) {
    return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
  };
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t m = u / (K / B), b = u % (K / B);
    const float* v = x + m * K + b * B;
    float a32[B / 32];
    int32_t T[B / 32];
    for (int c = 0; c < B / 32; ++c) {
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 32; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + 32 * c + i), absmask));
      a32[c] = hmax(mx);
    }
    float amax = a32[0];
    for (int c = 1; c < B / 32; ++c) amax = std::max(amax, a32[c]);
    // A block below 2^-100 (~8e-31) is all zeros: its reciprocal times 2^XE could overflow,
    // and d * 2^-XE would be subnormal (inexact).  quant.py does the same.
    if (!(amax >= kTiny)) amax = 0.f;
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    for (int c = 0; c < B / 32; ++c) {
      int e = 0;
      if constexpr (B == 256)
        while (e < XE && a32[c] * static_cast<float>(2 << e) <= amax) ++e;
      const __m256 idv = _mm256_set1_ps(id * static_cast<float>(1 << e));
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * c + 8 * i), idv));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + b * B + 32 * c), bytes);
      int s[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i t = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        if constexpr (B == 256) {  // lanes k = 0, 1 and 2, 3 mod 4 of this 16-k half
          const __m128i ab = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
          cq[(m * K + b * B) / 16 + 2 * c + h] = pair(32 * _mm_cvtsi128_si32(ab), 32 * _mm_extract_epi32(ab, 2));
        }
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
        s[h] = _mm_cvtsi128_si32(u);
      }
      const int64_t i32 = (m * K + b * B) / 32 + c;
      if constexpr (B == 32) {
        s32[i32] = s[0] + s[1];
        dxs32[i32] = d * static_cast<float>(s[0] + s[1]);
      } else {
        sh[i32] = XE - e;
        T[c] = (s[0] + s[1]) * (1 << (XE - e));
        sp16[i32] = pair(s[0], s[1]);
      }
    }
    dx[m * (K / B) + b] = B == 32 ? d : d * (1.f / (1 << XE));
    if constexpr (B == 256)
      for (int i = 0; i < 4; ++i) tp[(m * K + b * B) / 64 + i] = pair(T[2 * i], T[2 * i + 1]);
  }
}

// ============================ Entry point: qlinear (threads, chunks) ========
// Rows per pass over the weights.  Every panel reads all of a pass's int8 activations, so a
// pass's rows are kept to what stays in L2 beside the weights (~256 KiB of int8 at most,
// whole 16-row tiles, at least 64 rows): past that each panel streams the activations from L3.
int64_t row_block(int64_t M, int64_t K) {
  static const int64_t budget = [] {
    const char* e = std::getenv("SPECDEC_ROW_BLOCK_BYTES");
    return e != nullptr ? std::max<int64_t>(1, std::atoll(e)) : int64_t{1} << 18;
  }();
  const int64_t mb = std::max<int64_t>(64, budget / K / 16 * 16);
  return std::min(M, mb);
}

// A buffer of the calling thread, reused across calls: grown when a call needs more, never
// zeroed (every element a call reads, it wrote first; the pad rows of a 16-row tile are computed
// and never read).  Fresh vectors per call zero-filled and page-faulted ~14 MB for a 512-row
// Qwen 1.5B ffn_down call (the activations thrice, int8), ~3% of a 512-token prefill.  A buffer
// past 64 MB (prompts of thousands of tokens in one call) is the call's own and freed after it.
template <typename T>
class Scratch {
 public:
  T* get(size_t n) {
    if (n == 0) return nullptr;
    if (n > cap_) {
      p_.reset(new T[n]);  // default-initialised: not zeroed
      cap_ = n;
    }
    return p_.get();
  }
  void trim() {  // after the call: drop a buffer too large to keep
    if (cap_ * sizeof(T) > (size_t{64} << 20)) p_.reset(), cap_ = 0;
  }

 private:
  std::unique_ptr<T[]> p_;
  size_t cap_ = 0;
};

// out[..., sum(ns)] = x[..., K] @ [W_0; W_1; ...]^T (+ bias): the segments are
// row blocks of one fused weight (e.g. q, k, v), each in its own format.
torch::Tensor qlinear(const torch::Tensor& x_in, const std::vector<torch::Tensor>& packed,
                      const std::vector<int64_t>& fmts, const std::vector<int64_t>& ns,
                      const c10::optional<torch::Tensor>& bias, int64_t nthreads, int64_t isa) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 && x_in.dim() >= 1,
              "x must be a fp32 CPU tensor [..., K]");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(K > 0 && K % 32 == 0, "K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(packed.size() == fmts.size() && packed.size() == ns.size() && !packed.empty(),
              "one format and size per segment");
  const int64_t M = x_in.numel() / K;
  TORCH_CHECK(isa == 0 || isa == kAvx2 || (isa == kAvx512 && cpu_has_avx512_vnni()) || (isa == kAmx && cpu_has_amx()),
              "isa must be 0 (auto), 2 (AVX2), 512 (AVX-512 VNNI) or 1024 (AMX), one the CPU has");
  // auto: each segment its fastest ISA for M rows (AMX or the call's vector ISA)
  const bool auto_isa = isa == 0;
  if (auto_isa) isa = cpu_has_avx512_vnni() ? kAvx512 : kAvx2;
  // Q6_K2 records have only an AVX2 routine: a call holding one runs on AVX2 (the same bits)
  if (std::find(fmts.begin(), fmts.end(), int64_t{Q6_K2}) != fmts.end()) isa = kAvx2;
  thread_local std::vector<int64_t> seg_isa;
  seg_isa.clear();
  for (int64_t f : fmts)
    seg_isa.push_back(auto_isa && isa == kAvx512 && cpu_has_amx() && M >= amx_min_rows(f) ? kAmx : isa);
  const bool tiles = std::find(seg_isa.begin(), seg_isa.end(), kAmx) != seg_isa.end();
  // A call of more than 8 rows of K-quants on AVX-512 runs the wide routine (avx512::panel_wide;
  // the same bits as the narrow one, groups of up to 12 rows).
  const bool wide = M > kMrAvx512 && !tiles && std::all_of(seg_isa.begin(), seg_isa.end(), [](int64_t i) { return i == kAvx512; }) &&
                    std::all_of(fmts.begin(), fmts.end(), [](int64_t f) { return f == Q4_K || f == Q6_K; });
  std::vector<PanelFn> fns;
  std::vector<int64_t> nrec, off{0}, pstart{0};
  for (size_t i = 0; i < packed.size(); ++i) {
    const auto& t = packed[i];
    const int64_t P = (ns[i] + NR - 1) / NR, nr = K / record_k(fmts[i]);
    TORCH_CHECK(K % record_k(fmts[i]) == 0, "segment ", i, ": K = ", K, " is not a multiple of ",
                record_k(fmts[i]));
    TORCH_CHECK(t.scalar_type() == torch::kUInt8 && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == P && t.size(1) == nr && t.size(2) == record_bytes(fmts[i]),
                "segment ", i, ": packed weight must be uint8 [", P, ", ", nr, ", ",
                record_bytes(fmts[i]), "]");
    fns.push_back(wide ? (fmts[i] == Q4_K ? &avx512::panel_wide<Q4_K> : &avx512::panel_wide<Q6_K>)
                       : panel_fn(fmts[i], seg_isa[i]));
    nrec.push_back(nr);
    off.push_back(off.back() + ns[i]);
    pstart.push_back(pstart.back() + P);
  }
  const int64_t N = off.back(), panels = pstart.back();
  const torch::Tensor x = x_in.contiguous();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N, "bias must be fp32 [N]");
    b = bias->contiguous();
    bp = b.data_ptr<float>();
  }
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  if (M == 0) return out;
  bool need32 = false, need256 = false;
  for (int64_t f : fmts) (record_k(f) == 256 ? need256 : need32) = true;
  // AMX loads whole 16-row tiles: the int8 rows are padded to a multiple of 16 (zeros, unused)
  const int64_t Mp = tiles ? (M + amx::TM - 1) / amx::TM * amx::TM : M;
  const int64_t n32 = M * K / 32;
  bool split = false;  // a K-quant segment on AMX: its activations split for the folded products
  for (size_t i = 0; i < fmts.size(); ++i) split |= (fmts[i] == Q4_K || fmts[i] == Q6_K) && seg_isa[i] == kAmx;
  thread_local Scratch<int8_t> b_xq, b_xq8, b_ah;
  thread_local Scratch<uint8_t> b_al;
  thread_local Scratch<int32_t> b_s32, b_sh, b_sp16, b_tp, b_cq;
  thread_local Scratch<float> b_dx, b_dxs32, b_dx8;
  int8_t* const xq = b_xq.get(need32 ? Mp * K : 0);
  int8_t* const xq8 = b_xq8.get(need256 ? Mp * K : 0);
  int32_t* const s32 = b_s32.get(need32 ? n32 : 0);
  int32_t* const sh = b_sh.get(need256 ? n32 : 0);
  int32_t* const sp16 = b_sp16.get(need256 ? n32 : 0);
  int32_t* const tp = b_tp.get(need256 ? n32 / 2 : 0);
  int32_t* const cq = b_cq.get(need256 ? 2 * n32 : 0);
  thread_local Scratch<int8_t> b_xw;
  thread_local Scratch<int32_t> b_shw, b_nsw;
  thread_local std::vector<int64_t> gs, gn;  // wide: each row's group (first row, rows)
  const int64_t* gsp = nullptr;  // (the parallel region must use plain pointers, see below)
  const int64_t* gnp = nullptr;
  int8_t* const xw = b_xw.get(wide ? M * K : 0);
  int32_t* const shw = b_shw.get(wide ? n32 : 0);
  int32_t* const nsw = b_nsw.get(wide ? n32 : 0);
  float* const dx = b_dx.get(need32 ? n32 : 0);
  float* const dxs32 = b_dxs32.get(need32 ? n32 : 0);
  float* const dx8 = b_dx8.get(need256 ? M * K / 256 : 0);
  int8_t* const ah = b_ah.get(split ? Mp * K : 0);
  uint8_t* const al = b_al.get(split ? Mp * K : 0);
  // Thread t of nth quantises its share of the blocks of each size the call needs.
  const float* xp = x.data_ptr<float>();
  auto quantise = [&](int64_t t, int64_t nth) {
    if (need32) {
      const int64_t nb = M * K / 32;
      quantise_rows<32>(xp, K, nb * t / nth, nb * (t + 1) / nth, xq, dx, s32, dxs32,
                        nullptr, nullptr, nullptr, nullptr);
    }
    if (need256) {
      const int64_t nb = M * K / 256;
      quantise_rows<256>(xp, K, nb * t / nth, nb * (t + 1) / nth, xq8, dx8, nullptr, nullptr,
                         sh, sp16, tp, cq);
      if (split) amx::split(xq8, sh, K, nb * t / nth, nb * (t + 1) / nth, ah, al);
      if (wide) avx512::wide_pack(xq8, sh, sp16, K, nb * t / nth, nb * (t + 1) / nth, gsp, gnp, xw, shw, nsw);
    }
  };
  // Row blocks of MB rows, each a pass over all panels (see row_block); per block, groups of <= MR
  // rows for the narrow routines.  Neither the blocks nor the groups change a row's bits.
  const int64_t MB = row_block(M, K), nblk = (M + MB - 1) / MB;
  const int64_t MR = isa == kAvx2 ? kMrAvx2 : wide ? kMrWide : kMrAvx512;
  // (The per-block bookkeeping lives in buffers this thread reuses across calls: allocating it
  // per call cost ~1.5% of a SmolLM2 decode step, ~1 us a call.)
  // The parallel region below must use the plain pointers (a thread_local name there is each
  // worker's own, empty instance).
  thread_local std::vector<int64_t> grp;  // the blocks' groups, one after the other
  thread_local std::vector<Act> act_buf;
  thread_local std::unique_ptr<std::atomic<int64_t>[]> next_buf;  // per block: the next panel to take
  thread_local int64_t next_cap = 0;
  grp.clear();
  act_buf.clear();
  if (wide) gs.resize(M), gn.resize(M), gsp = gs.data(), gnp = gn.data();
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t mb = std::min(MB, M - bi * MB), ng = (mb + MR - 1) / MR;
    for (int64_t g = 0; g <= ng; ++g) grp.push_back(g * mb / ng);
  }
  auto at = [](auto* p, int64_t o) { return p == nullptr ? p : p + o; };
  for (int64_t bi = 0, gi = 0; bi < nblk; ++bi) {
    const int64_t m0 = bi * MB, mb = std::min(MB, M - m0), ng = (mb + MR - 1) / MR;
    act_buf.push_back(Act{K, at(xq, m0 * K), at(s32, m0 * (K / 32)), at(dx, m0 * (K / 32)),
                       at(dxs32, m0 * (K / 32)), at(xq8, m0 * K), at(dx8, m0 * (K / 256)),
                       at(sh, m0 * (K / 32)), at(sp16, m0 * (K / 32)), at(tp, m0 * (K / 64)),
                       at(cq, m0 * (K / 16)), at(ah, m0 * K), at(al, m0 * K), grp.data() + gi, ng,
                       at(xw, m0 * K), at(shw, m0 * (K / 32)), at(nsw, m0 * (K / 32))});
    if (wide) {
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t m = grp[gi + g]; m < grp[gi + g + 1]; ++m) gs[m0 + m] = m0 + grp[gi + g], gn[m0 + m] = grp[gi + g + 1] - grp[gi + g];
    }
    gi += ng + 1;
  }
  if (nblk > next_cap) {
    next_buf.reset(new std::atomic<int64_t>[nblk]);
    next_cap = nblk;
  }
  const Act* acts = act_buf.data();
  std::atomic<int64_t>* next = next_buf.get();
  float* op = out.data_ptr<float>();
  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
  int64_t bytes = 0;
  for (size_t i = 0; i < packed.size(); ++i) bytes += packed[i].numel();
  // Shrinking chunks of contiguous panels, taken from a shared counter: each take is
  // 1 / (4 nt) of the panels left (at least one panel), so a thread streams long runs at
  // first, a thread on a core slowed by other load takes fewer of them, and the last
  // takes are single panels: the threads finish within about one panel of each other.
  // (Fixed chunks of panels / (8 nt) left a thread idle for up to a chunk at the end of
  // each call, ~75 us of a 1.2 ms Qwen 1.5B gate_up call at M = 5.)  A weight under
  // 1 MiB is split statically: its chunks are a few panels each, and handing them out cost
  // more than it saved (SmolLM2-135M forward(1), one-process A/B of the two builds: 0.935x
  // the time with every matmul static).  Which thread computes a panel never changes its bits.
  const bool dyn = bytes >= (1 << 20);
  // The activations are quantised inside the parallel region, split over the threads, from
  // 8192 elements (~3 us on one thread; a Qwen 1.5B ffn_down input at M = 5 is 44800, ~16
  // us), then a barrier; below that the first thread does them alone before the region.
  const bool par_q = nt > 1 && M * K >= 8192;
  if (!par_q) quantise(0, 1);
  for (int64_t bi = 0; bi < nblk; ++bi) next[bi] = 0;
#pragma omp parallel num_threads(nt)
  {
    if (par_q) {
      quantise(omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
    }
    std::vector<float> acc(std::min(M, MB) * NR);
    size_t seg = 0;
    int64_t bi = 0;  // the row block the loops below work on
    auto one = [&](int64_t gp) {
      while (gp >= pstart[seg + 1]) ++seg;
      while (gp < pstart[seg]) --seg;
      const int64_t p = gp - pstart[seg], m0 = bi * MB, mb = std::min(MB, M - m0);
      const auto* base = packed[seg].data_ptr<uint8_t>();
      fns[seg](base + p * nrec[seg] * record_bytes(fmts[seg]), nrec[seg], acts[bi], mb, acc.data());
      const int64_t n0 = off[seg] + p * NR;
      const int nv = static_cast<int>(std::min<int64_t>(NR, off[seg + 1] - n0));
      for (int64_t m = 0; m < mb; ++m) {
        const float* s = acc.data() + m * NR;
        float* o = op + (m0 + m) * N + n0;
        if (bp) {
          for (int j = 0; j < nv; ++j) o[j] = s[j] + bp[n0 + j];
        } else {
          std::memcpy(o, s, sizeof(float) * nv);
        }
      }
    };
    for (bi = 0; bi < nblk; ++bi) {  // a thread done with its share of a block starts the next
      if (dyn) {
        const int64_t div = 4 * static_cast<int64_t>(omp_get_num_threads());
        std::atomic<int64_t>& nx = next[bi];
        int64_t p0 = nx.load(std::memory_order_relaxed);
        while (p0 < panels) {
          const int64_t c = std::max<int64_t>(1, (panels - p0) / div);
          if (!nx.compare_exchange_weak(p0, p0 + c, std::memory_order_relaxed)) continue;  // p0 reloaded
          for (int64_t gp = p0; gp < p0 + c; ++gp) one(gp);  // c <= panels - p0
          p0 = nx.load(std::memory_order_relaxed);
        }
      } else {
#pragma omp for schedule(static)
        for (int64_t gp = 0; gp < panels; ++gp) one(gp);
      }
    }
    if (tiles) amx::release();
  }
  b_xq.trim(), b_xq8.trim(), b_ah.trim(), b_al.trim(), b_cq.trim(), b_xw.trim();  // (the rest are 1/16 of these or less)
  return out;
}

std::vector<int64_t> layout(int64_t fmt) { return {record_k(fmt), record_bytes(fmt)}; }

}  // namespace

// ============================ Python binding ================================
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specdec few-row linear on GGUF-quantised weights (AVX2, int8 activations)";
  m.def("qlinear", &qlinear, "out = x @ [W_0; W_1; ...]^T (+ bias), W quantised and repacked",
        py::arg("x"), py::arg("packed"), py::arg("fmts"), py::arg("ns"), py::arg("bias"),
        py::arg("nthreads"), py::arg("isa") = 0);
  m.def("best_isa", &best_isa, "the fastest ISA here: 1024 (AMX, for many rows), 512 (AVX-512 VNNI) or 2 (AVX2)");
  m.def("isas", &isas, "every ISA the kernel can run on this CPU");
  m.def("layout", &layout, "(k per record, bytes per panel record) of a format");
}
