"""Structured outputs: the constraint parameters, grammar compilation (xgrammar) and per-sequence matchers."""
