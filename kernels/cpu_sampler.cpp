// Token draws from processed logits rows on the CPU: greedy, or top-k / top-p / min-p truncation then
// inverse-CDF sampling with uniforms given by the caller (kernels/sampling.py states the semantics;
// kernels/cpu_build.py builds this file, kernels/cpu_sampling.py calls it through ctypes).
//
// No row is fully sorted unless the exact fallback needs it. A row costs a few vectorised passes: its
// maximum; exp(x - max) summed in chunks; compare passes that skip whole vectors below a threshold and
// collect the candidates, which alone are sorted. Top-k: the k largest by a bounded heap (nth_element for
// large k), plus the tokens tied with the k-th largest. Top-p without top-k: the logits within 4, 8, .. 24
// binary orders of magnitude of the maximum's probability, the first of these sets whose mass reaches top_p
// (every token if none does, or if rounding left the nucleus walk short). Min-p: a threshold on x - max.
// Draws accumulate the kept tokens' probabilities in token-id order in float64; an untruncated row skips
// whole chunks by their sums and scans one chunk per draw. A token of probability 0 is never drawn.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_vector.h"

namespace {

using namespace cpu_kernels;

constexpr int64_t kChunk = 256;        // tokens per exp chunk (and per skipped chunk when drawing)
constexpr int64_t kHeapLimit = 1024;   // top-k up to this uses a heap, larger k nth_element
// Top-p candidate levels, widening: the tokens with p >= ratio * p_max.
constexpr float kLevelRatios[] = {0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f};

struct Candidate {
  float value;
  int64_t id;
};

// Descending by value, then ascending by token id (a deterministic order among ties).
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

struct Row {
  const float* x;
  int64_t vocab;
  float max = 0;
};

// The maximum of x[0, n) (-inf when n is 0), vector by vector; `has_nan` says whether a NaN was seen.
float scan_max(const float* x, int64_t n, bool& has_nan) {
  constexpr int64_t L = Vector<float>::lanes;
  FloatVector best = FloatVector{} - std::numeric_limits<float>::infinity();
  IntVector nan = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const FloatVector v = load(x + i);
    nan |= (v != v);
    best = v > best ? v : best;
  }
  float m = -std::numeric_limits<float>::infinity();
  has_nan = false;
  for (int64_t j = 0; j < L; ++j) {
    m = std::max(m, best[j]);
    has_nan |= nan[j] != 0;
  }
  for (; i < n; ++i) {
    has_nan |= x[i] != x[i];
    m = std::max(m, x[i]);
  }
  return m;
}

// The row's maximum; false when it is not finite or the row holds a NaN.
bool row_max(const float* x, int64_t n, float& result) {
  bool has_nan = false;
  result = scan_max(x, n, has_nan);
  return !has_nan && std::isfinite(result);
}

// exp(x - max) of tokens [start, start + n) into `out`.
inline void chunk_exp(const Row& row, int64_t start, int64_t n, float* out) {
  const float* x = row.x + start;
  const float max = row.max;
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] - max;
  exp_nonpositive(out, n);
}

constexpr int64_t kNumLevels = sizeof(kLevelRatios) / sizeof(kLevelRatios[0]);

// A greedy row in one pass over memory: its first maximum and the sum of exp(x - max) (in float64 across
// chunks), each chunk read once: its maximum (and NaNs) first, then, while it is in cache, exp(x - running max)
// summed; a chunk that raises the maximum rescales the sum so far by exp(old - new). False when the row has no
// finite maximum or holds a NaN.
bool greedy_row(Row& row, int64_t& argmax, double& total, bool with_sum = true) {
  constexpr int64_t L = Vector<float>::lanes;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float e[1];
  float m = -kInf;
  double sum = 0;
  argmax = -1;
  for (int64_t start = 0; start < row.vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, row.vocab - start);
    const float* x = row.x + start;
    bool has_nan = false;
    const float chunk_max = scan_max(x, n, has_nan);
    if (has_nan || chunk_max == kInf) return false;
    if (chunk_max > m) {
      argmax = start + (std::find(x, x + n, chunk_max) - x);
      if (m > -kInf) sum *= std::exp(double(m) - double(chunk_max));
      m = chunk_max;
    }
    if (m == -kInf || !with_sum) continue;   // nothing finite so far: these tokens have probability 0
    FloatVector lanes = {};
    int64_t k = 0;
    for (; k + L <= n; k += L) lanes += exp_nonpositive(load(x + k) - m);
    double chunk = horizontal_sum<float>(lanes);
    for (; k < n; ++k) {
      e[0] = x[k] - m;
      exp_nonpositive(e, 1);
      chunk += e[0];
    }
    sum += chunk;
  }
  if (m == -kInf) return false;
  row.max = m;
  total = sum;
  return true;
}

// Sum of exp(x - max) over the row in float64; optionally also per chunk, and the mass of the tokens with
// exp(x - max) >= each of kLevelRatios.
double exp_sum(const Row& row, std::vector<double>* chunk_sums, double* level_mass = nullptr) {
  constexpr int64_t L = Vector<float>::lanes;
  float e[kChunk];
  double total = 0;
  for (int64_t start = 0; start < row.vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, row.vocab - start);
    chunk_exp(row, start, n, e);
    FloatVector lanes = {};
    FloatVector above[kNumLevels] = {};
    int64_t i = 0;
    for (; i + L <= n; i += L) {
      const FloatVector v = load(e + i);
      lanes += v;
      if (level_mass != nullptr)
        for (int64_t j = 0; j < kNumLevels; ++j) above[j] += v >= kLevelRatios[j] ? v : FloatVector{};
    }
    double chunk = horizontal_sum<float>(lanes);
    for (; i < n; ++i) {
      chunk += e[i];
      for (int64_t j = 0; level_mass != nullptr && j < kNumLevels; ++j)
        if (e[i] >= kLevelRatios[j]) level_mass[j] += e[i];
    }
    for (int64_t j = 0; level_mass != nullptr && j < kNumLevels; ++j) level_mass[j] += horizontal_sum<float>(above[j]);
    if (chunk_sums != nullptr) chunk_sums->push_back(chunk);
    total += chunk;
  }
  return total;
}

// Sum of exp(x - max) over the tokens with x < cut (the tail the candidates leave out), in float64 across
// chunks: with the candidates' own float64 sum it gives the row's total without the float error of the
// whole row's sum, which matters when top_p is close to 1.
double tail_mass(const Row& row, float cut) {
  constexpr int64_t L = Vector<float>::lanes;
  float e[kChunk];
  double total = 0;
  for (int64_t start = 0; start < row.vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, row.vocab - start);
    chunk_exp(row, start, n, e);
    FloatVector lanes = {};
    int64_t i = 0;
    for (; i + L <= n; i += L) lanes += load(row.x + start + i) < cut ? load(e + i) : FloatVector{};
    double chunk = horizontal_sum<float>(lanes);
    for (; i < n; ++i) chunk += row.x[start + i] < cut ? e[i] : 0.0f;
    total += chunk;
  }
  return total;
}

// True when some lane of x[i : i + lanes) is above `threshold` (> or >=).
template <bool OrEqual>
inline bool any_above(const float* x, float threshold) {
  const FloatVector v = load(x);
  return any_lane(OrEqual ? (v >= threshold) : (v > threshold));
}

// Tokens with x >= cut (unsorted), skipping whole vectors below it.
std::vector<Candidate> collect(const Row& row, float cut) {
  constexpr int64_t L = Vector<float>::lanes;
  std::vector<Candidate> picked;
  int64_t i = 0;
  for (; i + L <= row.vocab; i += L) {
    if (!any_above<true>(row.x + i, cut)) continue;
    for (int64_t j = i; j < i + L; ++j)
      if (row.x[j] >= cut) picked.push_back({row.x[j], j});
  }
  for (; i < row.vocab; ++i)
    if (row.x[i] >= cut) picked.push_back({row.x[i], i});
  return picked;
}

// The k best tokens by (value descending, id ascending), then every later token tied with the k-th value:
// top-k keeps all logits >= the k-th largest, as transformers' TopKLogitsWarper and vLLM do. Empty when the
// k-th value is -inf (top-k then removes nothing).
std::vector<Candidate> top_k_candidates(const Row& row, int64_t k) {
  std::vector<Candidate> picked;
  picked.reserve(k);
  if (k > kHeapLimit) {
    std::vector<Candidate> all(row.vocab);
    for (int64_t i = 0; i < row.vocab; ++i) all[i] = {row.x[i], i};
    std::nth_element(all.begin(), all.begin() + (k - 1), all.end(), ranks_before);
    picked.assign(all.begin(), all.begin() + k);
  } else {
    // A heap whose front is the worst of the k best so far. Tokens come in increasing id order, so a later
    // token ranks before the front only with a strictly larger value: whole vectors at or below it are skipped.
    constexpr int64_t L = Vector<float>::lanes;
    for (int64_t i = 0; i < row.vocab; ++i) {
      if (int64_t(picked.size()) == k && i % L == 0 && i + L <= row.vocab &&
          !any_above<false>(row.x + i, picked.front().value)) {
        i += L - 1;
        continue;
      }
      const Candidate c{row.x[i], i};
      if (int64_t(picked.size()) < k) {
        picked.push_back(c);
        std::push_heap(picked.begin(), picked.end(), ranks_before);
      } else if (ranks_before(c, picked.front())) {
        std::pop_heap(picked.begin(), picked.end(), ranks_before);
        picked.back() = c;
        std::push_heap(picked.begin(), picked.end(), ranks_before);
      }
    }
  }
  std::sort(picked.begin(), picked.end(), ranks_before);
  const Candidate kth = picked.back();   // the k best hold the lowest ids among the ties with the k-th value
  if (kth.value == -std::numeric_limits<float>::infinity()) return {};   // every token ties: none is cut
  constexpr int64_t L = Vector<float>::lanes;   // the ties after it, skipping whole vectors that hold none
  int64_t i = kth.id + 1;
  for (; i % L != 0 && i < row.vocab; ++i)
    if (row.x[i] == kth.value) picked.push_back({row.x[i], i});
  for (; i + L <= row.vocab; i += L) {
    if (!any_lane(load(row.x + i) == kth.value)) continue;
    for (int64_t j = i; j < i + L; ++j)
      if (row.x[j] == kth.value) picked.push_back({row.x[j], j});
  }
  for (; i < row.vocab; ++i)
    if (row.x[i] == kth.value) picked.push_back({row.x[i], i});
  return picked;
}

// Length of the kept prefix of the candidates in descending order; they are reordered so that it comes first.
// Candidates with value >= `sure_cut` are known to be kept (their higher-ranked tokens hold less than top_p of
// the mass, by a float estimate that is checked here): they are summed, not sorted; the rest are sorted and
// walked. `total`: the sum of exp(x - max) over the top-k set. `short_walk`: the candidates ran out before
// top-p's mass was reached (there were too few of them).
int64_t kept_prefix(std::vector<Candidate>& candidates, const Row& row, int64_t k, double top_p, double min_p,
                    double total, float sure_cut, bool& short_walk) {
  const double needed = top_p < 1.0 ? top_p * total : std::numeric_limits<double>::infinity();
  auto mass_of_range = [&](int64_t from, int64_t to) {
    double mass = 0;
    for (int64_t i = from; i < to; ++i) mass += std::exp(double(candidates[i].value) - double(row.max));
    return mass;
  };
  int64_t n = std::partition(candidates.begin(), candidates.end(),
                             [&](const Candidate& c) { return c.value >= sure_cut; }) - candidates.begin();
  double mass = mass_of_range(0, n);
  if (n > k || (n > 0 && mass >= needed)) {   // the estimate was off: walk every candidate
    n = 0;
    mass = 0;
  }
  const int64_t size = int64_t(candidates.size()), limit = std::min<int64_t>(k, size);
  std::sort(candidates.begin() + n, candidates.end(), ranks_before);
  for (; n < limit; ++n) {
    const double e = std::exp(double(candidates[n].value) - double(row.max));
    if (mass >= needed || e < min_p) break;
    mass += e;
  }
  short_walk = n == size && n < k && mass < needed;
  return n;
}

struct Draws {
  const double* uniforms;
  int64_t count;
  int64_t* tokens;
};

// Draws from the first `kept` entries of `sorted`, in token-id order; returns log(sum of their exp(x - max)).
// A draw lands where the cumulative sum first exceeds the target, so on a token of positive probability; a
// target at or past the total (a uniform of 1) takes the last such token, never a masked (-inf) one.
double draw_from_prefix(std::vector<Candidate>& sorted, int64_t kept, const Row& row, const Draws& draws) {
  std::sort(sorted.begin(), sorted.begin() + kept, [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
  std::vector<double> cdf(kept);
  double total = 0;
  int64_t last_drawable = 0;
  for (int64_t i = 0; i < kept; ++i) {
    const double e = std::exp(double(sorted[i].value) - double(row.max));
    if (e > 0) last_drawable = i;
    total += e;
    cdf[i] = total;
  }
  for (int64_t j = 0; j < draws.count; ++j) {
    const int64_t at = std::upper_bound(cdf.begin(), cdf.end(), draws.uniforms[j] * total) - cdf.begin();
    draws.tokens[j] = sorted[std::min(at, last_drawable)].id;
  }
  return std::log(total);
}

// Draws from the whole row: skip chunks by their (float) sums, scan the chunk that holds the target in float64.
// The two sums round differently, so the scan can end without passing the target: it then takes the chunk's
// last token of positive probability. Chunks after the last one with any mass are never chosen, so a masked
// token (exp = 0) is never drawn.
void draw_from_row(const Row& row, const std::vector<double>& chunk_sums, double total, const Draws& draws) {
  float e[kChunk];
  int64_t last_chunk = int64_t(chunk_sums.size()) - 1;
  while (last_chunk > 0 && !(chunk_sums[last_chunk] > 0)) --last_chunk;
  for (int64_t j = 0; j < draws.count; ++j) {
    const double target = draws.uniforms[j] * total;
    double cumulative = 0;
    int64_t chunk = 0;
    while (chunk < last_chunk && cumulative + chunk_sums[chunk] <= target) cumulative += chunk_sums[chunk++];
    const int64_t start = chunk * kChunk, n = std::min(kChunk, row.vocab - start);
    chunk_exp(row, start, n, e);
    int64_t token = -1, last_drawable = start;
    for (int64_t i = 0; i < n; ++i) {
      if (e[i] > 0) last_drawable = start + i;
      cumulative += e[i];
      if (cumulative > target) {
        token = start + i;
        break;
      }
    }
    draws.tokens[j] = token >= 0 ? token : last_drawable;
  }
}

// The logit at which p = ratio * p_max, widened by one float step (x >= max + log(ratio) must not drop a
// token whose ratio rounds to exactly `ratio`).
inline float cut_at(const Row& row, double ratio) {
  if (ratio <= 0) return -std::numeric_limits<float>::infinity();
  return std::nextafter(float(double(row.max) + std::log(ratio)), -std::numeric_limits<float>::infinity());
}

inline double mass_of(const std::vector<Candidate>& candidates, const Row& row) {
  double mass = 0;
  for (const Candidate& c : candidates) mass += std::exp(double(c.value) - double(row.max));
  return mass;
}

// Candidates for top-p (and min-p) without top-k: the tokens of the first level whose (float) mass reaches
// `needed`, above the min-p threshold (every token above it when no level does, or when needed is 0).
// `cut`: the logit they are collected from (x >= cut); `sure_cut`: the previous level's cut (+inf for the
// first level or when no level is used).
std::vector<Candidate> nucleus_candidates(const Row& row, const double* level_mass, double needed, double min_p,
                                          float& sure_cut, float& cut) {
  double ratio = 0.0;
  sure_cut = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; needed > 0 && j < kNumLevels; ++j) {
    if (level_mass[j] >= needed) {
      ratio = kLevelRatios[j];
      break;
    }
    if (kLevelRatios[j] > min_p) sure_cut = cut_at(row, kLevelRatios[j]);
  }
  if (ratio == 0.0) sure_cut = std::numeric_limits<float>::infinity();
  cut = cut_at(row, std::max(ratio, min_p));
  return collect(row, cut);
}

bool sample_row(Row row, int64_t top_k, double top_p, double min_p, bool greedy, const Draws& draws, int64_t& kept,
                double& log_norm) {
  if (greedy) {   // the first maximum; the whole row is kept (its log-probabilities are the full softmax's)
    int64_t argmax = 0;
    double total = 0;
    if (!greedy_row(row, argmax, total)) return false;
    kept = row.vocab;
    log_norm = double(row.max) + std::log(total);
    for (int64_t j = 0; j < draws.count; ++j) draws.tokens[j] = argmax;
    return true;
  }
  if (!row_max(row.x, row.vocab, row.max)) return false;
  int64_t k = (top_k <= 0 || top_k >= row.vocab) ? row.vocab : top_k;
  std::vector<Candidate> sorted;
  if (k < row.vocab) {
    sorted = top_k_candidates(row, k);
    k = sorted.empty() ? row.vocab : int64_t(sorted.size());   // the ties with the k-th value are kept too
    if (k == row.vocab) sorted.clear();
  }
  if (k == row.vocab && top_p >= 1.0 && min_p <= 0.0) {
    std::vector<double> chunk_sums;
    const double total = exp_sum(row, &chunk_sums);
    kept = row.vocab;
    log_norm = double(row.max) + std::log(total);
    draw_from_row(row, chunk_sums, total, draws);
    return true;
  }
  double total = 0, level_mass[kNumLevels] = {};
  float sure_cut = std::numeric_limits<float>::infinity(), cut = 0;
  if (k < row.vocab) {
    total = mass_of(sorted, row);
  } else if (top_p < 1.0) {
    const double estimate = exp_sum(row, nullptr, level_mass);
    sorted = nucleus_candidates(row, level_mass, top_p * estimate, min_p, sure_cut, cut);
    total = mass_of(sorted, row) + tail_mass(row, cut);
  } else {   // min-p alone keeps every candidate with p >= min_p * p_max (the cut is a float step wider)
    sorted = nucleus_candidates(row, level_mass, 0.0, min_p, sure_cut, cut);
    sorted.erase(std::remove_if(sorted.begin(), sorted.end(), [&](const Candidate& c) {
      return std::exp(double(c.value) - double(row.max)) < min_p;
    }), sorted.end());
    sure_cut = -std::numeric_limits<float>::infinity();
  }
  bool short_walk = false;
  kept = kept_prefix(sorted, row, k, top_p, min_p, total, sure_cut, short_walk);
  if (short_walk) {   // the exact fallback: every token above the min-p threshold is a candidate
    sorted = nucleus_candidates(row, level_mass, 0.0, min_p, sure_cut, cut);
    kept = kept_prefix(sorted, row, k, top_p, min_p, total, sure_cut, short_walk);
  }
  log_norm = double(row.max) + draw_from_prefix(sorted, kept, row, draws);
  return true;
}

}  // namespace

extern "C" {

// Greedy rows alone: each row's first maximum and, with `with_norms`, its log-normaliser (max + log(sum of
// exp(x - max)), exactly as sample_rows computes it for a greedy row); without, one pass of maximum and
// comparisons (log_norm is left NaN). Returns 0, or 1 + the first row without a finite maximum (its token -1).
int64_t greedy_rows(const float* logits, int64_t row_stride, int64_t num_rows, int64_t vocab, uint8_t with_norms,
                    int64_t* tokens, double* log_norm, int64_t num_threads) {
  int64_t failed = num_rows;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && num_rows > 1) \
    reduction(min : failed)
  for (int64_t r = 0; r < num_rows; ++r) {
    Row row{logits + r * row_stride, vocab};
    int64_t argmax = 0;
    double total = 0;
    if (!greedy_row(row, argmax, total, with_norms != 0)) {
      failed = std::min(failed, r);
      tokens[r] = -1;
      log_norm[r] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    tokens[r] = argmax;
    log_norm[r] = with_norms ? double(row.max) + std::log(total) : std::numeric_limits<double>::quiet_NaN();
  }
  return failed == num_rows ? 0 : failed + 1;
}

// Returns 0, or 1 + the first row without a finite maximum (every such row gets kept = 0 and is skipped; the
// others are drawn as usual). Per draw: tokens and logprobs (x - log_norm); per row: kept (the prefix length)
// and log_norm. top_k <= 0 or >= vocab: no top-k.
int64_t sample_rows(const float* logits, int64_t row_stride, int64_t num_rows, int64_t vocab, const int64_t* top_k,
                    const double* top_p, const double* min_p, const uint8_t* greedy, const double* uniforms,
                    const int64_t* draw_offsets, int64_t* tokens, double* logprobs, int64_t* kept, double* log_norm,
                    int64_t num_threads) {
  int64_t failed = num_rows;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && num_rows > 1) \
    reduction(min : failed)
  for (int64_t r = 0; r < num_rows; ++r) {
    const Row row{logits + r * row_stride, vocab};
    const Draws draws{uniforms + draw_offsets[r], draw_offsets[r + 1] - draw_offsets[r], tokens + draw_offsets[r]};
    if (!sample_row(row, top_k[r], top_p[r], min_p[r], greedy[r] != 0, draws, kept[r], log_norm[r])) {
      failed = std::min(failed, r);
      kept[r] = 0;   // marks the row as failed: a row that samples keeps at least one token
      log_norm[r] = std::numeric_limits<double>::quiet_NaN();
      for (int64_t j = 0; j < draws.count; ++j) {
        draws.tokens[j] = 0;
        logprobs[draw_offsets[r] + j] = std::numeric_limits<double>::quiet_NaN();
      }
      continue;
    }
    for (int64_t j = 0; j < draws.count; ++j)
      logprobs[draw_offsets[r] + j] = double(row.x[draws.tokens[j]]) - log_norm[r];
  }
  return failed == num_rows ? 0 : failed + 1;
}

}  // extern "C"
