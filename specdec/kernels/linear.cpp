// Weight-streaming matmul for a few rows: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Decoding is memory-bound: every weight is read once per forward pass and
// used for only M (1..16) multiply-adds.  BLAS switches from gemv to a GEMM
// path at M >= 2 and the cost jumps; here each weight is loaded from memory
// once, kept in registers/L1, and applied to all M rows, so the cost of M rows
// stays close to the cost of one row until the FMA units become the limit.
//
// Two tile implementations over the same layout: AVX2+FMA (baseline, what the
// build flags require) and AVX-512 (compiled via a target pragma, picked at
// runtime when the CPU has it: twice the FMA width keeps M ~ 5..16 closer to
// memory-bound).  Both compute exactly the same FMA chains.
//
// Layout (done by prepare_weight in __init__.py, not here):
//   W is padded to Np = ceil(N / NR) * NR rows with zeros and packed into
//   panels [Np / NR][K][NR], so one k-step of one panel is NR contiguous
//   weights (fp32: 64 B = one cache line; bf16: 32 B).
//   bf16 panels are stored as uint16 with the NR lanes interleaved
//   (element 2j = feature j, element 2j+1 = feature 8+j), so that one 32-bit
//   lane holds two bf16 values and widening is one shift + one AND, no shuffles.
//
// Batch invariance: every output element is an FMA chain over k = 0..K-1 in
// order, starting from 0.0f, then "+ bias".  Neither the row grouping (which
// depends on M), the K-chunking (accumulators are spilled/reloaded exactly),
// nor the thread split (threads own whole panels; K is never split) changes
// that order, so row m of an M-row call is bit-identical to the same row
// computed alone.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int NR = 16;  // output features per panel (one zmm / two ymm);
                        // must match NR in __init__.py
#ifndef SPECDEC_KC
#define SPECDEC_KC 256
#endif
#ifndef SPECDEC_PF
#define SPECDEC_PF 16
#endif
// k-chunk: a chunk of the panel(s) (<= 2 * 256 * 64 B = 32 KiB fp32) plus the x
// chunk (<= 16 * 256 * 4 B = 16 KiB) stay in L1/L2 while every row group of
// the call reuses them; only the first group streams them from memory.
constexpr int KC = SPECDEC_KC;
constexpr int PF_BYTES = SPECDEC_PF * 64;  // software prefetch distance

// Rows are split into near-equal groups of <= mr (e.g. mr=6: 7 -> 4+3,
// 16 -> 6+5+5) because a lone 1-row tile would be FMA-latency-bound.
// Grouping never changes a row's accumulation order, only its registers.
inline std::vector<int64_t> row_groups(int64_t M, int mr) {
  const int64_t ng = (M + mr - 1) / mr;
  std::vector<int64_t> start(ng + 1);
  for (int64_t g = 0; g <= ng; ++g) start[g] = g * M / ng;
  return start;
}

// Arguments of one register tile: `np` panels x `r` rows over `kc` k-steps.
//   wp:  first panel, offset to the chunk start; panel q is at wp + q * wps
//   x:   first row of the group, offset to the chunk start; row stride ldx
//   acc: [np][M][NR] running sums for this unit, offset to the group's first
//        row; panel q's rows at acc + q * accs.  Loaded, updated, stored back
//        (exact in fp32, so K-chunking does not change any result).
template <class T>
struct TileArgs {
  const T* wp;
  int64_t wps;
  const float* x;
  int64_t ldx;
  int kc;
  float* acc;
  int64_t accs;
};

// ============================ AVX2 + FMA ====================================
// Unit of work = one panel = two ymm of features; <= 6 rows per tile:
// 6 x 2 = 12 accumulators + 2 weights + 1 broadcast = 15 of 16 ymm.
namespace avx2 {

constexpr int UNIT = 1, MR = 6;

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

template <int R, class W, bool PF>
inline void tile(const TileArgs<typename W::T>& a) {
  __m256 c[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    c[r][0] = _mm256_loadu_ps(a.acc + r * NR);
    c[r][1] = _mm256_loadu_ps(a.acc + r * NR + 8);
  }
  const float* x = a.x;
  for (int k = 0; k < a.kc; ++k) {
    const typename W::T* wk = a.wp + static_cast<int64_t>(k) * NR;
    // fp32: one line per k-step; bf16: one per two (the repeat is cheap).
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(wk) + PF_BYTES, _MM_HINT_T0);
    __m256 w0, w1;
    W::load(wk, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * a.ldx + k);
      c[r][0] = _mm256_fmadd_ps(b, w0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(b, w1, c[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(a.acc + r * NR, c[r][0]);
    _mm256_storeu_ps(a.acc + r * NR + 8, c[r][1]);
  }
}

template <class W, bool PF>
void tile_rows(int r, const TileArgs<typename W::T>& a) {
  switch (r) {
    case 1: tile<1, W, PF>(a); break;
    case 2: tile<2, W, PF>(a); break;
    case 3: tile<3, W, PF>(a); break;
    case 4: tile<4, W, PF>(a); break;
    case 5: tile<5, W, PF>(a); break;
    default: tile<6, W, PF>(a); break;
  }
}

// np is always 1 here (UNIT = 1).
template <class W>
void run_tile(int r, int /*np*/, bool pf, const TileArgs<typename W::T>& a) {
  pf ? tile_rows<W, true>(r, a) : tile_rows<W, false>(r, a);
}

}  // namespace avx2

// ============================ AVX-512 =======================================
// Same packed layout and the same per-element FMA chain as AVX2, so results
// are bit-identical; twice the FMA width lets M ~ 5..16 stay memory-bound
// longer.  Unit = two panels (two zmm of features); <= 12 rows per tile:
// 24 accumulators + 2 weights + broadcast/temps fit in 32 zmm.  Compiled for
// AVX-512 via the target pragma, used only if the CPU reports it at runtime.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
namespace avx512 {

constexpr int UNIT = 2, MR = 12;

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

template <int R, int NP, class W, bool PF>
inline void tile(const TileArgs<typename W::T>& a) {
  __m512 c[R][NP];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) c[r][q] = _mm512_loadu_ps(a.acc + q * a.accs + r * NR);
  const float* x = a.x;
  for (int k = 0; k < a.kc; ++k) {
    __m512 w[NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      const typename W::T* wk = a.wp + q * a.wps + static_cast<int64_t>(k) * NR;
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(wk) + PF_BYTES, _MM_HINT_T0);
      w[q] = W::load(wk);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * a.ldx + k]);
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

// np = 1 only for the last unit when the panel count is odd.
template <class W>
void run_tile(int r, int np, bool pf, const TileArgs<typename W::T>& a) {
  if (np == 2)
    pf ? tile_rows<2, W, true>(r, a) : tile_rows<2, W, false>(r, a);
  else
    pf ? tile_rows<1, W, true>(r, a) : tile_rows<1, W, false>(r, a);
}

}  // namespace avx512
#pragma GCC pop_options

// x: [M, K] contiguous; packed: [P][K][NR]; bias: [N] or nullptr; out: [M, N]
template <int UNIT, int MR, class T>
void run(void (*run_tile)(int, int, bool, const TileArgs<T>&), const float* x,
         int64_t M, int64_t K, const T* packed, int64_t N, const float* bias,
         float* out, int nthreads) {
  const int64_t P = (N + NR - 1) / NR;
  const int64_t units = (P + UNIT - 1) / UNIT;
  const std::vector<int64_t> gs = row_groups(M, MR);
  const int64_t ngroups = static_cast<int64_t>(gs.size()) - 1;

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> accbuf(static_cast<size_t>(UNIT) * M * NR);  // [UNIT][M][NR]
    float* acc = accbuf.data();

    // Static schedule: each thread streams one contiguous run of panels,
    // which is what the hardware prefetchers like best.  K is never split
    // across threads (that would change the summation order).
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t p0 = u * UNIT;
      const int np = static_cast<int>(std::min<int64_t>(UNIT, P - p0));
      std::memset(acc, 0, sizeof(float) * UNIT * M * NR);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int kc = static_cast<int>(std::min<int64_t>(KC, K - k0));
        for (int64_t g = 0; g < ngroups; ++g) {
          const int64_t m0 = gs[g];
          const TileArgs<T> a{packed + (p0 * K + k0) * NR, K * NR, x + m0 * K + k0,
                              K, kc, acc + m0 * NR, M * NR};
          // Only the first group streams the chunk from memory and prefetches.
          run_tile(static_cast<int>(gs[g + 1] - m0), np, g == 0, a);
        }
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

// Instruction set `linear` uses for isa=0 (auto): 512 or 2 (AVX2).
int64_t best_isa() { return cpu_has_avx512() ? 512 : 2; }

// out = x @ W^T (+ bias).  x: [M, K] fp32 contiguous CPU; packed: fp32
// [P, K, NR] or int16 (bf16 bits) [P, K, NR]; returns [M, N] fp32.
// isa: 0 = best available, 2 = AVX2, 512 = AVX-512 (same results bit for bit).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed,
                     const c10::optional<torch::Tensor>& bias, int64_t N,
                     int64_t nthreads, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 &&
                  x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR &&
                  packed.is_contiguous(),
              "packed weight must be contiguous [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K, "K mismatch: x has ", K, ", weight has ",
              packed.size(1));
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == packed.size(0), "N mismatch");
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == N,
                "bias must be a contiguous fp32 [N] tensor");
    bptr = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
  if (isa == 0) isa = best_isa();
  TORCH_CHECK(isa == 2 || (isa == 512 && cpu_has_avx512()),
              "isa must be 0 (auto), 2 (AVX2) or 512 (AVX-512, if the CPU has it)");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (packed.scalar_type() == torch::kFloat32) {
    const float* wp = packed.data_ptr<float>();
    if (isa == 512)
      run<avx512::UNIT, avx512::MR>(&avx512::run_tile<avx512::F32>, xp, M, K, wp, N, bptr, op, nt);
    else
      run<avx2::UNIT, avx2::MR>(&avx2::run_tile<avx2::F32>, xp, M, K, wp, N, bptr, op, nt);
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kInt16,
                "packed weight must be fp32 or int16 (bf16 bits)");
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
    if (isa == 512)
      run<avx512::UNIT, avx512::MR>(&avx512::run_tile<avx512::BF16>, xp, M, K, wp, N, bptr, op, nt);
    else
      run<avx2::UNIT, avx2::MR>(&avx2::run_tile<avx2::BF16>, xp, M, K, wp, N, bptr, op, nt);
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
  m.doc() = "specdec few-row weight-streaming linear (AVX2/FMA + OpenMP)";
  m.def("linear", &linear, "out[M,N] = x[M,K] @ W^T (+ bias), W prepacked",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"),
        py::arg("nthreads"), py::arg("isa") = 0);
  m.def("best_isa", &best_isa, "ISA used for isa=0: 512 (AVX-512) or 2 (AVX2)");
  m.def("stream_read", &stream_read, "sum a fp32 buffer (bandwidth probe)",
        py::arg("buf"), py::arg("nthreads"));
}
