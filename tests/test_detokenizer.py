"""Incremental detokenization (engine/detokenizer.py) against decoding whole outputs: the text a sequence gathers
token by token (one token per step, or several, as an accepted speculation appends them) is the text of its
output ids decoded in the context of the prompt's last tokens, and every delta extends what came before."""

import random

import pytest

from paged_backend.core.sequence import Sequence
from paged_backend.engine.detokenizer import _CONTEXT_TOKENS, BatchDecoder, decode_new_texts

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n\nDone, twice:  spaces\tand tabs.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code, with \"quotes\"\n",
    "Café naïve façade — déjà vu; Straße, Ærø, ĳ, Ω≈ç√∫.",
    "日本語のテキストと中文的文本，还有한국어 문장도 있습니다。",
    "Emoji 🚀🔥👍🏽 and flags 🇫🇷🇯🇵 mixed with text 🤖.",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there!<|im_end|>",
]


def reference_text(tokenizer, token_ids, prompt_len, skip):
    """The output's text in the prompt's context: what the incremental decoding must reproduce."""
    start = max(prompt_len - _CONTEXT_TOKENS, 0)
    context = tokenizer.decode(token_ids[start:prompt_len], skip_special_tokens=skip)
    return tokenizer.decode(token_ids[start:], skip_special_tokens=skip)[len(context):]


def stream(decoder, prompt, output, skip, rng):
    """Append the output to a sequence in random chunks of 1-4 tokens, decoding after each; the deltas."""
    seq = Sequence(prompt)
    deltas = []
    i = 0
    while i < len(output):
        n = rng.randint(1, 4)
        seq.token_ids += output[i:i + n]
        i += n
        deltas += decode_new_texts(decoder, [seq], [skip])
    return seq, deltas


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_whole_decode(smollm2, skip):
    tokenizer = smollm2[1]
    decoder = BatchDecoder(tokenizer)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for cut in (1, 3, len(ids) // 2):
            prompt, output = ids[:cut], ids[cut:]
            seq, deltas = stream(decoder, prompt, output, skip, rng)
            assert "".join(deltas) == seq.output_text
            assert seq.output_text == reference_text(tokenizer, seq.token_ids, len(prompt), skip), (text, cut)


def test_random_ids_never_emit_what_the_whole_decode_lacks(smollm2):
    """Random ids (partial UTF-8 characters, special tokens): the emitted text is always a prefix of the whole
    decode's, and once the decode ends on a whole character it is all of it."""
    tokenizer = smollm2[1]
    decoder = BatchDecoder(tokenizer)
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        skip = rng.random() < 0.5
        seq, _ = stream(decoder, prompt, output, skip, rng)
        whole = reference_text(tokenizer, seq.token_ids, len(prompt), skip)
        assert whole.startswith(seq.output_text)
        if not whole.endswith("\ufffd"):
            assert seq.output_text == whole


def test_a_batch_decodes_as_each_alone(smollm2):
    """Sequences decoded together (mixed skip flags) get exactly the text each gets alone."""
    tokenizer = smollm2[1]
    decoder = BatchDecoder(tokenizer)
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]
    together = [Sequence(x[:2]) for x in ids]
    alone = [Sequence(x[:2]) for x in ids]
    skips = [i % 2 == 0 for i in range(len(ids))]
    for step in range(2, max(map(len, ids))):
        live = [i for i, x in enumerate(ids) if step < len(x)]
        for i in live:
            together[i].token_ids.append(ids[i][step])
            alone[i].token_ids.append(ids[i][step])
        batched = decode_new_texts(decoder, [together[i] for i in live], [skips[i] for i in live])
        single = [decode_new_texts(decoder, [alone[i]], [skips[i]])[0] for i in live]
        assert batched == single
    assert [s.output_text for s in together] == [s.output_text for s in alone]


def trained_tokenizer(kind: str):
    """A small tokenizer of another family, trained here on TEXTS: SentencePiece-style (Metaspace, whose decoder
    drops the first word's leading space) or WordPiece (whose decoder glues '##' pieces and cleans up spaces),
    the decoders whose text depends on the tokens before the new one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = TEXTS * 4
    if kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(),
                                         decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] +
                                      [f"<0x{b:02X}>" for b in range(256)])
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[SEP]"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=tok.id_to_token(0))


@pytest.mark.parametrize("kind", ["metaspace", "wordpiece"])
def test_context_dependent_decoders(kind):
    tokenizer = trained_tokenizer(kind)
    decoder = BatchDecoder(tokenizer)
    rng = random.Random(2)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for cut in (1, 2, len(ids) // 2):
            seq, deltas = stream(decoder, ids[:cut], ids[cut:], True, rng)
            assert "".join(deltas) == seq.output_text
            assert seq.output_text == reference_text(tokenizer, seq.token_ids, cut, True), (kind, text, cut)
