// CPU kernels of a decode step as XLA FFI calls (issue 27; ds4jax/native/__init__.py builds,
// registers and calls them, and names each one's jnp twin).
//
// XLA:CPU runs a decode step of a small model as hundreds of library calls, most of them
// small products below the machine's bandwidth, and it copies each selected expert out of
// the stacked [E, out, in] weights before its product. Here a weight is read in place, once
// for all the tokens of the call, and the work is split over XLA's own intra-op thread pool:
// * routed experts, per token t and pick j (e = sel[t, j]), as the twin
//   (`ds4jax.model.layers._routed`): h = silu(min(W1[e]·x, L)) · clip(W3[e]·x, −L, L),
//   y = W2[e]·h, out[t] = Σ_j w[t, j] · y in j order; a weight f32, or FP4 E2M1 codes packed
//   two per byte (low nibble: the even input) with one E8M0 exponent per 32 inputs;
// * a GEMV for a few tokens (every linear of a decode step, the head included; weights
//   f32 or bf16, products in f32);
// * argmax (greedy selection) and a draw without ranking (temperature, min-p);
// * decode attention with an attention sink over a layer's key sources in place (the raw
//   window's ring, the step's own keys, the compressed rows a query picked), where XLA
//   concatenated them — twice, once transposed — before its products.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// This machine's cores (at least 1): the helpers' count, `parallel_for`'s and the GEMV's split.
inline int64_t cores() {
  static const int64_t n = std::max(1u, std::thread::hardware_concurrency());
  return n;
}

// Helper threads of this library's own, for a call's items beside the calling thread. XLA's
// intra-op pool wakes a sleeping thread for each call, and most of a decode step's calls take
// 5–60 µs, so its thread joined them late. These threads spin (yielding the core to any
// runnable thread) for `SPIN` after their last item, then sleep until the next call; one call
// at a time uses them (a concurrent one takes the pool's threads instead). Measured with both
// libraries in one process, their steps alternating (bench-192m): B=1 1.03–1.07× (after 400
// and 8,192 tokens), B=8 1.01–1.03×.
class Helpers {
 public:
  static Helpers& get() {
    static Helpers* h = new Helpers();  // never destroyed: its threads outlive static teardown
    return *h;
  }
  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

  // Runs item(ctx, i) for i < n here and on the helpers; false (nothing run) when another
  // call holds them.
  bool run(int64_t n, void (*item)(void*, int64_t), void* ctx) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    item_ = item;
    ctx_ = ctx;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    // a helper that sees the job open sees it whole (a late helper of the last call, active
    // again, may take this one's items: the same work)
    open_.store(true, std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work();
    while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
    open_.store(false, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) > 0) std::this_thread::yield();
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  static constexpr auto SPIN = std::chrono::milliseconds(2);

  Helpers() {
    for (int64_t i = 0; i < std::min<int64_t>(cores() - 1, 7); ++i)
      threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void work() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) {
      item_(ctx_, i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = gen_.load();
    auto idle_since = std::chrono::steady_clock::now();
    for (;;) {
      const uint64_t g = gen_.load(std::memory_order_seq_cst);
      if (g != seen) {
        seen = g;
        active_.fetch_add(1, std::memory_order_seq_cst);
        if (open_.load(std::memory_order_seq_cst) && gen_.load() == g) work();
        active_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - idle_since < SPIN) {
        std::this_thread::yield();
      } else {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = std::chrono::steady_clock::now();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<bool> busy_{false}, open_{false};
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> next_{0}, done_{0}, active_{0}, sleepers_{0};
  int64_t n_ = 0;
  void (*item_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs f(0) … f(n − 1) on the calling thread and the helpers (`Helpers`), or where another
// call holds them, on the calling thread and XLA's pool. The caller takes items too, so it
// never waits on a thread that has not started; it returns once every item has finished.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F f) {
  if (n <= 0) return;
  Helpers& helpers = Helpers::get();
  if (n > 1 && helpers.size() > 0 &&
      helpers.run(n, [](void* ctx, int64_t i) { (*static_cast<F*>(ctx))(i); }, &f))
    return;
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
  const int64_t others = std::min({pool.num_threads(), cores() - 1, n - 1});
  for (int64_t h = 0; h < others; ++h) {
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

// A weight element as f32: f32 itself, or bfloat16 (the upper half of an f32, so the
// expansion is exact and a bf16-held weight gives the products of its f32 values).
using bf16 = uint16_t;
inline float widen(float v) { return v; }
inline float widen(bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
// The GEMV's vector: 16 floats where the compiler targets AVX-512, else 8 (AVX2).
#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return load8(p); }
  static T load(const bf16* p) { return load8(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static float sum(T v) { return hsum(v); }
};
#endif

// dots of one weight row a[n] with N vectors b[t][n] (the tokens of one expert): the row
// is read from memory once for all of them. Each token's sum runs in CH chains (vector i
// of the row into chain i mod CH of its block, the tail vectors into chain 0, the scalar
// tail last), so one token's product is not one chain of dependent FMAs (a bf16 head's
// GEMV for one token took 1.3× the time); N ≤ PASS keeps the accumulators in registers.
// Every token's sum is formed the same way whatever N is, so a token's result does not
// depend on which others share its call. Vectors are 16 floats where the compiler targets
// AVX-512 (32 registers: 8 tokens × 2 chains fit; an 8-token f32 head 9.5 → 7.7–8.5 ms,
// bf16 6.7 → 5.1–5.3 on the 2-core EPYC), else 8 (AVX2): the order, not the result's
// independence of N, differs between those machines.
constexpr int NT = 8, CH = 2, PASS = 8;
template <int N, typename W>
inline void dots_n(const W* a, const float* const* b, int64_t n, float* out) {
  static_assert(N <= PASS, "CH chains for each token: at most PASS tokens in registers");
  int64_t i = 0;
  float acc[N] = {};
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int V = Vec::W;
  typename Vec::T s[N][CH];
  for (int t = 0; t < N; ++t)
    for (int c = 0; c < CH; ++c) s[t][c] = Vec::zero();
  for (; i + V * CH <= n; i += V * CH) {
    for (int c = 0; c < CH; ++c) {
      const auto av = Vec::load(a + i + V * c);
      for (int t = 0; t < N; ++t) s[t][c] = Vec::fma(av, Vec::load(b[t] + i + V * c), s[t][c]);
    }
  }
  for (; i + V <= n; i += V) {
    const auto av = Vec::load(a + i);
    for (int t = 0; t < N; ++t) s[t][0] = Vec::fma(av, Vec::load(b[t] + i), s[t][0]);
  }
  for (int t = 0; t < N; ++t) {
    auto v = s[t][0];
    for (int c = 1; c < CH; ++c) v = Vec::add(v, s[t][c]);
    acc[t] = Vec::sum(v);
  }
#endif
  for (; i < n; ++i)  // an explicit fma: the same rounding in every instantiation
    for (int t = 0; t < N; ++t) acc[t] = std::fma(widen(a[i]), b[t][i], acc[t]);
  for (int t = 0; t < N; ++t) out[t] = acc[t];
}

// up to NT tokens, in passes of at most PASS (the row is in L1 after the first)
template <typename W>
inline void dots(const W* a, const float* const* b, int nt, int64_t n, float* out) {
  for (int t = 0; t < nt; t += PASS) {
    switch (std::min(PASS, nt - t)) {
      case 1: dots_n<1>(a, b + t, n, out + t); break;
      case 2: dots_n<2>(a, b + t, n, out + t); break;
      case 3: dots_n<3>(a, b + t, n, out + t); break;
      case 4: dots_n<4>(a, b + t, n, out + t); break;
      case 5: dots_n<5>(a, b + t, n, out + t); break;
      case 6: dots_n<6>(a, b + t, n, out + t); break;
      case 7: dots_n<7>(a, b + t, n, out + t); break;
      default: dots_n<8>(a, b + t, n, out + t);
    }
  }
}

// FP4 E2M1 rows: 16 bytes hold a block of 32 inputs, the low nibble the even input, with one
// E8M0 exponent per block. The inputs come de-interleaved (evens, then odds: `Fp4Rows::at`),
// so a byte's two codes meet two plain vectors. A block's products are summed, then scaled.
float E8M0[256];  // 2^(e − 127), as the twin's ldexp gives it
const bool E8M0_READY = [] {
  for (int e = 0; e < 256; ++e) E8M0[e] = std::ldexp(1.0f, e - 127);
  return true;
}();
constexpr float E2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 e2m1(__m256i codes) {  // eight codes 0…15 → floats
  const __m256 mag = _mm256_setr_ps(0, 0.5f, 1, 1.5f, 2, 3, 4, 6);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_or_ps(_mm256_permutevar8x32_ps(mag, codes), _mm256_castsi256_ps(sign));
}
#endif

template <int N>
inline void qdots_n(const uint8_t* q, const uint8_t* ex, const float* const* x, int64_t n,
                    float* out) {
  const int64_t half = n / 2;
  float acc[N] = {};
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s[N];
  for (int t = 0; t < N; ++t) s[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / 32; ++b) {
    __m256 bs[N];
    for (int t = 0; t < N; ++t) bs[t] = _mm256_setzero_ps();
    for (int64_t o = b * 16; o < b * 16 + 16; o += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + o)));
      const __m256 lo = e2m1(_mm256_and_si256(v, _mm256_set1_epi32(15)));
      const __m256 hi = e2m1(_mm256_srli_epi32(v, 4));
      for (int t = 0; t < N; ++t) {
        bs[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[t] + o), bs[t]);
        bs[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[t] + half + o), bs[t]);
      }
    }
    const __m256 scale = _mm256_set1_ps(E8M0[ex[b]]);
    for (int t = 0; t < N; ++t) s[t] = _mm256_fmadd_ps(bs[t], scale, s[t]);
  }
  for (int t = 0; t < N; ++t) acc[t] = hsum(s[t]);
#else
  for (int64_t b = 0; b < n / 32; ++b) {
    for (int t = 0; t < N; ++t) {
      float bs = 0;
      for (int64_t o = b * 16; o < b * 16 + 16; ++o)
        bs += E2M1[q[o] & 15] * x[t][o] + E2M1[q[o] >> 4] * x[t][half + o];
      acc[t] += bs * E8M0[ex[b]];
    }
  }
#endif
  for (int t = 0; t < N; ++t) out[t] = acc[t];
}

inline void qdots(const uint8_t* q, const uint8_t* ex, const float* const* x, int nt, int64_t n,
                  float* out) {
  switch (nt) {
    case 1: return qdots_n<1>(q, ex, x, n, out);
    case 2: return qdots_n<2>(q, ex, x, n, out);
    case 3: return qdots_n<3>(q, ex, x, n, out);
    case 4: return qdots_n<4>(q, ex, x, n, out);
    case 5: return qdots_n<5>(q, ex, x, n, out);
    case 6: return qdots_n<6>(q, ex, x, n, out);
    case 7: return qdots_n<7>(q, ex, x, n, out);
    default: return qdots_n<8>(q, ex, x, n, out);
  }
}

// Weight rows are fetched AHEAD rows before their dots: the hardware's prefetcher alone left a
// decode step's GEMVs short of the bandwidth (bench-192m, one process, steps alternating:
// B=1 1.06–1.09×, B=8 1.09×).
constexpr int64_t AHEAD = 4;
inline void prefetch(const void* p, int64_t bytes) {
#if defined(__AVX2__)
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
#endif
}

// The rows of stacked expert weights [E·out, in], and where input i of a vector goes in the
// layout their dots read (`at`).
struct DenseRows {
  const float* w;
  int64_t in;
  static int64_t at(int64_t i, int64_t) { return i; }
  void operator()(int64_t row, const float* const* x, int nt, float* out) const {
    dots(w + row * in, x, nt, in, out);
  }
  void fetch(int64_t row) const { prefetch(w + row * in, in * sizeof(float)); }
};

struct Fp4Rows {
  const uint8_t* q;
  const uint8_t* ex;
  int64_t in;
  static int64_t at(int64_t i, int64_t n) { return (i & 1) ? n / 2 + i / 2 : i / 2; }
  void operator()(int64_t row, const float* const* x, int nt, float* out) const {
    qdots(q + row * in / 2, ex + row * in / 32, x, nt, in, out);
  }
  void fetch(int64_t row) const {
    prefetch(q + row * in / 2, in / 2);
    prefetch(ex + row * in / 32, in / 32);
  }
};

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

// out [T, D]: the routed sum for tokens x [T, D] with picks sel, w [T, k]; experts W1, W3
// (E·F rows of D inputs) and W2 (E·D rows of F inputs).
template <typename Rows>
void routed(ffi::ThreadPool& pool, const float* X, const int32_t* sel, const float* W, int64_t T,
            int64_t k, int64_t E, int64_t D, int64_t F, const Rows& w1, const Rows& w3,
            const Rows& w2, float limit, float* O) {
  const int64_t P = T * k;
  Pairs g = group(sel, P, E);
  std::vector<float> Xp(T * D), H(P * F), Y(P * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D; ++i) Xp[t * D + Rows::at(i, D)] = X[t * D + i];
  std::vector<std::pair<int64_t, int64_t>> items;  // (slot, first row)
  for (size_t s = 0; s < g.experts.size(); ++s)
    for (int64_t r = 0; r < F; r += ROWS) items.emplace_back(s, r);
  parallel_for(pool, items.size(), [&](int64_t i) {
    auto [s, r0] = items[i];
    const int64_t e = g.experts[s];
    const auto& ps = g.of[s];
    for (int64_t r = r0; r < std::min(F, r0 + ROWS); ++r) {
      if (r + AHEAD < F) {
        w1.fetch(e * F + r + AHEAD);
        w3.fetch(e * F + r + AHEAD);
      }
      for (size_t p0 = 0; p0 < ps.size(); p0 += NT) {
        const int nt = std::min<size_t>(NT, ps.size() - p0);
        const float* xs[NT];
        float gv[NT], uv[NT];
        for (int q = 0; q < nt; ++q) xs[q] = Xp.data() + (ps[p0 + q] / k) * D;
        w1(e * F + r, xs, nt, gv);
        w3(e * F + r, xs, nt, uv);
        for (int q = 0; q < nt; ++q) {
          const float gq = std::min(gv[q], limit), uq = std::clamp(uv[q], -limit, limit);
          H[ps[p0 + q] * F + Rows::at(r, F)] = gq / (1.0f + std::exp(-gq)) * uq;
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
    const auto& ps = g.of[s];
    for (int64_t r = r0; r < std::min(D, r0 + ROWS); ++r) {
      if (r + AHEAD < D) w2.fetch(e * D + r + AHEAD);
      for (size_t p0 = 0; p0 < ps.size(); p0 += NT) {
        const int nt = std::min<size_t>(NT, ps.size() - p0);
        const float* hs[NT];
        float y[NT];
        for (int q = 0; q < nt; ++q) hs[q] = H.data() + ps[p0 + q] * F;
        w2(e * D + r, hs, nt, y);
        for (int q = 0; q < nt; ++q) Y[ps[p0 + q] * D + r] = y[q];
      }
    }
  });
  for (int64_t t = 0; t < T; ++t) {
    float* o = O + t * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float* y = Y.data() + (t * k + j) * D;
      const float wt = W[t * k + j];
      for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
    }
  }
}

ffi::Error RoutedF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sel,
                     ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> w1,
                     ffi::Buffer<ffi::F32> w3, ffi::Buffer<ffi::F32> w2, float limit,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w1.dimensions();
  const int64_t T = xd[0], D = xd[1], k = sel.dimensions()[1], E = wd[0], F = wd[1];
  if (wd[2] != D || w2.dimensions()[1] != D || w2.dimensions()[2] != F)
    return ffi::Error::InvalidArgument("routed_f32: expert shapes do not match x");
  routed(pool, x.typed_data(), sel.typed_data(), w.typed_data(), T, k, E, D, F,
         DenseRows{w1.typed_data(), D}, DenseRows{w3.typed_data(), D},
         DenseRows{w2.typed_data(), F}, limit, out->typed_data());
  return ffi::Error::Success();
}

ffi::Error RoutedFp4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> sel,
                     ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::U8> w1q,
                     ffi::Buffer<ffi::U8> w1e, ffi::Buffer<ffi::U8> w3q,
                     ffi::Buffer<ffi::U8> w3e, ffi::Buffer<ffi::U8> w2q,
                     ffi::Buffer<ffi::U8> w2e, float limit, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w1q.dimensions();
  const int64_t T = xd[0], D = xd[1], k = sel.dimensions()[1], E = wd[0], F = wd[1];
  if (D % 32 || F % 32 || wd[2] * 2 != D || w2q.dimensions()[1] != D ||
      w2q.dimensions()[2] * 2 != F || w1e.dimensions()[2] * 32 != D ||
      w2e.dimensions()[2] * 32 != F)
    return ffi::Error::InvalidArgument("routed_fp4: expert shapes do not match x");
  routed(pool, x.typed_data(), sel.typed_data(), w.typed_data(), T, k, E, D, F,
         Fp4Rows{w1q.typed_data(), w1e.typed_data(), D},
         Fp4Rows{w3q.typed_data(), w3e.typed_data(), D},
         Fp4Rows{w2q.typed_data(), w2e.typed_data(), F}, limit, out->typed_data());
  return ffi::Error::Success();
}

// y [..., N] = x [..., K] · W [N, K]ᵀ for a few tokens (x's leading dims flattened; W's leading
// dims all 1, as vmap's expand_dims passes an unbatched weight): each row of W read once for
// all of them. With G groups (W [G, N/G, K], x [..., G, K]), row r reads its group's input,
// g = r / (N/G): y [..., G, N/G], the grouped output projection's einsum.
// Rows per work item: at least 64, and no more than `SPANS` items per core, so each thread
// streams long contiguous runs of the weight. The head's GEMV (129,280 rows of 2 KB) in
// items of 64 rows had the two threads take turns through it; in 16 spans, both libraries'
// programs alternating in one process (bench-192m bursts, 40 each): B=1 9.38 → 8.70 ms a
// token, B=4 12.47 → 11.40, B=8 17.09 → 15.84; the head alone 6.4–6.5 → 5.7–5.9 ms at B=1.
constexpr int64_t SPANS = 8;
inline int64_t gemv_rows(int64_t N) {
  const int64_t spans = SPANS * std::min<int64_t>(8, cores());  // the helpers: at most 7
  return std::max<int64_t>(64, (N + spans - 1) / spans);
}

// Rows [r0, r1) of y = x · Wᵀ (see `gemv`).
template <typename W>
void gemv_span(const float* X, const W* Wt, int64_t T, int64_t N, int64_t K, float* Y,
               int64_t G, int64_t r0, int64_t r1) {
  const int64_t per = N / G;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t g = r / per;
    if (r + AHEAD < N) prefetch(Wt + (r + AHEAD) * K, K * sizeof(W));
    for (int64_t t0 = 0; t0 < T; t0 += NT) {
      const int nt = std::min<int64_t>(NT, T - t0);
      const float* xs[NT];
      float y[NT];
      for (int q = 0; q < nt; ++q) xs[q] = X + ((t0 + q) * G + g) * K;
      dots(Wt + r * K, xs, nt, K, y);
      for (int q = 0; q < nt; ++q) Y[(t0 + q) * N + r] = y[q];
    }
  }
}

template <typename W>
void gemv(ffi::ThreadPool& pool, const float* X, const W* Wt, int64_t T, int64_t N, int64_t K,
          float* Y, int64_t G = 1) {
  const int64_t R = gemv_rows(N);
  parallel_for(pool, (N + R - 1) / R, [&](int64_t i) {
    gemv_span(X, Wt, T, N, K, Y, G, i * R, std::min(N, (i + 1) * R));
  });
}

// The two GEMV targets' checks and call: a plain weight [..., N, K] (leading dims all 1) for
// x [..., K], or with `grouped` W [G, O, K] for x [..., G, K] (y [..., G, O]); f32 or bf16.
ffi::Error RunGemv(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::AnyBuffer out, bool grouped) {
  auto xd = x.dimensions(), wd = w.dimensions();
  const size_t own = grouped ? 3 : 2;  // W's own dims: [G,] N, K
  const bool half = w.element_type() == ffi::BF16;
  if (xd.size() + 1 < own || wd.size() < own || x.element_type() != ffi::F32 ||
      (w.element_type() != ffi::F32 && !half))
    return ffi::Error::InvalidArgument("gemv: f32 x [..., (G,) K], f32/bf16 w [(G,) N, K]");
  const int64_t K = xd.back(), N = wd[wd.size() - 2], G = grouped ? xd[xd.size() - 2] : 1;
  if (wd.back() != K || (grouped && wd[wd.size() - 3] != G))
    return ffi::Error::InvalidArgument("gemv: K (or the groups) differ");
  for (size_t i = 0; i + own < wd.size(); ++i)
    if (wd[i] != 1) return ffi::Error::InvalidArgument("gemv: a batched weight");
  const int64_t T = G * K ? x.element_count() / (G * K) : 0;
  const float* X = x.typed_data<float>();
  float* Y = out.typed_data<float>();
  if (half)
    gemv(pool, X, static_cast<const bf16*>(w.untyped_data()), T, G * N, K, Y, G);
  else
    gemv(pool, X, w.typed_data<float>(), T, G * N, K, Y, G);
  return ffi::Error::Success();
}

ffi::Error GemvF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> out) {
  return RunGemv(pool, x, w, *out, false);
}

ffi::Error GemvGroupedF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> out) {
  return RunGemv(pool, x, w, *out, true);
}

// y_m = x · W_mᵀ for several weights of one input (a layer's projections of its normed
// input: the attention's query, key and compressor ones, the MoE's gate and shared
// expert): one call whose work items span all of them, each row's products as `gemv`
// forms them — where a decode layer made 2 to 6 calls and its MoE 3, with XLA's dispatch
// and the threads' start paid for each.
ffi::Error GemvManyF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                       ffi::RemainingRets outs) {
  struct Part {
    const void* w;
    bool half;
    int64_t N;
    float* y;
  };
  if (ws.size() != outs.size() || x.element_type() != ffi::F32 || x.dimensions().size() < 1)
    return ffi::Error::InvalidArgument("gemv_many: f32 x [..., K], one result per weight");
  const int64_t K = x.dimensions().back(), T = K ? x.element_count() / K : 0;
  std::vector<Part> parts;
  int64_t rows = 0;
  for (size_t m = 0; m < ws.size(); ++m) {
    auto w = ws.get<ffi::AnyBuffer>(m);
    auto y = outs.get<ffi::AnyBuffer>(m);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("gemv_many: operands");
    auto wd = w->dimensions();
    const bool half = w->element_type() == ffi::BF16;
    if (wd.size() < 2 || wd.back() != K || (w->element_type() != ffi::F32 && !half))
      return ffi::Error::InvalidArgument("gemv_many: f32/bf16 weights [N, K]");
    for (size_t i = 0; i + 2 < wd.size(); ++i)
      if (wd[i] != 1) return ffi::Error::InvalidArgument("gemv_many: a batched weight");
    const int64_t N = wd[wd.size() - 2];
    parts.push_back({w->untyped_data(), half, N, (*y)->typed_data<float>()});
    rows += N;
  }
  const int64_t R = gemv_rows(rows);
  std::vector<std::pair<size_t, int64_t>> items;  // (weight, first row)
  for (size_t m = 0; m < parts.size(); ++m)
    for (int64_t r = 0; r < parts[m].N; r += R) items.emplace_back(m, r);
  const float* X = x.typed_data<float>();
  parallel_for(pool, items.size(), [&](int64_t i) {
    const auto [m, r0] = items[i];
    const Part& p = parts[m];
    const int64_t r1 = std::min(p.N, r0 + R);
    if (p.half)
      gemv_span(X, static_cast<const bf16*>(p.w), T, p.N, K, p.y, 1, r0, r1);
    else
      gemv_span(X, static_cast<const float*>(p.w), T, p.N, K, p.y, 1, r0, r1);
  });
  return ffi::Error::Success();
}

// The index of each row's largest value, as jnp.argmax picks it: the first maximum, or the
// first NaN if the row has one. XLA:CPU's reduction over a 129,280-token vocabulary took
// 2.5 ms for 8 rows on every decode step (issue 27).
// A row's largest value other than NaN (−inf for none); `nan` set when it holds one.
float row_max(const float* x, int64_t n, bool& nan) {
  float best = -INFINITY;
  nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) best = std::max(best, l);
  nan = _mm256_movemask_ps(un) != 0;
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    else best = std::max(best, x[i]);
  }
  return best;
}

int32_t argmax_row(const float* x, int64_t n) {
  bool nan;
  const float best = row_max(x, n, nan);
  for (int64_t j = 0; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return static_cast<int32_t>(j);
  return 0;
}

ffi::Error ArgmaxF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || x.element_type() != ffi::F32 || out->element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("argmax_f32: f32 [..., V] in, int32 [...] out");
  const int64_t V = xd.back(), rows = V ? x.element_count() / V : 0;
  const float* X = x.typed_data<float>();
  int32_t* Y = out->typed_data<int32_t>();
  parallel_for(pool, rows, [&](int64_t r) { Y[r] = argmax_row(X + r * V, V); });
  return ffi::Error::Success();
}


// e^x for x ≤ 0 (a score less the largest), eight at a time: 2^n·p(r) with r = x − n·ln 2 in
// two parts and Cephes' degree-6 polynomial (within 2 ulp of std::exp), 0 below −87.3, NaN
// kept. std::exp one score at a time took ~40% of a CSA layer's attention at an 8k context;
// the draw takes it for a group of tokens holding a kept one.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);  // NaN stays NaN (max_ps returns its second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e2)));
}
#endif

// The kept weights of tokens [i, i + 8) of a row (8 or fewer: `n` bounds them) into w;
// false when none is kept (w untouched).
inline bool group_weights(const float* x, int64_t i, int64_t n, float t, float top, float floor,
                          float* w) {
#if defined(__AVX2__) && defined(__FMA__)
  if (i + 8 <= n) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 z = t == 1.0f ? v : _mm256_div_ps(v, _mm256_set1_ps(t));  // x / 1 is x
    const __m256 keep = _mm256_cmp_ps(z, _mm256_set1_ps(floor), _CMP_GE_OQ);
    if (_mm256_movemask_ps(keep) == 0) return false;
    _mm256_storeu_ps(w, _mm256_and_ps(keep, exp8(_mm256_sub_ps(z, _mm256_set1_ps(top)))));
    return true;
  }
#endif
  bool any = false;
  for (int64_t j = 0; j < 8; ++j) {
    const float z = i + j < n ? x[i + j] / t : -INFINITY;
    const bool keep = i + j < n && z >= floor;
    w[j] = keep ? std::exp(z - top) : 0.0f;
    any |= keep;
  }
  return any;
}

inline float sum8(const float* w) {
  return ((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7]));
}

// One sampled row's token, as `ds4jax.sampling` draws it without ranking (temperature and
// min-p, the server's default): z = x / t; kept: z ≥ max(z) + log(min_p) (every token when
// min_p ≤ 0); token i drawn when u · Σ kept exp(z − max) falls in [C(i−1), C(i)) of the
// running sums, a target rounded up to the end taking the last token of nonzero weight; a
// row with t ≤ 0 takes its argmax, and so does a row holding a NaN. The sums run over
// groups of 8 tokens (each group's weights added in f32, the groups in f64), exp taken only
// in groups holding a kept token — XLA took it over the whole vocabulary, 5 ms for 8 rows
// of 129,280 on a decode step (issue 27). The twin (`_kept`'s unranked mask, then
// `draw_rows`) sums in f32 blocks of 1,024, so the two can differ only where the target lies
// within rounding of a boundary.
int32_t draw_row(const float* x, int64_t n, float u, float t, float min_p) {
  if (!(t > 0.0f) || n == 0) return argmax_row(x, n);
  bool nan;
  const float mx = row_max(x, n, nan);
  // division by t > 0 keeps the order, so max(x / t) is max(x) / t, rounded the same way
  const float top = mx / t;
  if (nan || !std::isfinite(top)) return argmax_row(x, n);
  const float floor = min_p > 0.0f ? top + std::log(min_p) : -INFINITY;
  alignas(32) float w[8];
  // each group's summed weights (0: none kept), so the search reads them, not exp again
  thread_local std::vector<float> groups;
  const int64_t G = (n + 7) / 8;
  groups.assign(G, 0.0f);
  double total = 0.0;
  for (int64_t g = 0; g < G; ++g)
    if (group_weights(x, 8 * g, n, t, top, floor, w)) total += groups[g] = sum8(w);
  const double target = static_cast<double>(u) * total;
  double c = 0.0;
  int64_t g = 0, last = -1;  // last: the last group with weight before the target's
  for (; g < G; ++g) {
    if (!(groups[g] > 0.0f)) continue;
    if (c + groups[g] > target) break;
    c += groups[g];
    last = g;
  }
  if (g == G) {  // rounded past the end: the last token of nonzero weight
    if (last < 0) return argmax_row(x, n);
    g = last;
    c = -INFINITY;
  }
  group_weights(x, 8 * g, n, t, top, floor, w);
  int32_t token = -1;
  for (int64_t j = 0; j < 8; ++j) {
    if (!(w[j] > 0.0f)) continue;
    c += w[j];
    token = static_cast<int32_t>(8 * g + j);
    if (c > target) break;
  }
  return token;  // the target's token, or (rounded past it) its group's last weighted one
}

ffi::Error DrawF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer u, ffi::AnyBuffer t,
                   ffi::AnyBuffer min_p, ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions();
  const int64_t V = xd.size() ? xd.back() : 0, rows = V ? x.element_count() / V : 0;
  for (const ffi::AnyBuffer* b : {&x, &u, &t, &min_p})
    if (b->element_type() != ffi::F32)
      return ffi::Error::InvalidArgument("draw_f32: f32 logits, uniforms, temperatures, min-p");
  if (xd.size() < 1 || out->element_type() != ffi::S32 || u.element_count() != rows ||
      t.element_count() != rows || min_p.element_count() != rows || out->element_count() != rows)
    return ffi::Error::InvalidArgument("draw_f32: logits [..., V]; the rest [...]");
  const float *X = x.typed_data<float>(), *U = u.typed_data<float>(),
              *Tt = t.typed_data<float>(), *M = min_p.typed_data<float>();
  int32_t* Y = out->typed_data<int32_t>();
  parallel_for(pool, rows, [&](int64_t r) { Y[r] = draw_row(X + r * V, V, U[r], Tt[r], M[r]); });
  return ffi::Error::Success();
}

// Rows of a table [V, D] (f32, or bf16 widened exactly) at int32 indices as f32 [..., D]:
// the embedding lookup. XLA:CPU gathers bf16 by converting the whole table to f32 first, and
// inside a loop (`model.batch.burst`) hoists that convert out as loop-invariant: 265 MB
// written per call on bench-192m. Indices as `table[idx]` takes them: a negative one counts
// from the end, then each is clamped into [0, V).
template <typename W>
void copy_rows(const W* table, const int32_t* idx, int64_t n, int64_t V, int64_t D, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    int64_t i = idx[r] < 0 ? idx[r] + V : idx[r];
    i = std::min(std::max<int64_t>(i, 0), V - 1);
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = widen(table[i * D + d]);
  }
}

ffi::Error RowsF32(ffi::AnyBuffer table, ffi::AnyBuffer idx, ffi::Result<ffi::AnyBuffer> out) {
  auto td = table.dimensions();
  if (td.size() < 2 || idx.element_type() != ffi::S32 || out->element_type() != ffi::F32 ||
      (table.element_type() != ffi::F32 && table.element_type() != ffi::BF16))
    return ffi::Error::InvalidArgument("rows_f32: f32 or bf16 [V, D], int32 indices, f32 out");
  const int64_t V = td[td.size() - 2], D = td.back(), n = idx.element_count();
  if (V < 1 || table.element_count() != V * D || out->element_count() != n * D)
    return ffi::Error::InvalidArgument("rows_f32: shapes do not agree");
  const int32_t* I = idx.typed_data<int32_t>();
  float* Y = out->typed_data<float>();
  if (table.element_type() == ffi::F32)
    copy_rows(table.typed_data<float>(), I, n, V, D, Y);
  else
    copy_rows(reinterpret_cast<const bf16*>(table.untyped_data()), I, n, V, D, Y);
  return ffi::Error::Success();
}

// The CSA indexer's picks (issue 27): a row c's score for query t is
// Σ_h w[t, h] · relu(q[t, h]·rows[c]) / √d where visible[t, c], else −∞, and the query keeps
// its k best rows as `jax.lax.top_k` orders them (larger first, NaN largest, −0 below +0,
// ties by the lower index). XLA transposed the rows every step before a batched product and
// ran a generic top-k (~0.2 ms per CSA layer at an 8k context). The twins:
// `pallas_kernels.indexer_scores_reference` and `jax.lax.top_k`.
#if defined(__AVX2__) && defined(__FMA__)
// the eight sums of a[0…7]'s lanes, in one vector
inline __m256 sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif

// one row's score for one query: heads in groups of eight, each group's products in one
// fixed order, the groups summed in head order
float index_score(const float* q, const float* w, const float* row, int64_t IH, int64_t d,
                  float scale) {
  float total = 0.0f;
  int64_t h = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (; h + 8 <= IH; h += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 r = _mm256_loadu_ps(row + i);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (h + j) * d + i), r, acc[j]);
      }
      const __m256 dots = _mm256_max_ps(sum8(acc), _mm256_setzero_ps());
      total += hsum(_mm256_mul_ps(_mm256_mul_ps(dots, _mm256_set1_ps(scale)),
                                  _mm256_loadu_ps(w + h)));
    }
  }
#endif
  for (; h < IH; ++h) {
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot = std::fma(q[h * d + i], row[i], dot);
    total += std::max(dot, 0.0f) * scale * w[h];
  }
  return total;
}

// `top_k`'s order as one unsigned key: NaN largest, then the floats' total order
inline uint32_t order_key(float v) {
  if (std::isnan(v)) return 0xFFFFFFFFu;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// the k best of s[0…C) in `top_k`'s order (ties by the lower index), without comparisons
// (a comparison sort's unpredictable branches cost ~35 µs for 2,059 scores): the k-th best
// key found a byte at a time from the top, the keys above it and the first ties taken in
// index order, then those k sorted by key, a byte at a time from the bottom, stably
// counts of byte `shift` of key[at(i)] for i < n in hist[256], over four tables summed at the
// end (keys share their top bytes: one table's increments would wait on each other)
template <typename At>
void byte_counts(const uint32_t* key, At at, int64_t n, int shift, int64_t* hist) {
  int64_t h[4][256] = {};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) ++h[j][(key[at(i + j)] >> shift) & 255];
  for (; i < n; ++i) ++h[0][(key[at(i)] >> shift) & 255];
  for (int b = 0; b < 256; ++b) hist[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

void top_k_row(const float* s, int64_t C, int64_t k, float* values, int32_t* indices) {
  if (k <= 0) return;
  thread_local std::vector<uint32_t> key_buf;
  thread_local std::vector<int32_t> idx_buf;
  key_buf.resize(C);
  idx_buf.resize(C + 2 * k);
  uint32_t* key = key_buf.data();
  int32_t *cand = idx_buf.data(), *idx = cand + C, *tmp = idx + k;
  for (int64_t c = 0; c < C; ++c) key[c] = order_key(s[c]);
  // the k-th best key: `need` more keys equal to `prefix` in the bytes found so far, among
  // the n candidates left (all C on the first pass, read in place)
  uint32_t prefix = 0;
  int64_t need = k, n = C;
  for (int shift = 24; shift >= 0; shift -= 8) {
    const bool all = shift == 24;
    int64_t hist[256];
    if (all) byte_counts(key, [](int64_t i) { return i; }, n, shift, hist);
    else byte_counts(key, [cand](int64_t i) { return cand[i]; }, n, shift, hist);
    uint32_t b = 255;
    for (; b > 0 && hist[b] < need; --b) need -= hist[b];
    prefix |= b << shift;
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t c = all ? static_cast<int32_t>(i) : cand[i];
      cand[m] = c;
      m += ((key[c] >> shift) & 255) == b;
    }
    n = m;
  }
  int64_t m = 0;
  for (int64_t c = 0; c < C; ++c) {
    const bool tie = key[c] == prefix, take = (key[c] > prefix) | (tie & (need > 0));
    need -= tie;
    idx[m] = static_cast<int32_t>(c);
    m += take;
  }
  // larger keys first, equal keys in index order: stable passes, the larger bytes first
  for (int shift = 0; shift < 32; shift += 8) {
    int64_t count[256], at[256], run = 0;
    byte_counts(key, [idx](int64_t j) { return idx[j]; }, k, shift, count);
    if (count[(key[idx[0]] >> shift) & 255] == k) continue;  // one byte for all: in order
    for (int b = 255; b >= 0; --b) {
      at[b] = run;
      run += count[b];
    }
    for (int64_t j = 0; j < k; ++j) tmp[at[(key[idx[j]] >> shift) & 255]++] = idx[j];
    std::swap(idx, tmp);
  }
  for (int64_t j = 0; j < k; ++j) {
    indices[j] = idx[j];
    values[j] = s[idx[j]];
  }
}

ffi::Error IndexTopF32(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer w,
                       ffi::AnyBuffer rows, ffi::AnyBuffer visible,
                       ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> indices) {
  auto qd = q.dimensions(), rd = rows.dimensions(), vd = indices->dimensions();
  if (qd.size() < 3 || rd.size() < 2 || vd.size() < 2)
    return ffi::Error::InvalidArgument("index_top_f32: operand ranks");
  if (q.element_type() != ffi::F32 || w.element_type() != ffi::F32 ||
      rows.element_type() != ffi::F32 || visible.element_type() != ffi::PRED ||
      values->element_type() != ffi::F32 || indices->element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("index_top_f32: f32 q, w, rows; bool visible");
  const int64_t T = qd[qd.size() - 3], IH = qd[qd.size() - 2], d = qd.back();
  const int64_t C = rd[rd.size() - 2], k = vd.back();
  const int64_t B = T * IH * d ? q.element_count() / (T * IH * d) : 0;
  if (rd.back() != d || rows.element_count() != B * C * d || w.element_count() != B * T * IH ||
      visible.element_count() != B * T * C || indices->element_count() != B * T * k ||
      values->element_count() != B * T * k || k > C)
    return ffi::Error::InvalidArgument("index_top_f32: shapes do not agree");
  const float* Q = q.typed_data<float>();
  const float* Wt = w.typed_data<float>();
  const float* Rw = rows.typed_data<float>();
  const bool* V = visible.typed_data<bool>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> score(B * T * C);
  constexpr int64_t CB = 128;  // rows per work item
  const int64_t blocks = (C + CB - 1) / CB;
  parallel_for(pool, B * T * blocks, [&](int64_t item) {
    const int64_t bt = item / blocks, b = bt / T, c0 = (item % blocks) * CB;
    const float* qt = Q + bt * IH * d;
    const float* wt = Wt + bt * IH;
    for (int64_t c = c0; c < std::min(C, c0 + CB); ++c)
      score[bt * C + c] = V[bt * C + c] ? index_score(qt, wt, Rw + (b * C + c) * d, IH, d, scale)
                                        : -INFINITY;
  });
  float* Yv = values->typed_data<float>();
  int32_t* Yi = indices->typed_data<int32_t>();
  parallel_for(pool, B * T, [&](int64_t bt) {
    top_k_row(score.data() + bt * C, C, k, Yv + bt * k, Yi + bt * k);
  });
  return ffi::Error::Success();
}

// `jax.lax.top_k` of f32 rows [..., C] → values, indices [..., k]. XLA:CPU's generic TopK
// took ~48 µs a row for a prefill chunk's indexer scores (512 rows of 2,059 keeping 512:
// 1.2 s of an 8,192-token prefill's 7.3 s, issue 27); a selection then a sort of the k kept.
ffi::Error TopKF32(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                   ffi::Result<ffi::AnyBuffer> indices) {
  auto xd = x.dimensions(), vd = values->dimensions();
  if (xd.size() < 1 || vd.size() != xd.size() || x.element_type() != ffi::F32 ||
      values->element_type() != ffi::F32 || indices->element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("top_k_f32: f32 [..., C] in, f32 and int32 [..., k] out");
  const int64_t C = xd.back(), k = vd.back(), rows = C ? x.element_count() / C : 0;
  if (k > C || values->element_count() != rows * k || indices->element_count() != rows * k)
    return ffi::Error::InvalidArgument("top_k_f32: shapes do not agree");
  const float* X = x.typed_data<float>();
  float* Yv = values->typed_data<float>();
  int32_t* Yi = indices->typed_data<int32_t>();
  parallel_for(pool, rows, [&](int64_t r) { top_k_row(X + r * C, C, k, Yv + r * k, Yi + r * k); });
  return ffi::Error::Success();
}

// The dot of two rows with four accumulators (a fixed order: a query's score does not
// depend on what else shares the call).
inline float dot4(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  for (; i + 32 <= n; i += 32) {
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
    c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), c1);
    c2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), c2);
    c3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), c3);
  }
  for (; i + 8 <= n; i += 8)
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
  s = hsum(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// A head's scores s[n] (n a multiple of 8, padded with −∞) → e = exp(s − m) in place, m the
// largest of them and the sink's; returns exp(sink − m) + Σ e.
float softmax_numerators(float* s, int64_t n, float sink) {
  float m = sink;
  for (int64_t k = 0; k < n; ++k) m = std::max(m, s[k]);
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mv));
    _mm256_storeu_ps(s + k, e);
    acc = _mm256_add_ps(acc, e);
  }
  return _mm256_cvtss_f32(exp8(_mm256_set1_ps(sink - m))) + hsum(acc);
#else
  float d = std::exp(sink - m);
  for (int64_t k = 0; k < n; ++k) d += (s[k] = std::exp(s[k] - m));
  return d;
#endif
}

constexpr int64_t PREFETCH = 6;  // keys ahead

// y[D] = Σ_k e[k]·rows[k][D] in k order, 64 outputs at a time held in registers
void weighted_rows(const float* e, const float* const* rows, int64_t n, int64_t D, float* y) {
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      const __m256 ek = _mm256_set1_ps(e[k]);
      const float* row = rows[k] + d0;
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(ek, _mm256_loadu_ps(row + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + d0 + 8 * j, acc[j]);
  }
#endif
  for (int64_t d = d0; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t k = 0; k < n; ++k) acc = std::fma(e[k], rows[k][d], acc);
    y[d] = acc;
  }
}

// o[…, t, h] = (Σ_k e_k·key_k) / (exp(sink_h − m) + Σ_k e_k), e_k = exp(s_k − m), s_k =
// q·key_k / √D over the keys a query sees, m the largest of them and the sink (the twin:
// `pallas_kernels.sink_attention_reference`, and `sparse_attention_reference` for picks).
// The keys: raw [K1, D] where m1 [T, K1], own [K2, D] where m2 [T, K2], and comp's rows
// pick [T, P] where ok [T, P]. Every operand may carry the same leading batch dims (vmap
// broadcasts them all); the sink may also be one [H] for all.
ffi::Error Attend(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer raw, ffi::AnyBuffer m1,
                  ffi::AnyBuffer own, ffi::AnyBuffer m2, ffi::AnyBuffer comp, ffi::AnyBuffer pick,
                  ffi::AnyBuffer ok, ffi::AnyBuffer sink, ffi::AnyBuffer* slot, float* Y,
                  float* raw_out) {
  auto qd = q.dimensions(), rd = raw.dimensions(), od = own.dimensions(),
       cd = comp.dimensions(), pd = pick.dimensions();
  if (qd.size() < 3 || rd.size() < 2 || od.size() < 2 || cd.size() < 2 || pd.size() < 2)
    return ffi::Error::InvalidArgument("attend_f32: operand ranks");
  for (auto* b : {&q, &raw, &own, &comp, &sink})
    if (b->element_type() != ffi::F32) return ffi::Error::InvalidArgument("attend_f32: f32");
  if (m1.element_type() != ffi::PRED || m2.element_type() != ffi::PRED ||
      ok.element_type() != ffi::PRED || pick.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("attend_f32: masks bool, picks int32");
  const int64_t T = qd[qd.size() - 3], H = qd[qd.size() - 2], D = qd.back();
  const int64_t K1 = rd[rd.size() - 2], K2 = od[od.size() - 2], C = cd[cd.size() - 2],
                P = pd.back();
  const int64_t B = T * H * D ? q.element_count() / (T * H * D) : 0;
  if (rd.back() != D || od.back() != D || cd.back() != D ||
      raw.element_count() != B * K1 * D || own.element_count() != B * K2 * D ||
      comp.element_count() != B * C * D || m1.element_count() != B * T * K1 ||
      m2.element_count() != B * T * K2 || pick.element_count() != B * T * P ||
      ok.element_count() != B * T * P ||
      (sink.element_count() != H && sink.element_count() != B * H) || H > 64)
    return ffi::Error::InvalidArgument("attend_f32: shapes do not agree (or over 64 heads)");
  const float* Q = q.typed_data<float>();
  const float* R = raw.typed_data<float>();
  const float* O = own.typed_data<float>();
  const float* Cm = comp.typed_data<float>();
  const bool* M1 = m1.typed_data<bool>();
  const bool* M2 = m2.typed_data<bool>();
  const int32_t* Pk = pick.typed_data<int32_t>();
  const bool* Ok = ok.typed_data<bool>();
  const float* S = sink.typed_data<float>();
  const bool sink_rows = sink.element_count() != H;
  if (slot && (slot->element_type() != ffi::S32 || slot->element_count() != B * K2))
    return ffi::Error::InvalidArgument("attend_f32: a slot (int32) for each own key");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // one item: a query token and a group of its heads, so each key is read from memory once
  // for the group (a decode step of one row splits its heads over two threads)
  const int64_t HG = B * T >= 2 ? H : (H + 1) / 2, groups = (H + HG - 1) / HG;
  parallel_for(pool, B * T * groups, [&](int64_t item) {
    const int64_t bt = item / groups, b = bt / T, t = bt % T;
    const int64_t h0 = (item % groups) * HG, h1 = std::min(H, h0 + HG), nh = h1 - h0;
    thread_local std::vector<const float*> keys;
    thread_local std::vector<float> s;
    keys.clear();
    for (int64_t k = 0; k < K1; ++k)
      if (M1[bt * K1 + k]) keys.push_back(R + (b * K1 + k) * D);
    for (int64_t k = 0; k < K2; ++k)
      if (M2[bt * K2 + k]) keys.push_back(O + (b * K2 + k) * D);
    for (int64_t k = 0; k < P; ++k) {
      const int64_t at = bt * P + k;
      if (Ok[at] && Pk[at] >= 0 && Pk[at] < C) keys.push_back(Cm + (b * C + Pk[at]) * D);
    }
    const int64_t nk = keys.size(), nk8 = (nk + 7) / 8 * 8;
    s.assign(nh * nk8, -INFINITY);  // a head's scores padded to whole vectors: e = 0 there
    const float* qv = Q + (bt * H + h0) * D;
    for (int64_t k = 0; k < nk; ++k) {  // scores [nh, nk8]
#if defined(__AVX2__)
      // the picked rows lie anywhere in the compressed rows: fetch a few keys ahead
      if (k + PREFETCH < nk)
        for (int64_t d = 0; d < D; d += 16)
          _mm_prefetch(reinterpret_cast<const char*>(keys[k + PREFETCH] + d), _MM_HINT_T0);
#endif
      for (int64_t h = 0; h < nh; ++h) s[h * nk8 + k] = dot4(qv + h * D, keys[k], D) * scale;
    }
    float denom[64];  // H ≤ 64 (checked above)
    for (int64_t h = 0; h < nh; ++h)
      denom[h] = softmax_numerators(&s[h * nk8], nk8, S[sink_rows ? b * H + h0 + h : h0 + h]);
    float* y = Y + (bt * H + h0) * D;
    for (int64_t h = 0; h < nh; ++h) {
      weighted_rows(&s[h * nk8], keys.data(), nk, D, y + h * D);
      for (int64_t d = 0; d < D; ++d) y[h * D + d] /= denom[h];
    }
  });
  if (!slot) return ffi::Error::Success();
  // the ring after the step: every query has read it, so its own keys go in now, in place
  // where XLA aliased the result to the operand (a copy first where it did not)
  if (raw_out != R) std::memcpy(raw_out, R, sizeof(float) * B * K1 * D);
  const int32_t* Sl = slot->typed_data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < K2; ++j) {
      const int32_t at = Sl[b * K2 + j];
      if (at >= 0 && at < K1)
        std::memcpy(raw_out + (b * K1 + at) * D, O + (b * K2 + j) * D, sizeof(float) * D);
    }
  return ffi::Error::Success();
}

ffi::Error AttendF32(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer raw,
                     ffi::AnyBuffer m1, ffi::AnyBuffer own, ffi::AnyBuffer m2,
                     ffi::AnyBuffer comp, ffi::AnyBuffer pick, ffi::AnyBuffer ok,
                     ffi::AnyBuffer sink, ffi::Result<ffi::AnyBuffer> out) {
  return Attend(pool, q, raw, m1, own, m2, comp, pick, ok, sink, nullptr,
                out->typed_data<float>(), nullptr);
}

// The same, and the raw ring returned with the step's own keys written to their slots
// (`slot` [..., T'], one per own key; outside the ring: not written) — `layers.ring_write`
// done in place, so XLA needs no copy of a ring that the attention reads and the step
// updates (two copies of each ring per layer and step at B=8 before).
ffi::Error AttendWriteF32(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer raw,
                          ffi::AnyBuffer m1, ffi::AnyBuffer own, ffi::AnyBuffer m2,
                          ffi::AnyBuffer comp, ffi::AnyBuffer pick, ffi::AnyBuffer ok,
                          ffi::AnyBuffer sink, ffi::AnyBuffer slot,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ring) {
  if (ring->element_type() != ffi::F32 || ring->element_count() != raw.element_count())
    return ffi::Error::InvalidArgument("attend_f32: the ring's result is the ring's shape");
  return Attend(pool, q, raw, m1, own, m2, comp, pick, ok, sink, &slot,
                out->typed_data<float>(), ring->typed_data<float>());
}

}  // namespace

// A binding on XLA's thread pool with `N` untyped operands (each kernel checks its own).
// (Built in one expression: a binding cannot be moved once named.)
template <int N>
auto AnyArgs() {
  if constexpr (N == 0)
    return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>();
  else
    return AnyArgs<N - 1>().template Arg<ffi::AnyBuffer>();
}

// x, w → y
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_gemv_f32, GemvF32, AnyArgs<2>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_gemv_grouped_f32, GemvGroupedF32,
                              AnyArgs<2>().Ret<ffi::AnyBuffer>());

// x, w_1 … w_M → y_1 … y_M
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_gemv_many_f32, GemvManyF32,
                              AnyArgs<1>().RemainingArgs().RemainingRets());

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_routed_fp4, RoutedFp4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<float>("limit")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_argmax_f32, ArgmaxF32, AnyArgs<1>().Ret<ffi::AnyBuffer>());

// logits, uniforms, temperatures, min-p → tokens
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_draw_f32, DrawF32, AnyArgs<4>().Ret<ffi::AnyBuffer>());

// the attention kernels' nine operands (q, raw, m1, own, m2, comp, pick, ok, sink); the
// writing one's slot tenth
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_attend_f32, AttendF32, AnyArgs<9>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_attend_write_f32, AttendWriteF32,
                              AnyArgs<10>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// q, w, rows, visible → values, indices
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_index_top_f32, IndexTopF32,
                              AnyArgs<4>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// table, indices → rows
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_rows_f32, RowsF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// x → values, indices
XLA_FFI_DEFINE_HANDLER_SYMBOL(ds4jax_top_k_f32, TopKF32,
                              AnyArgs<1>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
