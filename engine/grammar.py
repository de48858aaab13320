"""Structured output through xgrammar: a constraint compiles once per request into a matcher whose token mask
is applied to the logits in the batched sampler (``engine.sampling.apply_controls``) and which accepts each
sampled token. xgrammar is imported on the first constrained request only.

Kinds (the proto's StructuredOutput): ``json_schema`` (a JSON schema's text), ``json_object`` (any JSON
object), ``regex`` and ``ebnf`` (GBNF/EBNF with a ``root`` rule, xgrammar's dialect).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf")


class GrammarError(ValueError):
    """The constraint does not compile (the message says why)."""


class GrammarUnavailable(RuntimeError):
    """xgrammar is not installed."""


class Matcher:
    """One request's grammar state: ``fill_mask`` before a step, ``accept`` after it."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab] on the CPU: the tokens that keep the output inside the grammar."""
        bitmask = self._xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[0].unsqueeze(1) >> bits) & 1).bool().flatten()
        return allowed[:self._vocab_size]

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer (thread-safe; compiled grammars are cached by xgrammar)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._dir = Path(tokenizer_dir)
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._xgr: Any = None
        self._compiler: Any = None

    def _ready(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                    from transformers import PreTrainedTokenizerFast
                except ImportError as e:
                    raise GrammarUnavailable(f"structured output needs xgrammar (pip install xgrammar): {e}") from e
                hf = PreTrainedTokenizerFast(tokenizer_file=str(self._dir / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._eos or None)
                self._xgr, self._compiler = xgr, xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, kind: str, spec: str) -> Matcher:
        """A fresh matcher for the constraint. Raises GrammarError when it does not compile."""
        compiler = self._ready()
        try:
            # compact JSON (no free whitespace between tokens): a small model cannot wander off in blanks
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(spec)
            else:
                raise GrammarError(f"structured output kind must be one of {', '.join(KINDS)} (got {kind!r})")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip().splitlines()[0])[:300]
            raise GrammarError(f"the {kind} constraint does not compile: {why}") from None
        return Matcher(self._xgr, compiled, self._vocab_size)
