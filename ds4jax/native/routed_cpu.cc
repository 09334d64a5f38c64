// The routed experts of a decode step on CPU, as one XLA FFI call (issue 27).
//
// XLA:CPU copies each selected expert out of the stacked [E, out, in] weights before its
// product (a dynamic slice feeding a library dot) and runs each small product as a call
// of its own. Here every selected expert's rows are read in place, once for all the tokens
// that picked it, and the work is split over XLA's own intra-op thread pool.
//
// Arithmetic, per token t and pick j (e = sel[t, j]), in the order of the jnp twin
// (`ds4jax.model.layers._routed`): h = silu(min(W1[e]·x, L)) · clip(W3[e]·x, −L, L),
// y = W2[e]·h, out[t] = Σ_j w[t, j] · y in j order. A weight is f32, or FP4 E2M1 codes
// packed two per byte (low nibble: the even input) with one E8M0 exponent per 32 inputs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Runs f(0) … f(n − 1) on the calling thread and the pool's threads. The caller takes items
// too, so it never waits on a task the pool has not started; it returns once every item has
// finished, and a helper that starts later finds no item left.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F f) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto c = std::make_shared<Counters>();
  auto work = [c, n, &f] {
    for (int64_t i; (i = c->next.fetch_add(1)) < n;) {
      f(i);
      c->done.fetch_add(1);
    }
  };
  // the calling thread is one of the workers: one helper fewer than the cores
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t helpers = std::min({pool.num_threads(), cores - 1, n - 1});
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([c, n, work] {
      if (c->next.load() < n) work();
    });
  }
  work();
  while (c->done.load() < n) std::this_thread::yield();
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// dots of one weight row a[n] with N vectors b[t][n] (the tokens of one expert): the row
// is read from memory once for all of them. N is a template parameter, so the
// accumulators stay in registers; each token's sum is formed the same way whatever N is,
// so a token's result does not depend on which others share its call.
constexpr int NT = 8;
template <int N>
inline void dots_n(const float* a, const float* const* b, int64_t n, float* out) {
  int64_t i = 0;
  float acc[N] = {};
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s[N];
  for (int t = 0; t < N; ++t) s[t] = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    for (int t = 0; t < N; ++t) s[t] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b[t] + i), s[t]);
  }
  for (int t = 0; t < N; ++t) acc[t] = hsum(s[t]);
#endif
  for (; i < n; ++i)
    for (int t = 0; t < N; ++t) acc[t] += a[i] * b[t][i];
  for (int t = 0; t < N; ++t) out[t] = acc[t];
}

inline void dots(const float* a, const float* const* b, int nt, int64_t n, float* out) {
  switch (nt) {
    case 1: return dots_n<1>(a, b, n, out);
    case 2: return dots_n<2>(a, b, n, out);
    case 3: return dots_n<3>(a, b, n, out);
    case 4: return dots_n<4>(a, b, n, out);
    case 5: return dots_n<5>(a, b, n, out);
    case 6: return dots_n<6>(a, b, n, out);
    case 7: return dots_n<7>(a, b, n, out);
    default: return dots_n<8>(a, b, n, out);
  }
}

struct Pairs {
  std::vector<int32_t> experts;           // distinct selected experts, first use order
  std::vector<std::vector<int64_t>> of;   // per distinct expert: its pair indices t·k + j
};

Pairs group(const int32_t* sel, int64_t pairs, int64_t E) {
  Pairs g;
  std::vector<int64_t> slot(E, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    int32_t e = std::clamp<int32_t>(sel[p], 0, E - 1);
    if (slot[e] < 0) {
      slot[e] = g.experts.size();
      g.experts.push_back(e);
      g.of.emplace_back();
    }
    g.of[slot[e]].push_back(p);
  }
  return g;
}

constexpr int64_t ROWS = 32;  // output rows per work item

ffi::Error RoutedF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sel,
                     ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> w1,
                     ffi::Buffer<ffi::F32> w3, ffi::Buffer<ffi::F32> w2, float limit,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), sd = sel.dimensions(), wd = w1.dimensions();
  const int64_t T = xd[0], D = xd[1], k = sd[1], E = wd[0], F = wd[1];
  if (wd[2] != D || w2.dimensions()[1] != D || w2.dimensions()[2] != F)
    return ffi::Error::InvalidArgument("routed_f32: expert shapes do not match x");
  const int64_t P = T * k;
  Pairs g = group(sel.typed_data(), P, E);
  std::vector<float> H(P * F), Y(P * D);
  const float* X = x.typed_data();
  std::vector<std::pair<int64_t, int64_t>> items;  // (slot, first row)
  for (size_t s = 0; s < g.experts.size(); ++s)
    for (int64_t r = 0; r < F; r += ROWS) items.emplace_back(s, r);
  parallel_for(pool, items.size(), [&](int64_t i) {
    auto [s, r0] = items[i];
    const int64_t e = g.experts[s];
    for (int64_t r = r0; r < std::min(F, r0 + ROWS); ++r) {
      const float* a = w1.typed_data() + (e * F + r) * D;
      const float* b = w3.typed_data() + (e * F + r) * D;
      const auto& ps = g.of[s];
      for (size_t p0 = 0; p0 < ps.size(); p0 += NT) {
        const int nt = std::min<size_t>(NT, ps.size() - p0);
        const float* xs[NT];
        float gv[NT], uv[NT];
        for (int q = 0; q < nt; ++q) xs[q] = X + (ps[p0 + q] / k) * D;
        dots(a, xs, nt, D, gv);
        dots(b, xs, nt, D, uv);
        for (int q = 0; q < nt; ++q) {
          float gq = std::min(gv[q], limit), uq = std::clamp(uv[q], -limit, limit);
          H[ps[p0 + q] * F + r] = gq / (1.0f + std::exp(-gq)) * uq;
        }
      }
    }
  });
  items.clear();
  for (size_t s = 0; s < g.experts.size(); ++s)
    for (int64_t r = 0; r < D; r += ROWS) items.emplace_back(s, r);
  parallel_for(pool, items.size(), [&](int64_t i) {
    auto [s, r0] = items[i];
    const int64_t e = g.experts[s];
    for (int64_t r = r0; r < std::min(D, r0 + ROWS); ++r) {
      const float* a = w2.typed_data() + (e * D + r) * F;
      const auto& ps = g.of[s];
      for (size_t p0 = 0; p0 < ps.size(); p0 += NT) {
        const int nt = std::min<size_t>(NT, ps.size() - p0);
        const float* hs[NT];
        float y[NT];
        for (int q = 0; q < nt; ++q) hs[q] = H.data() + ps[p0 + q] * F;
        dots(a, hs, nt, F, y);
        for (int q = 0; q < nt; ++q) Y[ps[p0 + q] * D + r] = y[q];
      }
    }
  });
  float* O = out->typed_data();
  const float* W = w.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    float* o = O + t * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float* y = Y.data() + (t * k + j) * D;
      const float wt = W[t * k + j];
      for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
    }
  }
  return ffi::Error::Success();
}

// y [T, N] = x [T, K] · W [N, K]ᵀ for a few tokens: each row of W read once for all of them.
ffi::Error GemvF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> out) {
  const int64_t T = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K) return ffi::Error::InvalidArgument("gemv_f32: K differs");
  const float* X = x.typed_data();
  const float* W = w.typed_data();
  float* Y = out->typed_data();
  constexpr int64_t R = 64;
  parallel_for(pool, (N + R - 1) / R, [&](int64_t i) {
    for (int64_t r = i * R; r < std::min(N, (i + 1) * R); ++r) {
      for (int64_t t0 = 0; t0 < T; t0 += NT) {
        const int nt = std::min<int64_t>(NT, T - t0);
        const float* xs[NT];
        float y[NT];
        for (int q = 0; q < nt; ++q) xs[q] = X + (t0 + q) * K;
        dots(W + r * K, xs, nt, K, y);
        for (int q = 0; q < nt; ++q) Y[(t0 + q) * N + r] = y[q];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_gemv_f32, GemvF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_routed_f32, RoutedF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("limit")
                                  .Ret<ffi::Buffer<ffi::F32>>());
