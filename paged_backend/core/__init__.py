"""Scheduling and block bookkeeping: sequences, the block pool and prefix cache, block tables, the scheduler.
Pure Python: nothing here imports torch, a tokenizer or a model."""
