// CPU kernels of gtpo_kernels, registered as torch operators in the `gtpo_cpu` namespace:
//
//   token_stats_forward(logits [N, L, V], ids [N, L], valid [N, L], inv_temperature) -> (row_max, log_s, logp, H)
//       float32 [N, L], the statistics of softmax(logits * inv_temperature); zeros where masked;
//       lse = row_max * inv_temperature + log_s; inv_temperature: float32, one element (every token) or [N, L]
//       (each token's: mixed-temperature rollouts), read per row inside the loop (no scaled copy of the logits)
//   token_stats_backward(logits, ids, valid, row_max, log_s, logp, H, grad_logp, grad_H, inv_temperature, out)
//       out = inv_temperature * (grad_logp (onehot(y) - p) + grad_H dH/du), dH/du = -p (log p + H),
//       u = logits * inv_temperature; out may be logits itself (each element is read before written)
//   conflict_weights(ids [N, L], lengths [N], advantages [N], group_size, weight) -> (lambda [N, L], n [N])
//
// logits: float32, bfloat16 or float16 with a contiguous last dimension (other strides are free).
// Parallel over tokens (at::parallel_for), SIMD within a row (at::vec). Every token is handled by one
// thread in a fixed order, so results are bitwise the same whatever the number of threads.
//
// The forward reads each logit from memory once: the row is walked in blocks of kBlock values (an online
// softmax at block granularity). A block whose values all lie below the running max (after a row's first
// blocks, nearly every block) is summed in one sweep that also takes its max (block_sums_below); a block that
// reaches the running max, or holds a NaN, is done again by two sweeps over it in L1, a max sweep and an exp
// sweep. Two sweeps per block left the memory idle while the second one computed, and the hardware's
// prefetch idle with it: one sweep lets the reads run under the arithmetic, which is then the forward's limit
// (bench/results/cpu-kernels-avx2*.md; the AVX-512 build has its own sweep with fewer instructions a logit,
// bench/results/cpu-forward-avx512*.md). Each block's sums are reduced across lanes and added to
// double-precision running totals, so rounding does not grow with the vocabulary (a lane summing V / 16
// terms one after another lost 5e-5 at V = 151936).
//
// Built once per instruction set (CPU_CAPABILITY = DEFAULT, AVX2, AVX512; see
// gtpo_kernels/backends/cpu_build.py); Python loads the one the machine supports.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 1024;  // values per block: 4 KiB of float32, well inside L1

// Horizontal max / sum of a vector, lanes in a fixed order (deterministic).
float lanes_max(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int k = 1; k < Vec::size(); ++k) m = std::max(m, lanes[k]);
  return m;
}
double lanes_sum(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  double s = 0.0;
  for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  return s;
}

// A block of a row as float32: float32 rows are read in place, half precision converted into buf.
template <typename scalar_t>
const float* block_as_float(const scalar_t* src, int64_t n, float* buf) {
  at::vec::convert(src, buf, n);
  return buf;
}
template <>
const float* block_as_float<float>(const float* src, int64_t, float*) {
  return src;
}

struct RowStats {
  float entropy;
  float shift;   // the max m of z (0 for an all -inf row)
  double log_s;  // lse = shift * inv_t + log_s
};

// Sums of one block's values below the running max: s += e and w += e d, e = exp(d), d = (z - shift) * inv_t.
// kTops: the block holds values equal to the max (e = 1 exactly), counted apart in `tops` because, added
// to a lane's float sum, a 1 swamps the small terms, and s = 1 + delta is where a confident token's
// log-prob lives. Other blocks take the cheaper loop. kScaled: T != 1.
template <bool kTops, bool kScaled>
void block_sums(const float* z, int64_t n, float shift, float inv_t, double& s, double& w, double& tops) {
  const int64_t n_vec = n - n % Vec::size();
  const Vec vshift(shift), vinv(inv_t), zero(0.f), one(1.f);
  // e = 0 below ln(FLT_MIN) ~ -87.3; clamping d there keeps e d = 0 for banned tokens (z = -inf) instead
  // of 0 * -inf = NaN (clamp_min lets a NaN through).
  const Vec floor_d(-88.f);
  Vec vs(0.f), vw(0.f), vtop(0.f);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) {
    Vec d = Vec::loadu(z + i) - vshift;
    if (kScaled) d = d * vinv;
    const Vec e = d.exp_u20();  // a few ulp; the sums' error stays below float32's spacing of log s
    if (kTops) {
      const Vec top = d == zero;
      vtop = vtop + (top & one);
      vs = vs + Vec::blendv(e, zero, top);
    } else {
      vs = vs + e;
    }
    vw = at::vec::fmadd(e, at::vec::clamp_min(d, floor_d), vw);
  }
  double s_block = lanes_sum(vs), w_block = lanes_sum(vw), tops_block = kTops ? lanes_sum(vtop) : 0.0;
  for (int64_t i = n_vec; i < n; ++i) {
    const float d = (z[i] - shift) * inv_t;
    if (kTops && d == 0.f) {
      tops_block += 1.0;
      continue;
    }
    const float e = std::exp(d);
    s_block += e;
    w_block += z[i] == kNegInf ? 0.0 : static_cast<double>(e) * d;
  }
  s += s_block;
  w += w_block;
  tops += tops_block;
}

#if !defined(CPU_CAPABILITY_AVX512)
// 2^n for t = n + kRoundBias as float32 (n an integer in [-126, 127] held in t's low mantissa bits): those bits
// shifted into the exponent field.
inline Vec exponent_from_rounded(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX2)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
#else
  float lanes[Vec::size()];
  t.store(lanes);
  for (int k = 0; k < Vec::size(); ++k) {
    uint32_t bits;
    std::memcpy(&bits, &lanes[k], sizeof(bits));
    bits <<= 23;
    std::memcpy(&lanes[k], &bits, sizeof(bits));
  }
  return Vec::loadu(lanes);
#endif
}
#endif

// t = x + kRoundBias rounds x in [-126, 0] to an integer n and keeps n + 127 (2^n's biased exponent) in the low
// bits of t's mantissa: 1.5 * 2^23 is where float32's spacing is 1.
constexpr float kRoundBias = 12582912.f + 127.f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr double kLn2 = 0.693147180559945309;

struct BlockBelow {
  float block_max;  // the block's max (NaNs are seen by s instead)
  double s, w;      // sum e and sum e d, e = exp(d), d = (z - m) * inv_t
};

// Two vectors of float32 from 2 * Vec::size() logits (half precision widened in registers).
template <typename scalar_t>
std::tuple<Vec, Vec> load_pair(const scalar_t* src) {
  return at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(src));
}
template <>
std::tuple<Vec, Vec> load_pair<float>(const float* src) {
  return {Vec::loadu(src), Vec::loadu(src + Vec::size())};
}

// A block's values from `from` on (past its last full vector step), one by one, added to the vector part's sums.
template <typename scalar_t>
BlockBelow with_tail(const scalar_t* z, int64_t from, int64_t n, float m, float inv_t, BlockBelow sums) {
  for (int64_t i = from; i < n; ++i) {
    const float zi = static_cast<float>(z[i]);
    sums.block_max = std::max(sums.block_max, zi);
    const float d = (zi - m) * inv_t;
    const float e = std::exp(d);
    sums.s += e;
    sums.w += zi == kNegInf ? 0.0 : static_cast<double>(e) * d;
  }
  return sums;
}

#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 build's one sweep (the same contract as the version below). It does fewer instructions per logit,
// which is this sweep's limit: exp(d) = 2^x, x = d log2(e), with x rounded to k, a multiple of 1/32, by adding
// kRoundBias32 (its low 5 mantissa bits then index a table of 2^(j/32), j = 32 k mod 32); r = x - k in
// [-1/64, 1/64] (one fused multiply-subtract from d, the product exact); 2^r by a degree-2 polynomial fitted for
// least relative error (5.3e-8 on that range; 2.2e-7 through the float32 steps, as the degree-5 version below);
// 2^floor(k) applied by scalef. The lanes' order of bfloat16 pairs differs (even words, then odd): a sum and a max
// do not care. d is clamped where x = -125 (a banned token's e is 2^-125, below float32's spacing of any s >= 1);
// max(floor, d) returns d when d is NaN, so a NaN reaches s.
constexpr float kRoundBias32 = 393216.f;  // 1.5 * 2^18: float32's spacing there is 1/32
constexpr float kExp2P2 = 0.240224749f, kExp2P1 = 0.693157315f;

struct Exp2Table {
  __m512 lo, hi;  // 2^(j/32) for j = 0..15 and 16..31
};
const Exp2Table& exp2_table() {
  static const Exp2Table table = [] {
    alignas(64) float v[32];
    for (int j = 0; j < 32; ++j) v[j] = static_cast<float>(std::exp2(j / 32.0));
    return Exp2Table{_mm512_load_ps(v), _mm512_load_ps(v + 16)};
  }();
  return table;
}

// Two vectors of float32 from 32 logits. bfloat16 is float32's upper half: the even values are the 32-bit words
// shifted left by 16, the odd ones the words with their low half cleared, one instruction a vector.
template <typename scalar_t>
std::tuple<__m512, __m512> load_pair_512(const scalar_t* src) {
  const auto [a, b] = load_pair(src);
  return {a, b};
}
template <>
std::tuple<__m512, __m512> load_pair_512<at::BFloat16>(const at::BFloat16* src) {
  const __m512i words = _mm512_loadu_si512(src);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

template <typename scalar_t>
BlockBelow block_sums_below(const scalar_t* z, int64_t n, float m, float inv_t) {
  constexpr int64_t kStep = 32;
  const int64_t n_vec = n - n % kStep;
  const float scale = inv_t * kLog2e;
  const Exp2Table& table = exp2_table();
  const __m512 vm = _mm512_set1_ps(m), vscale = _mm512_set1_ps(scale), floor_d = _mm512_set1_ps(-125.f / scale),
               bias = _mm512_set1_ps(kRoundBias32), p2 = _mm512_set1_ps(kExp2P2), p1 = _mm512_set1_ps(kExp2P1),
               one = _mm512_set1_ps(1.f);
  __m512 vmax0 = _mm512_set1_ps(kNegInf), vmax1 = vmax0, vs0 = _mm512_setzero_ps(), vs1 = vs0, vw0 = vs0, vw1 = vs0;
  auto accumulate = [&](const __m512 zi, __m512& vmax, __m512& vs, __m512& vw) {
    vmax = _mm512_max_ps(vmax, zi);
    const __m512 d = _mm512_max_ps(floor_d, _mm512_sub_ps(zi, vm));
    const __m512 t = _mm512_fmadd_ps(d, vscale, bias);
    const __m512 k = _mm512_sub_ps(t, bias);
    const __m512 r = _mm512_fmsub_ps(d, vscale, k);
    const __m512 two_j = _mm512_permutex2var_ps(table.lo, _mm512_castps_si512(t), table.hi);
    const __m512 poly = _mm512_fmadd_ps(_mm512_fmadd_ps(p2, r, p1), r, one);
    const __m512 e = _mm512_scalef_ps(_mm512_mul_ps(poly, two_j), k);
    vs = _mm512_add_ps(vs, e);
    vw = _mm512_fmadd_ps(e, d, vw);
  };
  for (int64_t i = 0; i < n_vec; i += kStep) {
    __builtin_prefetch(z + i + 2048);  // as in the version below
    const auto [z0, z1] = load_pair_512(z + i);
    accumulate(z0, vmax0, vs0, vw0);
    accumulate(z1, vmax1, vs1, vw1);
  }
  // Reduced in float32 (a fixed tree, so deterministic; each lane holds 32 terms) before the double totals: lane
  // by lane into doubles, as the version below does, was a visible share of a block's time here.
  float block_max = _mm512_reduce_max_ps(_mm512_max_ps(vmax0, vmax1));
  double s = _mm512_reduce_add_ps(_mm512_add_ps(vs0, vs1));
  double w = static_cast<double>(_mm512_reduce_add_ps(_mm512_add_ps(vw0, vw1))) * inv_t;
  return with_tail(z, n_vec, n, m, inv_t, {block_max, s, w});
}
#else
// The one-sweep sums of a block all of whose values lie below the running max m, the common case after a row's
// first blocks: the block's max is taken in the same sweep and checked afterwards (a block that reaches m, or
// holds a NaN, is done again by the two-sweep path). exp(d) = 2^x, x = d log2(e): x = n + r with n = round(x),
// r in [-1/2, 1/2], 2^r by a degree-5 polynomial fitted for least relative error on that range (held to the
// float64 oracle by tests/test_cpu_one_sweep.py), 2^n put in the exponent bits. x is clamped at -125 (2^-125 =
// 2.4e-38 for a banned token, z = -inf, against the exact 0: below float32's spacing of any s >= 1); the clamp
// keeps NaN (max(floor, x) returns x when x is NaN).
template <typename scalar_t>
BlockBelow block_sums_below(const scalar_t* z, int64_t n, float m, float inv_t) {
  constexpr int64_t kStep = 2 * Vec::size();
  const int64_t n_vec = n - n % kStep;
  const Vec vm(m), vscale(inv_t * kLog2e), floor_x(-125.f), bias(kRoundBias);
  const Vec p5(1.327645838951286e-3f), p4(9.675541727112047e-3f), p3(5.550713319925286e-2f),
      p2(2.402211971733091e-1f), p1(6.931469670336139e-1f), p0(1.000000071655693f);
  // Two sets of accumulators (one per vector of a pair): two independent chains of adds.
  Vec vmax0(kNegInf), vmax1(kNegInf), vs0(0.f), vs1(0.f), vw0(0.f), vw1(0.f);
  auto accumulate = [&](const Vec& zi, Vec& vmax, Vec& vs, Vec& vw) {
    vmax = at::vec::clamp_min(vmax, zi);
    const Vec x = at::vec::clamp_min((zi - vm) * vscale, floor_x);
    const Vec t = x + bias;
    const Vec r = x - (t - bias);
    Vec poly = at::vec::fmadd(p5, r, p4);
    poly = at::vec::fmadd(poly, r, p3);
    poly = at::vec::fmadd(poly, r, p2);
    poly = at::vec::fmadd(poly, r, p1);
    poly = at::vec::fmadd(poly, r, p0);
    const Vec e = poly * exponent_from_rounded(t);
    vs = vs + e;
    vw = at::vec::fmadd(e, x, vw);
  };
  for (int64_t i = 0; i < n_vec; i += kStep) {
    // A hint 2048 logits ahead (past a row's end too, where the hardware's prefetch has not yet seen a stream):
    // float32 logits are the larger read under the same arithmetic.
    __builtin_prefetch(z + i + 2048);
    const auto [z0, z1] = load_pair(z + i);
    accumulate(z0, vmax0, vs0, vw0);
    accumulate(z1, vmax1, vs1, vw1);
  }
  float block_max = lanes_max(at::vec::clamp_min(vmax0, vmax1));
  double s = lanes_sum(vs0) + lanes_sum(vs1), w = (lanes_sum(vw0) + lanes_sum(vw1)) * kLn2;
  return with_tail(z, n_vec, n, m, inv_t, {block_max, s, w});
}

#endif

// log s and entropy of softmax(z * inv_t) for one row of `vocab` values, reading each value from memory
// once: per block of kBlock values, the one sweep of block_sums_below where it applies, else (in L1) a max
// sweep, then the sums. Differences to the max are taken
// in z first (exact for nearby values), then scaled: scaling first would round twice.
template <typename scalar_t>
RowStats row_stats(const scalar_t* row, int64_t vocab, float inv_t, float* buf) {
  // Running totals in double: s = tops + rest, w = sum e d, all relative to the running max m of z.
  double rest = 0.0, w_total = 0.0, tops = 0.0;
  float m = kNegInf;
  const bool scaled = inv_t != 1.f;
  for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
    const int64_t n = std::min(kBlock, vocab - b0);
    const int64_t n_vec = n - n % Vec::size();
    if (std::isfinite(m)) {
      const BlockBelow below = block_sums_below(row + b0, n, m, inv_t);
      if (below.block_max < m && std::isfinite(below.s) && std::isfinite(below.w)) {
        rest += below.s;
        w_total += below.w;
        continue;
      }
    }
    const float* z = block_as_float(row + b0, n, buf);
    Vec vmax(kNegInf);
    for (int64_t i = 0; i < n_vec; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(z + i));
    float block_max = lanes_max(vmax);
    for (int64_t i = n_vec; i < n; ++i) block_max = std::max(block_max, z[i]);
    if (block_max > m || std::isnan(block_max)) {
      // Rescale the totals from shift m to the new one: e -> e alpha, d -> d + delta; the old tops
      // (e = 1) become alpha each.
      if (m != kNegInf) {
        const double delta = (static_cast<double>(m) - block_max) * inv_t;
        const double alpha = std::exp(delta);
        w_total = alpha * (w_total + delta * (rest + tops));
        rest = alpha * (rest + tops);
        tops = 0.0;
      }
      m = block_max;
    }
    // While everything seen is -inf (banned tokens) shift by 0, so that no -inf - -inf = NaN appears.
    const float shift = m == kNegInf ? 0.f : m;
    const bool has_tops = block_max == m;
    if (has_tops && scaled) block_sums<true, true>(z, n, shift, inv_t, rest, w_total, tops);
    else if (has_tops) block_sums<true, false>(z, n, shift, inv_t, rest, w_total, tops);
    else if (scaled) block_sums<false, true>(z, n, shift, inv_t, rest, w_total, tops);
    else block_sums<false, false>(z, n, shift, inv_t, rest, w_total, tops);
  }
  // An all -inf row gives log s = -inf and a NaN entropy, which the caller's finiteness check reports.
  const double s_total = tops + rest;
  const double log_s = std::log1p((tops - 1.0) + rest);
  const float shift = m == kNegInf ? 0.f : m;
  return {static_cast<float>(log_s - w_total / s_total), shift, log_s};
}

// One row of the gradient: g = -p (c + e (log p + H)) with log p = (z - m) * inv_t - log_s (near the max,
// no cancellation against a large lse), plus c at the target, whose entry is computed from the forward's
// log_p_target through expm1; c and e already carry the factor inv_t. Written to out (in place is safe:
// blocks are read before they are written).
template <typename scalar_t>
void row_grad(const scalar_t* row, scalar_t* out, int64_t vocab, int64_t target, float log_p_target, float inv_t,
              float row_max, float log_s, float entropy, float c, float e, float* zbuf, float* gbuf) {
  constexpr bool is_float = std::is_same<scalar_t, float>::value;
  const Vec vinv(inv_t), vmax(row_max), vlog_s(log_s), vc(c), ve(e), vh(entropy), zero(0.f), neg_inf(kNegInf);
  for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
    const int64_t n = std::min(kBlock, vocab - b0);
    const int64_t n_vec = n - n % Vec::size();
    const float* z = block_as_float(row + b0, n, zbuf);
    float* g = is_float ? reinterpret_cast<float*>(out + b0) : gbuf;
    for (int64_t i = 0; i < n_vec; i += Vec::size()) {
      const Vec zi = Vec::loadu(z + i);
      const Vec log_p = (zi - vmax) * vinv - vlog_s;
      const Vec p = log_p.exp_u20();
      const Vec safe_log_p = Vec::blendv(log_p, zero, zi == neg_inf);
      (zero - p * (vc + ve * (safe_log_p + vh))).store(g + i);
    }
    for (int64_t i = n_vec; i < n; ++i) {
      const float log_p = (z[i] - row_max) * inv_t - log_s;
      const float p = std::exp(log_p);
      g[i] = -p * (c + e * ((z[i] == kNegInf ? 0.f : log_p) + entropy));
    }
    if (target >= b0 && target < b0 + n) {
      // c (1 - p_y) - e p_y (log p_y + H), with 1 - p_y = -expm1(log p_y): the difference cancels
      // catastrophically when the sampled token is confident.
      const float log_p = log_p_target;
      g[target - b0] = -c * std::expm1(log_p) - e * std::exp(log_p) * (log_p + entropy);
    }
    if (!is_float) at::vec::convert(g, out + b0, n);  // rounds to nearest even, like torch's .to()
  }
}

void check_logits(const at::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(logits.dim() == 3, name, " must be [N, L, V]");
  TORCH_CHECK(logits.stride(2) == 1, name, " must have a contiguous last dimension");
  const auto t = logits.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", t);
}

// Calls fn with a typed null pointer for the three logits dtypes (float64 is the torch backend's).
template <typename Fn>
void dispatch_logits(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "unsupported logits dtype ", t);
  }
}

// Each token's 1 / T: one value for every token (stride 0) or one per token ([N, L]).
struct InvTemperature {
  at::Tensor values;
  const float* p;
  int64_t stride;
  float at(int64_t token) const { return p[token * stride]; }
};

InvTemperature inv_temperature_of(const at::Tensor& inv_temperature, int64_t tokens) {
  auto values = inv_temperature.to(at::kFloat).contiguous();
  TORCH_CHECK(values.numel() == 1 || values.numel() == tokens,
              "inv_temperature must have one element or one per token [N, L], got ", values.numel());
  if (values.numel() == 1) {
    const float v = values.item<float>();
    TORCH_CHECK(v > 0 && std::isfinite(v), "inv_temperature must be finite and > 0");
  }
  const float* p = values.data_ptr<float>();
  return {values, p, values.numel() == 1 ? 0 : 1};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_forward(const at::Tensor& logits,
                                                                               const at::Tensor& ids,
                                                                               const at::Tensor& valid,
                                                                               const at::Tensor& inv_temperature) {
  check_logits(logits, "logits");
  const int64_t n_rows = logits.size(0), length = logits.size(1), vocab = logits.size(2);
  const InvTemperature inv = inv_temperature_of(inv_temperature, n_rows * length);
  auto ids_c = ids.to(at::kLong).contiguous();
  auto valid_c = valid.to(at::kBool).contiguous();
  TORCH_CHECK(ids_c.numel() == n_rows * length && valid_c.numel() == n_rows * length, "ids and valid must be [N, L]");
  auto opts = logits.options().dtype(at::kFloat);
  auto row_max = at::zeros({n_rows, length}, opts);
  auto log_s = at::zeros({n_rows, length}, opts);
  auto logp = at::zeros({n_rows, length}, opts);
  auto entropy = at::zeros({n_rows, length}, opts);
  const int64_t* ids_p = ids_c.data_ptr<int64_t>();
  const bool* valid_p = valid_c.data_ptr<bool>();
  float* max_p = row_max.data_ptr<float>();
  float* log_s_p = log_s.data_ptr<float>();
  float* logp_p = logp.data_ptr<float>();
  float* entropy_p = entropy.data_ptr<float>();
  const int64_t s0 = logits.stride(0), s1 = logits.stride(1);

  dispatch_logits(logits.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* base = static_cast<const scalar_t*>(logits.data_ptr());
    at::parallel_for(0, n_rows * length, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<scalar_t, float>::value ? 0 : kBlock);
      for (int64_t token = begin; token < end; ++token) {
        if (!valid_p[token]) continue;  // masked: zeros, logits never read
        const scalar_t* row = base + (token / length) * s0 + (token % length) * s1;
        const float inv_t = inv.at(token);
        const RowStats st = row_stats(row, vocab, inv_t, buf.data());
        const int64_t y = ids_p[token];
        max_p[token] = st.shift;
        log_s_p[token] = static_cast<float>(st.log_s);
        entropy_p[token] = st.entropy;
        // (z_y - m) / T - log s, not z_y / T - lse: no cancellation against a large lse, so a confident token's
        // log-prob keeps its relative precision. An out-of-vocabulary id (possible only with validation
        // off) gives NaN, never a stray read.
        logp_p[token] = (y >= 0 && y < vocab)
                            ? static_cast<float>((static_cast<float>(row[y]) - st.shift) * inv_t - st.log_s)
                            : std::numeric_limits<float>::quiet_NaN();
      }
    });
  });
  return {row_max, log_s, logp, entropy};
}

void token_stats_backward(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& valid,
                          const at::Tensor& row_max, const at::Tensor& log_s, const at::Tensor& logp,
                          const at::Tensor& entropy, const at::Tensor& grad_logp,
                          const at::Tensor& grad_entropy, const at::Tensor& inv_temperature, at::Tensor out) {
  check_logits(logits, "logits");
  check_logits(out, "out");
  TORCH_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type(),
              "out must match logits in shape and dtype");
  const int64_t n_rows = logits.size(0), length = logits.size(1), vocab = logits.size(2);
  const InvTemperature inv = inv_temperature_of(inv_temperature, n_rows * length);
  auto ids_c = ids.to(at::kLong).contiguous();
  auto valid_c = valid.to(at::kBool).contiguous();
  auto max_c = row_max.to(at::kFloat).contiguous();
  auto log_s_c = log_s.to(at::kFloat).contiguous();
  auto entropy_c = entropy.to(at::kFloat).contiguous();
  auto logp_c = logp.to(at::kFloat).contiguous();
  auto c_c = grad_logp.to(at::kFloat).contiguous();
  auto e_c = grad_entropy.to(at::kFloat).contiguous();
  const int64_t* ids_p = ids_c.data_ptr<int64_t>();
  const bool* valid_p = valid_c.data_ptr<bool>();
  const float *max_p = max_c.data_ptr<float>(), *log_s_p = log_s_c.data_ptr<float>();
  const float* entropy_p = entropy_c.data_ptr<float>();
  const float* logp_p = logp_c.data_ptr<float>();
  const float *c_p = c_c.data_ptr<float>(), *e_p = e_c.data_ptr<float>();
  const int64_t s0 = logits.stride(0), s1 = logits.stride(1), o0 = out.stride(0), o1 = out.stride(1);

  dispatch_logits(logits.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* base = static_cast<const scalar_t*>(logits.data_ptr());
    scalar_t* out_base = static_cast<scalar_t*>(out.data_ptr());
    constexpr bool is_float = std::is_same<scalar_t, float>::value;
    at::parallel_for(0, n_rows * length, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> zbuf(is_float ? 0 : kBlock), gbuf(is_float ? 0 : kBlock);
      for (int64_t token = begin; token < end; ++token) {
        scalar_t* out_row = out_base + (token / length) * o0 + (token % length) * o1;
        if (!valid_p[token]) {  // masked: exact zeros, logits never read
          std::fill(out_row, out_row + vocab, scalar_t(0));
          continue;
        }
        const scalar_t* row = base + (token / length) * s0 + (token % length) * s1;
        const int64_t y = ids_p[token];
        const float inv_t = inv.at(token);
        row_grad(row, out_row, vocab, (y >= 0 && y < vocab) ? y : int64_t(-1), logp_p[token], inv_t, max_p[token],
                 log_s_p[token], entropy_p[token], c_p[token] * inv_t, e_p[token] * inv_t, zbuf.data(), gbuf.data());
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> conflict_weights(const at::Tensor& ids, const at::Tensor& lengths,
                                                    const at::Tensor& advantages, int64_t group_size, double weight) {
  TORCH_CHECK(ids.dim() == 2, "ids must be [N, L]");
  TORCH_CHECK(group_size > 0 && ids.size(0) % group_size == 0, "group_size must divide N");
  const int64_t n_rows = ids.size(0), length = ids.size(1);
  auto ids_c = ids.to(at::kLong).contiguous();
  auto len_c = lengths.to(at::kLong).contiguous();
  auto adv_c = advantages.to(at::kFloat).contiguous();
  auto lambda = at::empty({n_rows, length}, ids.options().dtype(at::kFloat));
  auto n_conflict = at::empty({n_rows}, ids.options().dtype(at::kLong));
  const int64_t* y = ids_c.data_ptr<int64_t>();
  const int64_t* len = len_c.data_ptr<int64_t>();
  const float* adv = adv_c.data_ptr<float>();
  float* lam = lambda.data_ptr<float>();
  int64_t* n_out = n_conflict.data_ptr<int64_t>();
  const float w = static_cast<float>(weight);

  at::parallel_for(0, n_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t first = (i / group_size) * group_size, len_i = len[i];
      // Is position k of row i (pos_of maps a row and k to a position, -1 if k is past its end)
      // also held, at the same aligned position, by a positive and by a negative completion?
      auto raw_conflict = [&](auto pos_of, int64_t k) {
        const int64_t token = y[i * length + pos_of(i, k)];
        bool pos = false, neg = false;
        for (int64_t j = first; j < first + group_size && !(pos && neg); ++j) {
          const int64_t t = pos_of(j, k);
          if (t < 0 || y[j * length + t] != token) continue;
          pos = pos || adv[j] > 0;
          neg = neg || adv[j] < 0;
        }
        return pos && neg;
      };
      auto forward_pos = [&](int64_t r, int64_t k) { return k < len[r] ? k : int64_t(-1); };
      auto reverse_pos = [&](int64_t r, int64_t k) { return k < len[r] ? len[r] - 1 - k : int64_t(-1); };
      int64_t run_f = 0, run_r = 0;
      const bool active = adv[i] > 0 || adv[i] < 0;
      if (active) {
        while (run_f < len_i && raw_conflict(forward_pos, run_f)) ++run_f;
        while (run_r < len_i && raw_conflict(reverse_pos, run_r)) ++run_r;
      }
      const float on_run = adv[i] > 0 ? w : 0.f;
      for (int64_t t = 0; t < length; ++t) {
        const float lf = t < run_f ? on_run : 1.f;
        const float lr = (t >= len_i - run_r && t < len_i) ? on_run : 1.f;
        lam[i * length + t] = lf * lr;
      }
      n_out[i] = std::max(run_f, run_r);
    }
  });
  return {lambda, n_conflict};
}

}  // namespace

TORCH_LIBRARY(gtpo_cpu, m) {
  m.def("token_stats_forward(Tensor logits, Tensor ids, Tensor valid, Tensor inv_temperature) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("token_stats_backward(Tensor logits, Tensor ids, Tensor valid, Tensor row_max, Tensor log_s, Tensor logp, "
        "Tensor entropy, Tensor grad_logp, Tensor grad_entropy, Tensor inv_temperature, Tensor(a!) out) -> ()");
  m.def("conflict_weights(Tensor ids, Tensor lengths, Tensor advantages, int group_size, float weight) -> (Tensor, Tensor)");
  m.def("capability() -> str");
}

TORCH_LIBRARY_IMPL(gtpo_cpu, CPU, m) {
  m.impl("token_stats_forward", &token_stats_forward);
  m.impl("token_stats_backward", &token_stats_backward);
  m.impl("conflict_weights", &conflict_weights);
}

TORCH_LIBRARY_IMPL(gtpo_cpu, CompositeExplicitAutograd, m) {
  m.impl("capability", []() -> std::string {
#if defined(CPU_CAPABILITY_AVX512)
    return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
    return "avx2";
#else
    return "default";
#endif
  });
}

// Importable as a Python module (the ops register when the library loads); it defines nothing itself.
#define GTPO_CONCAT_(a, b) a##b
#define GTPO_CONCAT(a, b) GTPO_CONCAT_(a, b)
PyMODINIT_FUNC GTPO_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "gtpo_cpu", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
