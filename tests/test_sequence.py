"""`Sequence.fork` copies what it means to (no mutable field shared with the parent, every field of `__init__`
set), and `SequenceGroup.abort` ends a request once, keeping its first error."""

from __future__ import annotations

from paged_backend import SamplingParams
from paged_backend.core.sequence import Sequence, SequenceGroup, SequenceStatus


class FakeGrammar:
    def __init__(self, tokens=()):
        self.tokens = list(tokens)

    def fork(self):
        return FakeGrammar(self.tokens)


def test_fork_sets_every_field_and_shares_no_mutable_one():
    parent = Sequence([1, 2, 3])
    parent.append_token(7, -0.5)
    parent.output_logprobs.append({7: -0.5})
    parent.beam_indices.append(0)
    parent.block_hashes.append(b"h")
    parent.grammar = FakeGrammar([7])
    parent.generator = object()
    child = parent.fork()
    assert set(vars(child)) == set(vars(Sequence([1]))), "fork must set exactly the fields __init__ sets"
    assert child.seq_id != parent.seq_id and child.token_ids == parent.token_ids
    for name, value in vars(parent).items():
        if isinstance(value, (list, dict, set)):
            assert getattr(child, name) is not value, f"{name} is shared between parent and fork"
    assert child.grammar is not parent.grammar and child.grammar.tokens == [7]
    assert child.generator is None  # the caller gives a seeded sample its own stream
    child.append_token(9, -1.0)
    assert parent.token_ids == [1, 2, 3, 7]


def test_abort_ends_every_unfinished_sequence_and_keeps_the_first_error():
    group = SequenceGroup("r", None, [1, 2], SamplingParams(n=2, temperature=1.0, stop_token_ids=[5]),
                          eos_token_ids=[0])
    assert group.stop_ids == (0, 5)
    group.seqs.append(group.seqs[0].fork())
    group.seqs[1].status = SequenceStatus.FINISHED_STOPPED
    group.abort("first")
    group.abort("second")
    assert group.error == "first"
    assert [s.status for s in group.seqs] == [SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_STOPPED]
    assert SequenceGroup("q", None, [1], SamplingParams(ignore_eos=True), eos_token_ids=[0]).stop_ids == ()
