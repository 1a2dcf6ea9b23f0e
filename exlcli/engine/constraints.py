"""Structured output: per-request grammar matchers over llguidance, and the token masks they give.

Chosen over xgrammar (scripts/constrained_mask_bench.py, 64 sequences of a nested schema, SmolLM2's
49k vocabulary, one thread on the 2-core CI box): xgrammar's masks are ~10x faster (4.5 us per
token per sequence median, 8.3 mean, against 38 and 101), but xgrammar 0.2.9 lets a string with
maxLength/minLength hold raw control characters and no escapes (mlc-ai/xgrammar#800, fix #880 still
open): the tests here caught invalid JSON from it. llguidance is also one 8 MB wheel with no
dependencies (xgrammar pulls triton, ~1 GB, and transformers). The masks of a step's constrained
rows are computed on the host while its forward pass runs (engine/grammar_masks.py), and in
parallel (LLExecutor) where there are cores to spare.

`GrammarCompiler` (one per engine; its tokenizer view is built on first use, ~0.4 s for 49k tokens)
turns a GrammarSpec into a `TokenConstraint`; bad schemas, regexes and grammars raise RequestError
with llguidance's message on one line.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Iterable

import torch

from exlcli.engine.grammar_check import GRAMMAR_NAMES, grammar_problem, grammar_text, one_line
from exlcli.errors import RequestError

if TYPE_CHECKING:

    from exlcli.engine.request import GrammarSpec


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab / 32)] host bitmask with every token allowed (bit t % 32 of word
    t // 32 set: token t may come next)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def _check_host_bitmask(bitmask: torch.Tensor) -> None:
    """llguidance writes through a raw pointer: the buffer must be what it assumes."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or not bitmask.is_contiguous():
        raise ValueError("a token bitmask is a contiguous int32 [rows, words] tensor in host memory")


def check_json_schema(schema: dict, strict: bool = False) -> None:
    """RequestError naming the problem if llguidance cannot compile `schema` (no tokenizer needed:
    a tool's parameter schema is checked when the request comes, before any grammar is built)."""
    problem = grammar_problem("json_schema", schema, strict)
    if problem is not None:
        raise RequestError(problem)


class TokenConstraint:
    """One request's matcher: the mask of the tokens that may come next, advanced token by token
    along the request's generated tokens (and rolled back if tokens are dropped)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        # (not llguidance.torch's helper: importing it runs torch.compile's set-up, ~7 s)
        _check_host_bitmask(bitmask)
        self.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)

    def accept(self, token: int) -> bool:
        """Advance on a generated token; False if the grammar does not allow it (the matcher is
        then in its error state for good)."""
        if not self.matcher.consume_token(token):
            return False
        self.num_accepted += 1
        return True

    def follow(self, output_ids: list[int]) -> None:
        """Bring the matcher to the end of `output_ids` (the request's generated tokens, of which it
        has accepted a prefix or more): roll back what was dropped, accept what is new."""
        extra = self.num_accepted - len(output_ids)
        if extra > 0:
            self.matcher.rollback(extra)
            self.num_accepted -= extra
        for token in output_ids[self.num_accepted:]:
            if not self.accept(token):
                raise RuntimeError(f"the grammar does not allow generated token {token}")

    def must_stop(self) -> bool:
        """The grammar is complete and allows nothing more (a stop token may have been taken)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarCompiler:
    """Turns GrammarSpecs into matchers for one tokenizer, and fills the masks of a batch of them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._executor: Any = None
        # Measured on 2 cores: a second mask thread saves little (28 vs 38 us/token median) and
        # takes the core the engine's forward pass runs on
        self.num_threads = max(1, min(8, (os.cpu_count() or 1) // 4))

    def _tokenizer_view(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                backend = getattr(getattr(self._tokenizer, "_backend", None), "tok", None)
                if backend is None or not hasattr(backend, "to_str"):
                    raise RequestError("structured output needs a tokenizer.json or GGUF (byte-level or BPE) "
                                       "tokenizer; this model's tokenizer cannot be used")
                self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.stop_ids or None)
                if self.num_threads > 1:
                    self._executor = llguidance.LLExecutor(self.num_threads)
            return self._lltok

    def constraint(self, spec: "GrammarSpec") -> TokenConstraint:
        """A fresh matcher for `spec`; RequestError naming the problem if it does not compile."""
        import llguidance

        lltok = self._tokenizer_view()
        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError) as e:
            raise RequestError(f"invalid {GRAMMAR_NAMES[spec.kind]}: {one_line(str(e))}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise RequestError(f"invalid {GRAMMAR_NAMES[spec.kind]}: {one_line(messages[0])}")
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {GRAMMAR_NAMES[spec.kind]}: {one_line(matcher.get_error())}")
        return TokenConstraint(matcher)

    @staticmethod
    def _grammar(spec: "GrammarSpec") -> str:
        # Compact JSON (no free whitespace): a small model in JSON mode otherwise loops on newlines.
        # strict: a keyword llguidance cannot enforce is an error; else it is ignored.
        return grammar_text(spec.kind, spec.value, spec.strict, {"whitespace_flexible": False})

    def fill_masks(self, constraints: list[TokenConstraint], rows: list[int], bitmask: torch.Tensor) -> None:
        """The next-token masks of `constraints` into those rows of `bitmask`."""
        if self._executor is not None and len(constraints) > 1:
            _check_host_bitmask(bitmask)
            self._executor.unsafe_compute_mask_ptr([(c.matcher, row) for c, row in zip(constraints, rows)],
                                                   bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
            return
        for c, row in zip(constraints, rows):
            c.fill_mask(bitmask, row)
