"""kernels.sample_rows (the compiled CPU kernel and the PyTorch version) against a float64 reference that
sorts every row: the kept prefix, every drawn token and its log-probability; rows that need each path
(heap and nth_element top-k, nucleus levels, the exact fallback, min-p alone, untruncated, greedy); bad
rows; masked tokens never drawn, even by uniforms next to 1 or to a chunk's end; top-k keeps the ties with
its k-th logit as transformers does; and the Sampler's draws for a seed equal those of the previous
sort-based sampler."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import BASE_SEED, case_seed
from paged_backend.kernels import cpu_sampling, sampling
from paged_backend.sampling.sampler import SampleRequest, Sampler
from paged_backend.sampling_params import SamplingParams
from paged_backend.core.sequence import Sequence

IMPLEMENTATIONS = {"torch": sampling.sample_rows_torch}
if cpu_sampling.available():
    IMPLEMENTATIONS["cpp"] = cpu_sampling.sample_rows


def reference_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Token ids of the kept prefix, by the definition in kernels/sampling.py, in float64 on a full sort
    (descending value, ascending id among ties)."""
    vocab = row.shape[0]
    order = sorted(range(vocab), key=lambda i: (-float(row[i]), i))
    values = row.double()[order]
    e = (values - values[0]).exp()
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    k = int((values >= values[k - 1]).sum())                      # the ties with the k-th logit are kept
    total = float(e[:k].sum())
    kept, mass = [], 0.0
    for n in range(k):
        if (top_p < 1.0 and mass >= top_p * total) or float(e[n]) < min_p:
            break
        kept.append(order[n])
        mass += float(e[n])
    return torch.tensor(kept)


def reference_draw(row: torch.Tensor, kept: torch.Tensor, u: float):
    """The kept token at which the cumulative probability (token-id order) first exceeds u, and its logprob."""
    ids = kept.sort().values
    e = (row.double()[ids] - row.double().max()).exp()
    cdf = e.cumsum(0)
    at = min(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)),
             len(ids) - 1)
    log_norm = float(row.double().max()) + float(cdf[-1].log())
    return int(ids[at]), float(row[ids[at]]) - log_norm


def make_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Peaked rows (a few large logits over a wide tail), flat rows, rows with masked (-inf) tokens and ties."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    logits[::3, :7] += 9.0                                       # peaked
    logits[1::3] *= 0.05                                         # nearly flat: huge nuclei
    logits[2::3, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")   # masked half
    logits[0, 10:14] = logits[0, :7].max()                       # ties at the top
    return logits.contiguous()


SETTINGS = [
    # (top_k, top_p, min_p)
    (50, 1.0, 0.0), (1, 1.0, 0.0), (2000, 1.0, 0.0),             # heap and nth_element top-k
    (-1, 0.9, 0.0), (-1, 0.5, 0.0), (-1, 0.999999, 0.0),         # nucleus levels up to the fallback
    (-1, 1.0, 0.05), (-1, 1.0, 1e-9),                            # min-p alone
    (40, 0.8, 0.02), (-1, 0.95, 0.01), (3000, 0.7, 0.0),         # combinations
    (-1, 1.0, 0.0),                                              # untruncated
]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_sample_rows_equal_the_sorted_reference(impl, vocab):
    rows = 6
    logits = make_rows(case_seed("sample-rows", vocab), rows, vocab)
    gen = torch.Generator().manual_seed(case_seed("uniforms", vocab))
    for top_k, top_p, min_p in SETTINGS:
        draws_per_row = 5
        uniforms = torch.rand(rows * draws_per_row, generator=gen, dtype=torch.float64)
        offsets = torch.arange(rows + 1) * draws_per_row
        out = IMPLEMENTATIONS[impl](logits, torch.full((rows,), top_k),
                                    torch.full((rows,), top_p, dtype=torch.float64),   # the engine's Python floats
                                    torch.full((rows,), min_p, dtype=torch.float64),
                                    torch.zeros(rows, dtype=torch.bool), uniforms, offsets)
        for r in range(rows):
            kept = reference_kept(logits[r], top_k, top_p, min_p)
            setting = f"seed {BASE_SEED}, row {r}, top_k={top_k} top_p={top_p} min_p={min_p}"
            assert int(out.kept[r]) == len(kept), setting
            for j in range(draws_per_row):
                token, logprob = reference_draw(logits[r], kept, float(uniforms[r * draws_per_row + j]))
                assert int(out.tokens[r * draws_per_row + j]) == token, setting
                assert abs(float(out.logprobs[r * draws_per_row + j]) - logprob) < 1e-5, setting


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_greedy_rows_take_the_first_maximum_with_full_softmax_logprobs(impl):
    logits = make_rows(case_seed("greedy-rows"), 4, 777)
    logits[1, 5] = logits[1, 300] = logits[1].max() + 1.0        # a tie: the first index wins
    out = IMPLEMENTATIONS[impl](logits, torch.full((4,), 50), torch.full((4,), 0.5), torch.zeros(4),
                                torch.ones(4, dtype=torch.bool), torch.zeros(8, dtype=torch.float64),
                                torch.arange(5) * 2)
    want = logits.argmax(-1)
    assert out.tokens.tolist() == want.repeat_interleave(2).tolist()
    assert out.kept.tolist() == [777] * 4                         # greedy rows ignore the truncation settings
    log_softmax = logits.double().log_softmax(-1)
    for i, token in enumerate(out.tokens.tolist()):
        assert abs(float(out.logprobs[i]) - float(log_softmax[i // 2, token])) < 1e-6


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_a_row_without_a_finite_maximum_is_a_value_error_naming_it(impl):
    logits = torch.randn(3, 64)
    for bad, value in ((1, float("nan")), (2, float("inf"))):
        broken = logits.clone()
        broken[bad, 7] = value
        with pytest.raises(ValueError, match=f"row {bad}"):
            IMPLEMENTATIONS[impl](broken, torch.full((3,), -1), torch.ones(3), torch.zeros(3),
                                  torch.zeros(3, dtype=torch.bool), torch.rand(3, dtype=torch.float64), torch.arange(4))
    masked = logits.clone()
    masked[0] = float("-inf")
    with pytest.raises(ValueError, match="row 0"):
        IMPLEMENTATIONS[impl](masked, torch.full((3,), 5), torch.ones(3), torch.zeros(3),
                              torch.zeros(3, dtype=torch.bool), torch.rand(3, dtype=torch.float64), torch.arange(4))


CHUNK = 256   # the compiled kernel's exp chunk (kernels/cpu_sampler.cpp kChunk)


def adversarial_uniforms(row: torch.Tensor, per_boundary: int = 64, width: float = 4e-7) -> torch.Tensor:
    """Uniforms whose targets sit where rounding decides the token: a dense comb around the float64 cumulative
    mass at the end of every CHUNK-token chunk (the kernel skips chunks by float sums, then scans in float64),
    and the 40 largest doubles below 1 plus 1 - 10^-p."""
    e = (row.double() - row.double().max()).exp()
    cum = e.cumsum(0) / e.sum()
    comb = torch.linspace(-width / 2, width / 2, per_boundary + 1, dtype=torch.float64)
    near_ends = (cum[CHUNK - 1::CHUNK][:, None] + comb[None, :]).flatten()
    below_one = [1.0]
    for _ in range(40):
        below_one.append(float(torch.nextafter(torch.tensor(below_one[-1], dtype=torch.float64),
                                               torch.tensor(0.0, dtype=torch.float64))))
    tail = torch.tensor(below_one[1:] + [1 - 10.0 ** -p for p in range(6, 16)], dtype=torch.float64)
    return torch.cat([near_ends, tail]).clamp(0.0, below_one[1])


def masked_rows(vocab: int = 4099) -> torch.Tensor:
    """Rows whose masked (-inf) tokens sit where a rounding slip would land: each chunk's last token, the whole
    tail after a few chunks, a random half and the last token; peaked and flat."""
    gen = torch.Generator().manual_seed(case_seed("masked-rows"))
    rows = []
    for r in range(12):
        row = torch.randn(vocab, generator=gen) * (0.05 if r % 2 else 2.0)
        if r % 3 == 0:
            row[CHUNK - 1::CHUNK] = float("-inf")
        elif r % 3 == 1:
            row[CHUNK * 3 + 17:] = float("-inf")
        else:
            row[torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
            row[-1] = float("-inf")
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_a_masked_token_is_never_drawn(impl):
    logits = masked_rows()
    rows = logits.shape[0]
    uniforms = [adversarial_uniforms(logits[r]) for r in range(rows)]
    counts = torch.tensor([len(u) for u in uniforms])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    row_of_draw = torch.repeat_interleave(torch.arange(rows), counts)
    for top_k, top_p, min_p in [(-1, 1.0, 0.0), (4000, 1.0, 0.0), (50, 1.0, 0.0), (-1, 0.999999, 0.0),
                                (-1, 0.9, 0.0), (-1, 1.0, 1e-12), (3000, 0.99, 1e-9)]:
        out = IMPLEMENTATIONS[impl](logits, torch.full((rows,), top_k),
                                    torch.full((rows,), top_p, dtype=torch.float64),
                                    torch.full((rows,), min_p, dtype=torch.float64),
                                    torch.zeros(rows, dtype=torch.bool), torch.cat(uniforms), offsets)
        drawn = logits[row_of_draw, out.tokens]
        masked = (~torch.isfinite(drawn)).nonzero().flatten()
        assert not masked.numel(), (f"top_k={top_k} top_p={top_p} min_p={min_p}: {masked.numel()} of {len(drawn)} "
                                    f"draws took a masked token, e.g. row {int(row_of_draw[masked[0]])} token "
                                    f"{int(out.tokens[masked[0]])} at u={float(torch.cat(uniforms)[masked[0]])!r}")
        assert torch.isfinite(out.logprobs).all()


def hf_top_k_kept(row: torch.Tensor, k: int) -> set:
    """The tokens transformers' TopKLogitsWarper leaves finite."""
    from transformers.generation.logits_process import TopKLogitsWarper

    warped = TopKLogitsWarper(top_k=k)(torch.zeros(1, 1, dtype=torch.long), row[None].clone())[0]
    return set(torch.isfinite(warped).nonzero().flatten().tolist())


def assert_inverse_cdf_draws(drawn: torch.Tensor, row: torch.Tensor, ids: list, uniforms: torch.Tensor, what,
                             rounding: float = 1e-6) -> None:
    """Each draw is the token of `ids` (ascending) at which the float64 cumulative probability first exceeds
    u, or, where u's target lies within `rounding` of the total from the step between two neighbouring tokens,
    either of them: the kernels sum float32 exponentials, so a target on a step may fall on its other side."""
    cdf = (row[ids].double() - row.double().max()).exp().cumsum(0)
    targets = uniforms * cdf[-1]
    at = torch.searchsorted(cdf, targets, right=True).clamp(max=len(ids) - 1)
    position = torch.searchsorted(torch.tensor(ids), drawn)
    assert bool((torch.tensor(ids)[position.clamp(max=len(ids) - 1)] == drawn).all()), (what, "a draw outside ids")
    step = torch.minimum(at, position)                  # the cdf entry between the two tokens
    near_step = (targets - cdf[step]).abs() <= rounding * cdf[-1]
    ok = (position == at) | (((position - at).abs() == 1) & near_step)
    bad = (~ok).nonzero().flatten()
    assert not bad.numel(), (what, f"{bad.numel()} draws off the inverse CDF, e.g. u={float(uniforms[bad[0]])!r} "
                                   f"drew {int(drawn[bad[0]])} where {ids[int(at[bad[0]])]} was due")


# Seeds of the tie rows below whose comb puts a target within float rounding of a CDF step (run seeds 10, 16 and
# 197: rows 2, 2 and 1); they failed CI once in twenty runs while the exact draw was required there.
BOUNDARY_SEEDS = (10009202, 16009220, 197009763)


@pytest.mark.parametrize("seed", [None, *BOUNDARY_SEEDS], ids=["run-seed", *map(str, BOUNDARY_SEEDS)])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_top_k_keeps_the_ties_with_the_kth_logit_as_transformers_does(impl, seed):
    """Integer logits give many ties. The kept set is transformers' (TopKLogitsWarper keeps every logit >= the
    k-th largest): `kept` counts it, and each draw of a uniform comb is the token the inverse CDF over that set
    gives, with its log-probability; in both the heap (small k) and nth_element (k > 1024) selections. A row
    whose k-th logit is -inf keeps every token (the finite ones are drawn)."""
    gen = torch.Generator().manual_seed(case_seed("top-k-ties") if seed is None else seed)
    vocab = 1500
    logits = torch.randint(0, 5, (4, vocab), generator=gen).float()
    logits[1, 300:] = float("-inf")                                # fewer finite tokens than some k
    logits[2] = torch.randint(0, 3, (vocab,), generator=gen).float()
    uniforms = torch.linspace(0, 1, 2001, dtype=torch.float64)[:-1]
    for k in (1, 3, 40, 700, 1100):
        out = IMPLEMENTATIONS[impl](logits, torch.full((4,), k), torch.ones(4, dtype=torch.float64),
                                    torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.bool),
                                    uniforms.repeat(4), torch.arange(5) * len(uniforms))
        for r in range(4):
            want = sorted(hf_top_k_kept(logits[r], k))
            finite_kth = bool(torch.isfinite(logits[r].topk(k).values[-1]))
            assert int(out.kept[r]) == (len(want) if finite_kth else vocab), (k, r)
            drawn = out.tokens[r * len(uniforms):(r + 1) * len(uniforms)]
            assert_inverse_cdf_draws(drawn, logits[r], want, uniforms, (k, r))
            logprobs = logits[r, drawn].double() - torch.logsumexp(logits[r, want].double(), 0)
            assert torch.allclose(out.logprobs[r * len(uniforms):(r + 1) * len(uniforms)], logprobs, atol=1e-6)


def previous_sampler_tokens(logits: torch.Tensor, requests, generator: torch.Generator):
    """The sort-based sampler this replaces: filter on a full sort (float32), inverse CDF over the whole
    vocabulary in float64, uniforms drawn in the same order."""
    scores = logits.clone()
    vocab = scores.shape[1]
    for i, r in enumerate(requests):
        p = r.params
        if p.is_greedy:
            continue
        row = scores[i] / p.temperature
        sorted_logits, order = row.sort(descending=True)
        ranks = torch.arange(vocab)
        sorted_logits = sorted_logits.masked_fill(ranks >= (p.top_k if p.top_k != -1 else vocab), float("-inf"))
        probs = sorted_logits.softmax(-1)
        if p.top_p < 1.0:
            sorted_logits = sorted_logits.masked_fill((probs.cumsum(-1) - probs) >= p.top_p, float("-inf"))
        probs = sorted_logits.softmax(-1)
        sorted_logits = sorted_logits.masked_fill(probs < p.min_p * probs[0], float("-inf"))
        scores[i] = torch.full_like(row, float("-inf")).scatter_(0, order, sorted_logits)
    tokens = {}
    sampled = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    cdf = scores[sampled].softmax(-1).double().cumsum(-1)
    shared = [n for n, i in enumerate(sampled) if requests[i].generator is None and requests[i].num_samples == 1]
    u = torch.rand(len(shared), 1, generator=generator, dtype=torch.float64)
    for (n, i), v in zip([(n, sampled[n]) for n in shared], u[:, 0]):
        tokens[i] = [int(torch.searchsorted(cdf[n], v * cdf[n, -1], right=True))]
    for n, i in enumerate(sampled):
        if i not in tokens:
            v = torch.rand(requests[i].num_samples, generator=requests[i].generator or generator, dtype=torch.float64)
            tokens[i] = torch.searchsorted(cdf[n], v * cdf[n, -1], right=True).tolist()
    return [tokens.get(i, [int(scores[i].argmax())] * r.num_samples) for i, r in enumerate(requests)]


def test_the_sampler_draws_what_the_sort_based_sampler_drew_for_a_seed():
    """Same engine seed, same per-request seeds: the same tokens (the arithmetic differs only in rounding)."""
    vocab = 3000
    logits = make_rows(case_seed("sampler-vs-previous"), 12, vocab)
    logits[2::3] = torch.nan_to_num(logits[2::3], neginf=-30.0)   # the previous sampler on -inf rows is not the point
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.3, min_p=0.05, n=3, seed=11),
              SamplingParams(temperature=1.0, top_k=100, top_p=0.8, min_p=0.01, seed=7),
              SamplingParams(temperature=0.7)] * 2
    seqs = [Sequence(list(range(5))) for _ in params]
    make = lambda: [SampleRequest(p, s, p.n, None if p.seed is None else torch.Generator().manual_seed(p.seed + i))
                    for i, (p, s) in enumerate(zip(params, seqs))]   # noqa: E731
    got = [r.token_ids for r in Sampler(seed=5).sample(logits.clone(), make())]
    want = previous_sampler_tokens(logits, make(), torch.Generator().manual_seed(5))
    assert got == want


@pytest.mark.parametrize("implementation", ["torch", "cpp"])
def test_plain_greedy_rows_mark_rows_without_a_finite_maximum(implementation):
    # the engine's greedy fast path: first maxima on the host, failed rows -1 and listed, log-normalisers optional
    from paged_backend.kernels import cpu_sampling
    from paged_backend.kernels.sampling import greedy_rows_torch

    greedy = greedy_rows_torch if implementation == "torch" else cpu_sampling.greedy_rows
    logits = torch.randn(4, 97)
    logits[0, 3] = logits[0, 40] = logits[0].max() + 1.0   # a tie: the first index wins
    logits[2, 11] = float("nan")
    logits[3] = float("-inf")
    draws = greedy(logits, with_norms=True)
    assert draws.tokens.device.type == "cpu" and draws.failed_rows == [2, 3]
    assert draws.tokens.tolist() == [3, int(logits[1].argmax()), -1, -1]
    assert abs(float(draws.log_norm[1]) - float(logits[1].double().logsumexp(-1))) < 1e-6
