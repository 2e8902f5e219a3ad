"""Compile `StructuredOutputsParams` into xgrammar grammars for one tokenizer, with a cache.

One `StructuredOutputsCompiler` per (tokenizer, model vocabulary size, stop token ids): it builds xgrammar's
`TokenizerInfo` once (sized to the model's logits, which may be wider or narrower than the tokenizer's
vocabulary) and keeps the most recently used compiled grammars, so the same schema is compiled once.
Compilation errors (an invalid schema, regex or grammar) come out as `ValueError`; the engine calls
`compile` at `add_request`, so a bad constraint fails that request, never a step.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from paged_backend.structured.params import StructuredOutputsParams

# Whitespace characters allowed between two JSON tokens when any whitespace is allowed: enough for
# pretty-printed output, and a bound on the runs of newlines small models fall into under a JSON grammar.
MAX_JSON_WHITESPACE = 32
DEFAULT_CACHE_SIZE = 256
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar():
    import xgrammar  # imported on first use: it pulls in tvm-ffi, which plain requests do not need

    return xgrammar


def _clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(exc).strip()).strip()


_NOT_SCHEMAS = ("enum", "const", "default", "examples")


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of a JSON schema whose length-bounded strings carry the bound as a `pattern` instead.

    xgrammar 0.2.9 compiles `minLength`/`maxLength` strings to a character class that admits raw control
    characters (a tab inside a string: invalid JSON) and no escapes (mlc-ai/xgrammar#800); its `pattern`
    path matches JSON string content properly. `^.{min,max}$` keeps the bound (still without escapes).
    Strings that already have a `pattern` or a `format` are left alone.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in _NOT_SCHEMAS else bounded_strings_as_patterns(value))
           for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


def _is_ebnf(grammar: str) -> bool:
    """xgrammar EBNF (GBNF) uses `::=`; anything else is taken as Lark (as vLLM's xgrammar backend does)."""
    return "::=" in grammar


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings (JSON escapes are valid EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _special_token_ids(tokenizer) -> set:
    """Ids that detokenization drops (`skip_special_tokens`): a grammar must never produce them as text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    return ids | {int(i) for i in getattr(tokenizer, "all_special_ids", [])}


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """xgrammar's TokenizerInfo for a Hugging Face tokenizer, sized to the model's logits.

    Ids at or above the tokenizer's vocabulary (padding of the model's output layer) and the tokenizer's
    special tokens get an empty string, which xgrammar treats as special: never allowed by a grammar (the
    stop ids stay allowed where the grammar is complete).
    """
    xgr = _xgrammar()
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    special = _special_token_ids(tokenizer)
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special:
            encoded[index] = token
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=detected.add_prefix_space)


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar and the key it was compiled from."""

    key: Tuple
    grammar: Any            # xgrammar.CompiledGrammar
    vocab_size: int
    stop_token_ids: Tuple[int, ...]


@dataclass
class CompilerStats:
    compiled: int = 0
    hits: int = 0


class StructuredOutputsCompiler:
    """Compiles constraints for one tokenizer and model vocabulary; thread-safe, with an LRU cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 2) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        stops = tuple(int(t) for t in stop_token_ids)
        if not stops:
            raise ValueError("structured outputs need at least one stop (EOS) token id")
        bad = [t for t in stops if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.stop_token_ids = stops
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, stops)
        self._compiler = _xgrammar().GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: "OrderedDict[Tuple, CompiledConstraint]" = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompilerStats()

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled grammar for `params` (cached); ValueError if the constraint does not compile."""
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(f"expected StructuredOutputsParams, got {type(params).__name__}")
        key = params.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return cached
        grammar = self._compile_uncached(params)
        compiled = CompiledConstraint(key, grammar, self.vocab_size, self.stop_token_ids)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            self.stats.compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError if `params` does not compile (the result stays cached for the request)."""
        self.compile(params)

    def _compile_uncached(self, params: StructuredOutputsParams):
        kind = params.kind
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(
                    json.dumps(bounded_strings_as_patterns(params.schema)), **self._whitespace(params))
            if kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, **self._whitespace(params))
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_to_ebnf(params.choice))
            if _is_ebnf(params.grammar):
                return self._compiler.compile_grammar(params.grammar)
            return self._compiler.compile_lark(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_clean_error(exc)}") from None

    @staticmethod
    def _whitespace(params: StructuredOutputsParams) -> Dict[str, Any]:
        if params.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


_compilers: "weakref.WeakKeyDictionary[Any, Dict[Tuple, StructuredOutputsCompiler]]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> StructuredOutputsCompiler:
    """The shared compiler of this tokenizer object for a vocabulary size and stop ids (built once).

    A tokenizer that cannot be weakly referenced or hashed gets a compiler of its own each call.
    """
    key = (int(vocab_size), tuple(int(t) for t in stop_token_ids))
    with _compilers_lock:
        try:
            per_tokenizer = _compilers.setdefault(tokenizer, {})
        except TypeError:
            return StructuredOutputsCompiler(tokenizer, vocab_size, stop_token_ids)
        compiler: Optional[StructuredOutputsCompiler] = per_tokenizer.get(key)
        if compiler is None:
            compiler = per_tokenizer[key] = StructuredOutputsCompiler(tokenizer, vocab_size, stop_token_ids)
        return compiler
