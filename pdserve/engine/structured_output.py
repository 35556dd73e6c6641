"""Grammar-constrained generation inside the engine: compile ahead, mask in the batch.

`StructuredOutputManager.grammar_for` starts compiling a request's constraint on a background
thread when the request arrives; the scheduler leaves the request waiting until its grammar is
ready, so a compile never lengthens a step. Each sequence then owns a `GrammarState`: an
xgrammar matcher advanced over every token the sequence already has (tokens sampled by a
remote prefill, or streamed before a migration) and then over each token it samples. At each
step `apply_grammar_masks` sets the logits of the tokens the grammar forbids to -inf for the
constrained rows only; the other rows of the batch are untouched.

Drafted sequences (ngram_drafts.py) keep only the drafts their grammar accepts
(`GrammarState.accepted_prefix`), and each drafted row is masked as the grammar stands after
the drafts before it (`GrammarState.after`): the matcher advances over them and rolls back.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.token_bitmask import apply_token_bitmask
from pdserve.structured_outputs import GrammarSpec, build_grammar

if TYPE_CHECKING:
    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept per engine


class GrammarState:
    """One sequence's position in its grammar. Not ready until the compile finishes."""

    def __init__(self, compiled: Future, release: Callable[[], None] | None = None):
        self._compiled = compiled
        self._release = release
        self._matcher = None
        self.error: str | None = None

    def release(self) -> None:
        """The sequence ended (finished or aborted): a compile nobody else waits for and
        that has not started is dropped, so abandoned requests cannot queue up compiles."""
        if self._release is not None:
            release, self._release = self._release, None
            release()

    @property
    def ready(self) -> bool:
        return self._compiled.done()

    @property
    def future(self) -> Future:
        return self._compiled

    def activate(self, prior_tokens: Sequence[int]) -> bool:
        """Make the matcher and advance it over `prior_tokens` (tokens this sequence got
        elsewhere). False, with `error` set, if the compile failed or a token is rejected."""
        if self._matcher is not None or self.error is not None:
            return self.error is None
        try:
            compiled = self._compiled.result()
        except Exception as e:  # noqa: BLE001 - the request fails, not the engine
            self.error = f"structured_outputs: cannot compile the constraint: {e}"
            return False
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(prior_tokens):
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                self.error = (f"output_token_ids: token {token} at position {i} does not match "
                              f"the request's structured_outputs constraint")
                return False
        if self._matcher.is_terminated():  # there is nothing left to generate
            self.error = ("output_token_ids: the structured_outputs constraint is already "
                          "complete (they end with its stop token)")
            return False
        return True

    @property
    def active(self) -> bool:
        return self._matcher is not None and self.error is None

    def accept(self, token: int) -> None:
        """Advance over a sampled token; a token the grammar forbids sets `error`."""
        if self.active and not self._matcher.accept_token(token):
            self.error = (f"structured_outputs: sampled token {token} does not match the "
                          f"constraint (the request's other settings, such as min_tokens, "
                          f"allowed_token_ids, bad_words or logit_bias, forbid every token it "
                          f"allows)")

    @property
    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted its end (a stop token)."""
        return self.active and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from where the sequence
        stands (none once it is complete); the state is left as it was."""
        if not self.active:
            return 0
        with self.advanced(tokens) as accepted:
            return accepted

    def after(self, tokens: Sequence[int]) -> GrammarState | _GrammarAfter:
        """This state as a row that follows `tokens` (drafts it accepts) sees it."""
        return _GrammarAfter(self, tokens) if tokens else self

    @contextmanager
    def advanced(self, tokens: Sequence[int]) -> Iterator[int]:
        """The matcher advanced over the longest accepted prefix of `tokens` (its length is
        yielded), rolled back on exit."""
        accepted = 0
        try:
            for token in tokens:
                if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                    break
                accepted += 1
            yield accepted
        finally:
            if accepted:
                self._matcher.rollback(accepted)


class _GrammarAfter:
    """A sequence's grammar as one of its drafted rows sees it: after the drafts before the
    row (which the grammar accepted when they were proposed). What apply_grammar_masks reads.
    Were a draft not accepted, its own row would forbid it, so it could not be kept and the
    rows after it, masked after the accepted ones only, could not matter."""

    __slots__ = ("state", "tokens")

    def __init__(self, state: GrammarState, tokens: Sequence[int]):
        self.state, self.tokens = state, tokens

    @property
    def active(self) -> bool:
        return self.state.active

    @property
    def error(self) -> str | None:
        return self.state.error

    @error.setter
    def error(self, value: str | None) -> None:
        self.state.error = value

    @property
    def is_terminated(self) -> bool:
        with self.state.advanced(self.tokens):
            return self.state.is_terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        with self.state.advanced(self.tokens):
            self.state.fill_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles constraints for one engine's tokenizer, off the engine's thread, with a
    cache: a constraint seen before is ready at once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler = None
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._waiters: dict[GrammarSpec, int] = {}  # live sequences of each spec

    def grammar_for(self, spec: GrammarSpec) -> GrammarState:
        """A new sequence's state; its grammar compiles in the background (once per spec)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                future = self._executor.submit(self._compile, spec)
                self._cache[spec] = future
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
            self._waiters[spec] = self._waiters.get(spec, 0) + 1
        return GrammarState(future, lambda: self._release(spec, future))

    def _release(self, spec: GrammarSpec, future: Future) -> None:
        with self._lock:
            left = self._waiters.get(spec, 1) - 1
            if left > 0:
                self._waiters[spec] = left
                return
            self._waiters.pop(spec, None)
            if future.cancel() and self._cache.get(spec) is future:  # queued, not started
                del self._cache[spec]

    def _compile(self, spec: GrammarSpec):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(build_grammar(spec))

    @staticmethod
    def wait_for_any(states: Sequence[GrammarState], timeout: float) -> None:
        """Block until one of `states` is ready (or `timeout` seconds pass)."""
        wait([s.future for s in states], timeout=timeout, return_when="FIRST_COMPLETED")

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[Request]) -> None:
    """In place on logits (B, V): forbid, in each constrained row, what its grammar forbids."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None
                   and row.grammar.active and not row.grammar.is_terminated]
    if not constrained:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # (B, ceil(V / 32))
    for i in constrained:
        rows[i].grammar.fill_bitmask(bitmask, i)
    for i in constrained:  # NOTE: one check a row: such a request fails, and only it
        if not bitmask[i].any():
            rows[i].grammar.error = ("structured_outputs: the constraint allows no next token "
                                     "(a grammar that accepts no text)")
    apply_token_bitmask(logits, bitmask, constrained)
