// Weight-streaming matmul for a few rows: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Decoding is memory-bound: every weight is read once per forward pass and
// used for only M (1..16) multiply-adds.  BLAS switches from gemv to a GEMM
// path at M >= 2 and the cost jumps; here each weight is loaded from memory
// once, kept in registers/L1, and applied to all M rows, so the cost of M rows
// stays close to the cost of one row until the FMA units become the limit.
//
// Layout (done by prepare_weight in __init__.py, not here):
//   W is padded with zero rows to a multiple of KS = 32 output features and
//   packed as units [N / 32][K][2][16]: a unit is two 16-feature panels, and
//   one k-step of a unit (both panels) is 32 contiguous weights (fp32: 128 B,
//   bf16: 64 B), so each thread reads a single sequential stream.
//   bf16 is stored as uint16 with each panel's 16 lanes interleaved
//   (element 2j = feature j, element 2j+1 = feature 8+j), so that one 32-bit
//   lane holds two bf16 values and widening is one shift + one AND, no shuffles.
//
// Work split: threads take contiguous runs of units (OpenMP dynamic schedule, ~8 runs per thread);
// for each unit, K is walked in chunks of KC, and inside a chunk every row
// group runs a register tile (accumulators in registers, weights
// broadcast-multiplied against x[m, k]).  Only the first row group streams
// (and prefetches) the chunk from memory; later groups find it in L1/L2.
//
// Two tile implementations over the same layout: AVX2+FMA (the baseline the
// build flags require) and AVX-512 (compiled via a target pragma and used only
// when the CPU reports it at runtime: twice the FMA width keeps M ~ 5..16
// closer to memory-bound).  Both compute exactly the same FMA chains.
//
// Batch invariance: every output element is an FMA chain over k = 0..K-1 in
// order, starting from 0.0f, then "+ bias".  Neither the row grouping (which
// depends on M), the K-chunking (accumulators are stored/reloaded exactly),
// the thread split (threads own whole panels; K is never split) nor the ISA
// changes that order, so row m of an M-row call is bit-identical to the same
// row computed alone, with any thread count, on either code path.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int NR = 16;   // output features per panel (one zmm / two ymm);
                         // must match NR in __init__.py
constexpr int UNIT = 2;  // panels per unit of thread work, interleaved per k-step
constexpr int KS = UNIT * NR;  // weights per k-step of a unit
// k-chunk: the unit's chunk (<= 2 * 256 * 64 B = 32 KiB fp32) plus the x chunk
// (<= 16 * 256 * 4 B = 16 KiB) stay in L1/L2 while every row group reuses them.
constexpr int KC = 256;

// Software prefetch of one k-step of a unit (fp32: 2 lines, bf16: 1 line),
// `ahead` bytes ahead of the k-step being used; one stream per thread.
// Measured on the dev box (1 and 2 threads): 8 KiB (fp32) / 12 KiB (bf16)
// ahead is 5-25% faster than 2-4 KiB, and than the hardware prefetcher alone,
// most of all at M >= 5, when the core is also busy with FMAs.
// `unit` must point at the unit's first panel.
template <class T>
inline void prefetch_kstep(const T* unit, int k) {
  constexpr int ahead = sizeof(T) == 4 ? 8192 : 12288;
  const char* p = reinterpret_cast<const char*>(unit + static_cast<int64_t>(k) * KS) + ahead;
#pragma GCC unroll 2
  for (int off = 0; off < KS * static_cast<int>(sizeof(T)); off += 64)
    _mm_prefetch(p + off, _MM_HINT_T0);
}

// Arguments of one register tile over `kc` k-steps of the unit's panels.
//   wp:  the unit, offset to the chunk start; panel q is at wp + q * wps and
//        k-steps are KS elements apart
//   x:   first row of the tile, offset to the chunk start; row stride ldx
//   acc: [np][M][NR] running sums of the unit, offset to the tile's first row;
//        panel q's rows at acc + q * accs.  Loaded, updated and stored back
//        around each chunk (exact in fp32, so chunking changes no result).
template <class T>
struct TileArgs {
  const T* wp;
  int64_t wps;
  const float* x;
  int64_t ldx;
  int kc;
  float* acc;
  int64_t accs;

  TileArgs rows_from(int64_t m0) const {  // the same tile, starting at row m0
    return {wp, wps, x + m0 * ldx, ldx, kc, acc + m0 * NR, accs};
  }
  TileArgs panel(int q) const {  // panel q of the unit alone
    return {wp + q * wps, wps, x, ldx, kc, acc + q * accs, accs};
  }
};

// Splits M rows into near-equal groups of <= mr and calls tile(r, args, first)
// per group.  Near-equal (16 -> 6+5+5, not 6+6+4; 7 -> 4+3, not 6+1) because
// a lone small group is FMA-latency-bound.  Grouping never changes a row's
// accumulation order, only which registers it lives in.
template <class T, class F>
inline void for_row_groups(int64_t M, int mr, const TileArgs<T>& a, F tile) {
  const int64_t ng = (M + mr - 1) / mr;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t m0 = g * M / ng, m1 = (g + 1) * M / ng;
    tile(static_cast<int>(m1 - m0), a.rows_from(m0), g == 0);
  }
}

// ============================ AVX2 + FMA ====================================
namespace avx2 {

struct F32 {
  using T = float;
  static inline void load(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
};

struct BF16 {
  using T = uint16_t;
  static inline void load(const uint16_t* p, __m256& lo, __m256& hi) {
    // 32-bit lane j = feature j (low half) | feature 8+j (high half).
    // bf16 -> fp32 is "put the 16 bits on top": low half << 16, high half
    // with the low bits masked off.  Two ALU ops, no shuffles.
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(
        _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// R rows x NP panels (2 ymm each).  Register budget (16 ymm): R*NP*2
// accumulators + 2 weights + 1 broadcast (+ bf16 temp), so R*NP <= 6.
template <int R, int NP, class W, bool PF>
inline void tile(const TileArgs<typename W::T>& a) {
  __m256 c[R][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      c[r][q][0] = _mm256_loadu_ps(a.acc + q * a.accs + r * NR);
      c[r][q][1] = _mm256_loadu_ps(a.acc + q * a.accs + r * NR + 8);
    }
  for (int k = 0; k < a.kc; ++k) {
    if (PF) prefetch_kstep(a.wp, k);  // the whole unit, also for an NP = 1 pass
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      const typename W::T* wk = a.wp + q * a.wps + static_cast<int64_t>(k) * KS;
      __m256 w0, w1;
      W::load(wk, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(a.x + r * a.ldx + k);
        c[r][q][0] = _mm256_fmadd_ps(b, w0, c[r][q][0]);
        c[r][q][1] = _mm256_fmadd_ps(b, w1, c[r][q][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      _mm256_storeu_ps(a.acc + q * a.accs + r * NR, c[r][q][0]);
      _mm256_storeu_ps(a.acc + q * a.accs + r * NR + 8, c[r][q][1]);
    }
}

template <class W, bool PF>
void tile_rows(int r, const TileArgs<typename W::T>& a) {  // one panel, r <= 6 rows
  switch (r) {
    case 1: tile<1, 1, W, PF>(a); break;
    case 2: tile<2, 1, W, PF>(a); break;
    case 3: tile<3, 1, W, PF>(a); break;
    case 4: tile<4, 1, W, PF>(a); break;
    case 5: tile<5, 1, W, PF>(a); break;
    default: tile<6, 1, W, PF>(a); break;
  }
}

// One k-chunk of one unit (np panels) for all M rows.
//   M <= 2: both panels in one tile (4 or 8 FMA chains).  With one panel,
//           M = 1 would have only 2 chains, and 2 chains x 4-cycle FMA latency
//           cannot keep up with a bf16 stream (32 B per k-step).
//   M >= 3: panel by panel, groups of <= 6 rows (12 accumulators).
template <class W>
void chunk(const TileArgs<typename W::T>& a, int64_t M, int np) {
  if (M <= 2 && np == 2) {
    M == 1 ? tile<1, 2, W, true>(a) : tile<2, 2, W, true>(a);
    return;
  }
  // The first pass (panel 0, first group) prefetches the whole unit, so
  // panel 1's pass finds its half of each k-step in L1/L2.
  for (int q = 0; q < np; ++q)
    for_row_groups(M, 6, a.panel(q), [q](int r, const TileArgs<typename W::T>& t, bool first) {
      first && q == 0 ? tile_rows<W, true>(r, t) : tile_rows<W, false>(r, t);
    });
}

}  // namespace avx2

// ============================ AVX-512 =======================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace avx512 {

struct F32 {
  using T = float;
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};

struct BF16 {
  using T = uint16_t;
  static inline __m512 load(const uint16_t* p) {
    // [v, v] -> lower 8 lanes: v << 16 (features 0..7); upper 8 lanes:
    // v & 0xFFFF0000 (features 8..15).  One broadcast load + two ALU ops.
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i sh = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                        16, 16, 16, 16, 16, 16, 16, 16);
    return _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_sllv_epi32(v, sh), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// R rows x NP panels (1 zmm each).  Register budget (32 zmm): R*NP
// accumulators + NP weights + broadcast/temps, so R*NP <= 24.
template <int R, int NP, class W, bool PF>
inline void tile(const TileArgs<typename W::T>& a) {
  __m512 c[R][NP];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) c[r][q] = _mm512_loadu_ps(a.acc + q * a.accs + r * NR);
  for (int k = 0; k < a.kc; ++k) {
    if (PF) prefetch_kstep(a.wp, k);
    __m512 w[NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      const typename W::T* wk = a.wp + q * a.wps + static_cast<int64_t>(k) * KS;
      w[q] = W::load(wk);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(a.x[r * a.ldx + k]);
#pragma GCC unroll 2
      for (int q = 0; q < NP; ++q) c[r][q] = _mm512_fmadd_ps(b, w[q], c[r][q]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(a.acc + q * a.accs + r * NR, c[r][q]);
}

template <int NP, class W, bool PF>
void tile_rows(int r, const TileArgs<typename W::T>& a) {
  switch (r) {
    case 1: tile<1, NP, W, PF>(a); break;
    case 2: tile<2, NP, W, PF>(a); break;
    case 3: tile<3, NP, W, PF>(a); break;
    case 4: tile<4, NP, W, PF>(a); break;
    case 5: tile<5, NP, W, PF>(a); break;
    case 6: tile<6, NP, W, PF>(a); break;
    case 7: tile<7, NP, W, PF>(a); break;
    case 8: tile<8, NP, W, PF>(a); break;
    case 9: tile<9, NP, W, PF>(a); break;
    case 10: tile<10, NP, W, PF>(a); break;
    case 11: tile<11, NP, W, PF>(a); break;
    default: tile<12, NP, W, PF>(a); break;
  }
}

// One k-chunk of one unit: both panels per tile, groups of <= 12 rows
// (24 accumulators); M = 1 still has 2 chains of 64-B FMAs, enough to match
// memory.  np = 1 only for a last unit whose second panel is all padding.
template <class W>
void chunk(const TileArgs<typename W::T>& a, int64_t M, int np) {
  for_row_groups(M, 12, a, [np](int r, const TileArgs<typename W::T>& t, bool first) {
    if (np == 2)
      first ? tile_rows<2, W, true>(r, t) : tile_rows<2, W, false>(r, t);
    else
      first ? tile_rows<1, W, true>(r, t) : tile_rows<1, W, false>(r, t);
  });
}

}  // namespace avx512
#pragma GCC pop_options

// x: [M, K] contiguous; packed: [U][K][KS]; bias: [N] or nullptr; out: [M, N].
// chunk: the ISA's per-(unit, k-chunk) routine above.
template <class T>
void run(void (*chunk)(const TileArgs<T>&, int64_t, int), const float* x, int64_t M,
         int64_t K, const T* packed, int64_t N, const float* bias, float* out,
         int nthreads) {
  const int64_t P = (N + NR - 1) / NR;
  const int64_t units = (P + UNIT - 1) / UNIT;
  const int64_t run_len = std::max<int64_t>(1, units / (8 * std::max(1, nthreads)));  // ~8 runs per thread

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> accbuf(static_cast<size_t>(UNIT) * M * NR);  // [UNIT][M][NR]
    float* acc = accbuf.data();

    // Dynamic schedule over contiguous runs of `run_len` units (the prefetchers like long
    // sequential streams): a thread on a core slowed by other load takes fewer runs instead of
    // holding the others up (qlinear.cpp measured it).  K is never split across threads (that
    // would change the summation order), and which thread computes a unit changes no bits.
#pragma omp for schedule(dynamic, run_len)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t p0 = u * UNIT;
      const int np = static_cast<int>(std::min<int64_t>(UNIT, P - p0));
      std::memset(acc, 0, sizeof(float) * UNIT * M * NR);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int kc = static_cast<int>(std::min<int64_t>(KC, K - k0));
        chunk({packed + (u * K + k0) * KS, NR, x + k0, K, kc, acc, M * NR}, M, np);
      }
      // Epilogue: add bias, store the valid features (last panel may be partial).
      for (int q = 0; q < np; ++q) {
        const int64_t n0 = (p0 + q) * NR;
        const int nv = static_cast<int>(std::min<int64_t>(NR, N - n0));
        for (int64_t m = 0; m < M; ++m) {
          const float* s = acc + (q * M + m) * NR;
          float* o = out + m * N + n0;
          if (bias) {
            for (int j = 0; j < nv; ++j) o[j] = s[j] + bias[n0 + j];
          } else {
            std::memcpy(o, s, sizeof(float) * nv);
          }
        }
      }
    }
  }
}

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

// Instruction set `linear` uses for isa=0 (auto): 512 (AVX-512) or 2 (AVX2).
int64_t best_isa() { return cpu_has_avx512() ? 512 : 2; }

// out = x @ W^T (+ bias).  x: [..., K] fp32 CPU (any strides; copied if not
// contiguous); packed: fp32 or int16 (bf16 bits) units [U, K, KS];
// returns [..., N] fp32.  Shapes are handled here rather than in Python
// because each Python-side reshape/view costs ~0.7 us per call.
// isa: 0 = best available, 2 = AVX2, 512 = AVX-512 (same results bit for bit).
torch::Tensor linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                     const c10::optional<torch::Tensor>& bias, int64_t N,
                     int64_t nthreads, int64_t isa) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == torch::kFloat32 &&
                  x_in.dim() >= 1,
              "x must be a fp32 CPU tensor [..., K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == KS && packed.is_contiguous(),
              "packed weight must be contiguous [U, K, 32]");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(K > 0 && packed.size(1) == K, "K mismatch: x has ", K,
              ", weight has ", packed.size(1));
  TORCH_CHECK(N > 0 && (N + KS - 1) / KS == packed.size(0), "N mismatch");
  const torch::Tensor x = x_in.contiguous();  // [M, K] in memory
  const int64_t M = x.numel() / K;
  torch::Tensor b;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->numel() == N,
                "bias must be a fp32 [N] tensor");
    b = bias->contiguous();
    bptr = b.data_ptr<float>();
  }
  std::vector<int64_t> out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  auto out = torch::empty(out_sizes, x.options());  // [..., N]
  if (M == 0) return out;
  if (isa == 0) isa = best_isa();
  TORCH_CHECK(isa == 2 || (isa == 512 && cpu_has_avx512()),
              "isa must be 0 (auto), 2 (AVX2) or 512 (AVX-512, if the CPU has it)");
  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (packed.scalar_type() == torch::kFloat32) {
    const float* wp = packed.data_ptr<float>();
    run<float>(isa == 512 ? &avx512::chunk<avx512::F32> : &avx2::chunk<avx2::F32>, xp, M,
               K, wp, N, bptr, op, nt);
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kInt16,
                "packed weight must be fp32 or int16 (bf16 bits)");
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
    run<uint16_t>(isa == 512 ? &avx512::chunk<avx512::BF16> : &avx2::chunk<avx2::BF16>,
                  xp, M, K, wp, N, bptr, op, nt);
  }
  return out;
}

// Read bandwidth probe for the benchmark: sums a contiguous fp32 buffer with
// AVX2, each thread one contiguous slice (same access pattern as the matmul),
// 4 independent accumulators so add latency never limits.  Returns the sum so
// the reads cannot be elided.
double stream_read(const torch::Tensor& buf, int64_t nthreads) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == torch::kFloat32 &&
                  buf.is_contiguous(),
              "buf must be a contiguous fp32 CPU tensor");
  const float* p = buf.data_ptr<float>();
  const int64_t nblk = buf.numel() / 32;  // 32 floats = 2 lines per step
  double total = 0.0;
  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
#pragma omp parallel num_threads(nt) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t b0 = nblk * t / T, b1 = nblk * (t + 1) / T;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t b = b0; b < b1; ++b) {
      const float* q = p + b * 32;
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(q));
      s1 = _mm256_add_ps(s1, _mm256_loadu_ps(q + 8));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(q + 16));
      s3 = _mm256_add_ps(s3, _mm256_loadu_ps(q + 24));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (float v : lanes) total += v;
  }
  for (int64_t i = nblk * 32; i < buf.numel(); ++i) total += p[i];
  return total;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specdec few-row weight-streaming linear (AVX2/AVX-512 + OpenMP)";
  m.def("linear", &linear, "out[..., N] = x[..., K] @ W^T (+ bias), W prepacked",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"),
        py::arg("nthreads"), py::arg("isa") = 0);
  m.def("best_isa", &best_isa, "ISA used for isa=0: 512 (AVX-512) or 2 (AVX2)");
  m.def("stream_read", &stream_read, "sum a fp32 buffer (bandwidth probe)",
        py::arg("buf"), py::arg("nthreads"));
}
