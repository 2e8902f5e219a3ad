"""Logits to tokens: the batched sampler, beam search, per-request logits processors and token constraints."""
