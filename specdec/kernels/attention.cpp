// Batch-invariant attention for decode and verification.
//
// torch's scaled_dot_product_attention gives a query row different bits depending on how
// many query rows share the call (T) and how many key slots it spans (S): its blocking and
// reduction order follow the shapes.  Greedy speculative decoding is only exactly the plain
// decode if the verify forward (T = k + 1) gives each row the bits of the 1-row step, and
// with int8-quantised activations (--dtype native) a 1-ulp difference in one layer can flip
// an activation's rounding and grow to a different argmax.
//
// Here each (batch, head, query) row is computed on its own, over exactly the key slots
// its mask allows, in increasing slot order:
//   s_j = (q . k_j) * scale      (fixed-order dot product over D)
//   m   = max_j s_j
//   p_j = exp(s_j - m),  l = sum_j p_j      (sequential in j)
//   o   = (sum_j p_j v_j) * (1 / l)         (sequential in j, vectorised over D)
// Nothing depends on T, S beyond the allowed slots, the batch size or the thread count.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

}  // namespace

// q [B, H, T, D]; k, v [B, Hkv, S, D] (any strides with a contiguous last dim);
// allowed [B, 1, T, S] bool (broadcast over heads).  Returns [B, H, T, D] fp32.
torch::Tensor invariant_attention(const torch::Tensor& q_in, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& allowed_in,
                                  int64_t nthreads) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-d");
  TORCH_CHECK(q_in.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32 && q_in.device().is_cpu(),
              "q, k, v must be fp32 CPU tensors");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v need a contiguous last dim");
  const torch::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S &&
                  k.size(3) == D && v.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "shape mismatch");
  const torch::Tensor allowed = allowed_in.to(torch::kBool).expand({B, 1, T, S}).contiguous();
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* ap = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t group = H / Hkv;
  const int nt = static_cast<int>(std::max<int64_t>(1, nthreads));
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> p(S), o(D);
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < B * H * T; ++idx) {
      const int64_t b = idx / (H * T), h = (idx / T) % H, t = idx % T, kh = h / group;
      const float* qr = qp + idx * D;
      const bool* al = ap + (b * T + t) * S;
      const float* kb = kp + b * k.stride(0) + kh * k.stride(1);
      const float* vb = vp + b * v.stride(0) + kh * v.stride(1);
      float m = -INFINITY;
      for (int64_t j = 0; j < S; ++j)
        if (al[j]) {
          p[j] = dot(qr, kb + j * k.stride(2), D) * scale;
          m = std::max(m, p[j]);
        }
      float l = 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t j = 0; j < S; ++j)
        if (al[j]) {
          const float e = std::exp(p[j] - m);
          l += e;
          const float* vr = vb + j * v.stride(2);
          int64_t d = 0;
          const __m256 ev = _mm256_set1_ps(e);
          for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(o.data() + d, _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(o.data() + d)));
          for (; d < D; ++d) o[d] = std::fma(e, vr[d], o[d]);
        }
      const float inv = l > 0.f ? 1.0f / l : 0.f;  // a row with no allowed slot gives zeros
      float* orow = op + idx * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = o[d] * inv;
    }
  }
  return out;
}
