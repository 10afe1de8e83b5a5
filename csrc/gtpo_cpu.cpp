// CPU kernels of gtpo_kernels: the same one-pass algorithm as the Triton kernels, with all cores
// (at::parallel_for over tokens or completions) and SIMD (at::vec) in the inner loops.
//
//   token_stats_forward(logits [N, L, V], ids [N, L], valid [N, L]) -> (lse, logp, H)   float32 [N, L]
//   token_stats_backward(logits, ids, valid, lse, H, grad_logp, grad_H, out [N, L, V])
//       out = grad_logp (onehot(y) - p) + grad_H dH/dz, dH/dz = -p (log p + H); out may be logits
//   conflict_weights(ids [N, L], lengths [N], advantages [N], group_size, weight) -> (lambda [N, L], n [N])
//
// logits: float32, bfloat16 or float16 with a contiguous last dimension (other strides are free).
// Every token is handled by one thread from start to end, in a fixed order, so results are bitwise
// the same whatever the number of threads.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row of logits as float: float32 rows are read in place, half-precision rows converted into buf.
template <typename scalar_t>
const float* row_as_float(const scalar_t* row, int64_t vocab, float* buf) {
  at::vec::convert(row, buf, vocab);
  return buf;
}
template <>
const float* row_as_float<float>(const float* row, int64_t, float*) {
  return row;
}

// Horizontal max / sum of a vector, lanes in a fixed order (deterministic).
float lanes_max(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float m = lanes[0];
  for (int k = 1; k < Vec::size(); ++k) m = std::max(m, lanes[k]);
  return m;
}
float lanes_sum(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int k = 0; k < Vec::size(); ++k) s += lanes[k];
  return s;
}

struct RowStats {
  float lse, entropy;
};

// lse and entropy of one row: a max pass, then sum e and sum e (z - max) in one pass (e = exp(z - max)).
RowStats row_stats(const float* z, int64_t vocab) {
  const int64_t n_vec = vocab - vocab % Vec::size();
  Vec vmax(kNegInf);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(z + i));
  float m = lanes_max(vmax);
  for (int64_t i = n_vec; i < vocab; ++i) m = std::max(m, z[i]);
  // All -inf: lse = -inf and a NaN entropy, which the caller's finiteness check reports.
  const float shift = m == kNegInf ? 0.f : m;
  const Vec vshift(shift), zero(0.f), neg_inf(kNegInf);
  Vec vs(0.f), vw(0.f);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) {
    const Vec zi = Vec::loadu(z + i);
    const Vec d = zi - vshift;
    const Vec e = d.exp();
    vs = vs + e;
    // Banned tokens (z = -inf) have e = 0; zero their d so that 0 * -inf does not make a NaN.
    vw = vw + e * Vec::blendv(d, zero, zi == neg_inf);
  }
  float s = lanes_sum(vs);
  float w = lanes_sum(vw);
  for (int64_t i = n_vec; i < vocab; ++i) {
    const float d = z[i] - shift;
    const float e = std::exp(d);
    s += e;
    w += z[i] == kNegInf ? 0.f : e * d;
  }
  const float log_s = std::log(s);
  return {shift + log_s, log_s - w / s};
}

// grad = -p (c + e (log p + H)) for every column, written to g (float).
void row_grad(const float* z, int64_t vocab, float lse, float entropy, float c, float e, float* g) {
  const int64_t n_vec = vocab - vocab % Vec::size();
  const Vec vlse(lse), vc(c), ve(e), vh(entropy), zero(0.f), neg_inf(kNegInf);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) {
    const Vec zi = Vec::loadu(z + i);
    const Vec log_p = zi - vlse;
    const Vec p = log_p.exp();
    const Vec safe_log_p = Vec::blendv(log_p, zero, zi == neg_inf);
    (zero - p * (vc + ve * (safe_log_p + vh))).store(g + i);
  }
  for (int64_t i = n_vec; i < vocab; ++i) {
    const float log_p = z[i] - lse;
    const float p = std::exp(log_p);
    g[i] = -p * (c + e * ((z[i] == kNegInf ? 0.f : log_p) + entropy));
  }
}

template <typename scalar_t>
void store_row(const float* g, scalar_t* out, int64_t vocab) {
  at::vec::convert(g, out, vocab);  // rounds to nearest even, like torch's .to()
}

void check_logits(const at::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(logits.dim() == 3, name, " must be [N, L, V]");
  TORCH_CHECK(logits.stride(2) == 1, name, " must have a contiguous last dimension");
  const auto t = logits.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", t);
}

}  // namespace

std::vector<at::Tensor> token_stats_forward(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& valid) {
  check_logits(logits, "logits");
  const int64_t n_rows = logits.size(0), length = logits.size(1), vocab = logits.size(2);
  auto ids_c = ids.to(at::kLong).contiguous();
  auto valid_c = valid.to(at::kBool).contiguous();
  TORCH_CHECK(ids_c.numel() == n_rows * length && valid_c.numel() == n_rows * length, "ids and valid must be [N, L]");
  auto opts = logits.options().dtype(at::kFloat);
  auto lse = at::zeros({n_rows, length}, opts);
  auto logp = at::zeros({n_rows, length}, opts);
  auto entropy = at::zeros({n_rows, length}, opts);
  const int64_t* ids_p = ids_c.data_ptr<int64_t>();
  const bool* valid_p = valid_c.data_ptr<bool>();
  float* lse_p = lse.data_ptr<float>();
  float* logp_p = logp.data_ptr<float>();
  float* entropy_p = entropy.data_ptr<float>();
  const int64_t s0 = logits.stride(0), s1 = logits.stride(1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "token_stats_forward", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, n_rows * length, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same<scalar_t, float>::value ? 0 : vocab);
      for (int64_t token = begin; token < end; ++token) {
        if (!valid_p[token]) continue;  // masked: zeros, logits never read
        const scalar_t* row = base + (token / length) * s0 + (token % length) * s1;
        const float* z = row_as_float(row, vocab, buf.data());
        const RowStats st = row_stats(z, vocab);
        const int64_t y = ids_p[token];
        lse_p[token] = st.lse;
        entropy_p[token] = st.entropy;
        // An out-of-vocabulary id (possible only with validation off) gives NaN, never a stray read.
        logp_p[token] = (y >= 0 && y < vocab) ? z[y] - st.lse : std::numeric_limits<float>::quiet_NaN();
      }
    });
  });
  return {lse, logp, entropy};
}

void token_stats_backward(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& valid,
                          const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& grad_logp,
                          const at::Tensor& grad_entropy, at::Tensor out) {
  check_logits(logits, "logits");
  check_logits(out, "out");
  TORCH_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type(),
              "out must match logits in shape and dtype");
  const int64_t n_rows = logits.size(0), length = logits.size(1), vocab = logits.size(2);
  auto ids_c = ids.to(at::kLong).contiguous();
  auto valid_c = valid.to(at::kBool).contiguous();
  auto lse_c = lse.to(at::kFloat).contiguous();
  auto entropy_c = entropy.to(at::kFloat).contiguous();
  auto c_c = grad_logp.to(at::kFloat).contiguous();
  auto e_c = grad_entropy.to(at::kFloat).contiguous();
  const int64_t* ids_p = ids_c.data_ptr<int64_t>();
  const bool* valid_p = valid_c.data_ptr<bool>();
  const float *lse_p = lse_c.data_ptr<float>(), *entropy_p = entropy_c.data_ptr<float>();
  const float *c_p = c_c.data_ptr<float>(), *e_p = e_c.data_ptr<float>();
  const int64_t s0 = logits.stride(0), s1 = logits.stride(1), o0 = out.stride(0), o1 = out.stride(1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "token_stats_backward", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    scalar_t* out_base = out.data_ptr<scalar_t>();
    constexpr bool is_float = std::is_same<scalar_t, float>::value;
    at::parallel_for(0, n_rows * length, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> zbuf(is_float ? 0 : vocab), gbuf(is_float ? 0 : vocab);
      for (int64_t token = begin; token < end; ++token) {
        scalar_t* out_row = out_base + (token / length) * o0 + (token % length) * o1;
        if (!valid_p[token]) {  // masked: exact zeros, logits never read
          std::fill(out_row, out_row + vocab, scalar_t(0));
          continue;
        }
        const scalar_t* row = base + (token / length) * s0 + (token % length) * s1;
        const float* z = row_as_float(row, vocab, zbuf.data());
        // float32 writes straight to out (in place is safe: each element is read before it is
        // written); half precision goes through a float row, then one rounding.
        float* g = is_float ? reinterpret_cast<float*>(out_row) : gbuf.data();
        const float c = c_p[token];
        row_grad(z, vocab, lse_p[token], entropy_p[token], c, e_p[token], g);
        const int64_t y = ids_p[token];
        if (y >= 0 && y < vocab) g[y] += c;
        if (!is_float) store_row(g, out_row, vocab);
      }
    });
  });
}

std::vector<at::Tensor> conflict_weights(const at::Tensor& ids, const at::Tensor& lengths, const at::Tensor& advantages,
                                         int64_t group_size, double weight) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gtpo_kernels CPU kernels (csrc/gtpo_cpu.cpp)";
  m.def("token_stats_forward", &token_stats_forward, "per-token lse, logp, entropy");
  m.def("token_stats_backward", &token_stats_backward, "gradient of logp and entropy w.r.t. the logits");
  m.def("conflict_weights", &conflict_weights, "conflict-token weights and counts");
}
