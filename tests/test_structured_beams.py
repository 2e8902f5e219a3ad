"""Beam search with structured outputs (issue 20, case 3).

Where the grammar leaves fewer continuations than the beams need, transformers' beam search keeps `-inf`
candidates (and candidates that just ended) as placeholder beams that can never outrank a real one; the
engine drops such a beam instead of feeding its token to the grammar. The real hypotheses (and their scores)
must equal those of transformers' `generate` run with the same grammar mask, in float32 and float64; on
smollm2, small choices and a small JSON schema with 2-4 beams finish with valid outputs and leak no block.
"""

from __future__ import annotations

import json

import jsonschema
import torch

from conftest import assert_no_leaks, get_model
from hf_grammar import hf_real_hypotheses
from paged_backend import LLMEngine, SamplingParams
from paged_backend.structured.matcher import GrammarState

EOS = 2
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
         "required": ["ok", "n"]}


TINY_CASES = [  # (prompt, constraint, beam_width, early_stopping, length_penalty)
    ("Pick one:", {"choice": ["yes", "no"]}, 3, False, 1.0),
    ("Pick:", {"choice": ["a", "b"]}, 3, False, 1.0),              # 2 first tokens for 3 beams
    ("Pick:", {"choice": ["a", "b"]}, 4, True, 0.0),
    ("Pick:", {"choice": ["1", "2", "3456789"]}, 6, True, 1.0),     # one long path among placeholders
    ("Size:", {"choice": ["a", "bb", "ccc", "dddd"]}, 4, "never", 2.0),
    ("JSON:", {"json": SMALL, "disable_any_whitespace": True}, 2, False, 1.0),
    ("JSON:", {"json": SMALL, "disable_any_whitespace": True}, 4, "never", 1.0),
]


def test_structured_beams_match_transformers_with_the_same_mask(dtype):
    model, tok = get_model("tiny-llama", dtype)
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    engine = LLMEngine(model, tokenizer=tok, num_blocks=256, block_size=8)
    requests = {}
    for i, (prompt, constraint, width, early, penalty) in enumerate(TINY_CASES):
        params = SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=16, early_stopping=early,
                                length_penalty=penalty, structured_outputs=constraint)
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        engine.add_request(str(i), prompt_ids, params)
        requests[str(i)] = (prompt_ids, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    padded = 0
    for rid, (prompt_ids, params) in requests.items():
        out = finals[rid]
        assert out.error is None, (rid, out.error)
        state = GrammarState(engine.intake.compile_grammar(params))
        want = hf_real_hypotheses(model, prompt_ids, params, state, EOS)
        padded += len(want) < params.n
        got = [(c.token_ids, c.beam_score) for c in out.outputs]
        assert [t for t, _ in got] == [t for t, _ in want], (rid, TINY_CASES[int(rid)])
        for (_, score), (_, ref) in zip(got, want):
            assert abs(score - ref) < tolerance, (rid, score, ref)
        assert all(c.finish_reason == "stop" for c in out.outputs if c.token_ids[-1] == EOS)
    assert padded >= 3  # the cases do leave transformers with placeholders among its n outputs
    assert_no_leaks(engine)


SMOLLM2_CASES = [
    ("Answer yes or no: is the sky blue?", {"choice": ["yes", "no"]}, 2),
    ("Pick a colour:", {"choice": ["red", "green", "blue"]}, 3),
    ("Pick a size:", {"choice": ["small", "medium", "large", "huge"]}, 4),
    ("Describe a flag as JSON:", {"json": SMALL}, 2),
    ("Describe a flag as JSON:", {"json": SMALL}, 3),
    ("Describe a flag as JSON:", {"json": SMALL}, 4),
]


def test_structured_beams_finish_with_valid_outputs_on_smollm2(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tokenizer=tok, num_blocks=128, block_size=16)
    for i, (prompt, constraint, width) in enumerate(SMOLLM2_CASES):
        engine.add_request(str(i), prompt, SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=40,
                                                          structured_outputs=constraint))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for i, (_, constraint, width) in enumerate(SMOLLM2_CASES):
        out = finals[str(i)]
        assert out.error is None, (i, out.error)
        assert 1 <= len(out.outputs) <= width
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (i, completion)
            if "choice" in constraint:
                assert completion.text in constraint["choice"], (i, completion.text)
            else:
                jsonschema.validate(json.loads(completion.text), constraint["json"])
    assert_no_leaks(engine)
