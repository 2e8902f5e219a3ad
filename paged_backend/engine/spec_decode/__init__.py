"""Speculative decoding: proposers guess a sequence's next tokens, the target model verifies them in one step."""
