"""Structured output: a request's grammar as a mask on the target's rows, and a check on its drafts.

A request that must follow a grammar (a JSON schema, JSON, a regex, a choice, a Lark grammar:
``ingress/structured.py`` turns each into llguidance's grammar text) carries a ``GrammarState``:
llguidance's matcher, advanced by every emitted token. Each step:

- ``admit`` checks the proposal against the grammar before it is verified: a drafted token the
  grammar forbids ends its branch there (``validate_tokens`` on a chain; a tree loses the node and
  its subtree), and the grammar's mask is computed for every row the verify will score, each on
  the prefix that row follows (a chain's row ``i + 1`` after its first ``i + 1`` drafted tokens);
- ``mask`` sets the logits of forbidden tokens to −inf in those rows, before the request's other
  processors (vLLM's order): verification then accepts against the grammar's distribution, and the
  output is what plain decoding under the grammar gives (docs/design.md §10);
- ``advance`` moves the matcher past the emitted tokens.

Where the grammar admits a single continuation, ``with_forced`` proposes it as the step's draft
("grammar-forced tokens as a draft", docs/design.md §10).

llguidance, not xgrammar: either computes a mask in a small fraction of a verify's time, but
llguidance has no dependencies (xgrammar pulls in triton), compiles a request's grammar faster, and
has the speculative primitives this needs: how many of a draft's tokens the grammar admits, forced
(fast-forward) tokens, rollback (docs/benchmarks.md §9.1).
"""

from __future__ import annotations

import functools
import logging

import llguidance
import llguidance.hf
import torch

from specserve.replicas.step import Proposal

logger = logging.getLogger("ray.serve")


@functools.cache
def _bitmasks():
    """llguidance's torch helpers, imported at first use: the module compiles its mask kernel
    with ``torch.compile``, whose import alone costs every process that never masks (the
    ingress, the policy service, the drafts) seconds of its start."""
    import llguidance.torch

    return llguidance.torch


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that went wrong: the request fails alone."""


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer, vocab: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: it walks the vocabulary)."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos_token_ids) or None)


def warm_up(make_tokenizer) -> None:
    """Build llguidance's tokenizer (``make_tokenizer()``, cached) and compile its mask kernel
    (``torch.compile``, on its first calls and again for other row counts: seconds each on a CPU)
    in a thread of their own: otherwise the first structured request of a replica waits for them,
    and so does every request in the batch whose verify applies the first masks. (The model
    thread still checks the compiled kernel once per new row count, a fraction of a compile.)"""
    torch.set_num_threads(1)   # a background thread beside the model's: one core at most
    try:
        tokenizer = make_tokenizer()
        with torch.inference_mode():
            for rows in (1, 2, 3, 4):
                masks = _bitmasks().allocate_token_bitmask(rows, tokenizer.vocab_size)
                _bitmasks().apply_token_bitmask_inplace(torch.zeros(rows, tokenizer.vocab_size), masks)
    except Exception as err:  # noqa: BLE001 - the first structured request then pays for it, or fails alone
        logger.warning("grammar warm-up failed (%s: %s)", type(err).__name__, err)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> str | None:
    """Why ``grammar`` (llguidance's text) cannot be used, or None when it can."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return messages[0] if is_error else None


class GrammarState:
    """One request's grammar. The matcher is built on the first ``admit`` (on the model thread: a
    large grammar takes a while to compile, which the event loop must not wait for)."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer, produced: list[int] = (),
                 ends: frozenset[int] = frozenset()):
        """``produced``: output the request emitted before it resumed here (a continuation), which
        the matcher moves past first. ``ends``: the tokens that end the output (the EOS, stop
        tokens): the matcher is never moved past one. (llguidance does not count an EOS it
        consumes in a stopped state as a token to roll back, so consuming one would make a
        rollback take one token too many.)"""
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.produced = list(produced)
        self.ends = ends
        self.matcher: llguidance.LLMatcher | None = None
        self._masks: torch.Tensor | None = None   # [rows, words] int32 bitmask of the admitted proposal's rows

    def _matcher(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            self.matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            self._raise_on_error()
            self.advance(self.produced)
        return self.matcher

    def _raise_on_error(self, where: str = "") -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed{where}: {self.matcher.get_error()}")

    def admit(self, proposal: Proposal) -> Proposal:
        """``proposal`` without what the grammar forbids; the masks of the rows it leaves are kept
        for ``mask``."""
        matcher = self._matcher()
        if proposal.is_chain:
            ok = matcher.validate_tokens(proposal.tokens) if proposal.tokens else 0
            kept = proposal if ok == len(proposal) else proposal.chain_from(0, ok)
            masks = _bitmasks().allocate_token_bitmask(len(kept) + 1, self.tokenizer.vocab_size)
            consumed = 0   # rows after an ending token are never emitted: they keep its row's mask
            for row, token in enumerate([*kept.tokens, None]):
                _bitmasks().fill_next_token_bitmask(matcher, masks, row)
                if token is not None and consumed == row and self._moves(token):
                    if not matcher.consume_token(token):
                        self._raise_on_error(" on a drafted token")
                    consumed += 1
            if consumed:
                matcher.rollback(consumed)
            self._masks = masks
            return kept
        return self._admit_tree(proposal)

    def _admit_tree(self, proposal: Proposal) -> Proposal:
        """A tree's nodes the grammar admits, depth first from the root, each node's row masked on
        the path to it."""
        matcher = self.matcher
        children: list[list[int]] = [[] for _ in range(len(proposal) + 1)]
        for node, parent in enumerate(proposal.parents):
            children[parent + 1].append(node)
        kept: list[int] = []
        rows: dict[int, int] = {}   # kept node -> its row in the masks (row 0: the root)
        masks = _bitmasks().allocate_token_bitmask(len(proposal) + 1, self.tokenizer.vocab_size)
        _bitmasks().fill_next_token_bitmask(matcher, masks, 0)

        def visit(row: int) -> None:
            for child in children[row]:
                token = proposal.tokens[child]
                if matcher.validate_tokens([token]) != 1:
                    continue
                moves = self._moves(token)
                if moves:
                    matcher.consume_token(token)
                kept.append(child)
                rows[child] = len(kept)
                _bitmasks().fill_next_token_bitmask(matcher, masks, len(kept))
                if moves:   # below an ending token nothing is emitted: its subtree is cut
                    visit(child + 1)
                    matcher.rollback(1)

        visit(0)
        self._raise_on_error()
        order = sorted(kept)   # parents before children, as a proposal needs
        index = {node: i for i, node in enumerate(order)}
        self._masks = masks[[0] + [rows[node] for node in order]]
        if len(order) == len(proposal):
            return proposal
        return Proposal(
            [proposal.tokens[n] for n in order],
            [-1 if proposal.parents[n] < 0 else index[proposal.parents[n]] for n in order],
            token_probs=None if proposal.token_probs is None else [proposal.token_probs[n] for n in order],
            root_probs=proposal.root_probs)

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [len(admitted proposal) + 1, V] -> float32 rows with what the grammar forbids at −inf."""
        rows = rows.float().clone()
        vocab = min(rows.shape[-1], self.tokenizer.vocab_size)
        _bitmasks().apply_token_bitmask_inplace(rows[:, :vocab], self._masks.to(rows.device))
        if rows.shape[-1] > vocab:   # ids the tokenizer does not have are never text
            rows[:, vocab:] = float("-inf")
        return rows

    def _moves(self, token: int) -> bool:
        """Whether the matcher moves past ``token``: not past the output's end, nor once the
        grammar is complete (only an EOS may follow then)."""
        return token not in self.ends and not self.matcher.is_stopped()

    def advance(self, emitted: list[int]) -> None:
        """Move past this step's emitted tokens (each one the grammar admitted)."""
        matcher = self._matcher()
        for token in emitted:
            if not self._moves(token):
                break
            if not matcher.consume_token(token):
                self._raise_on_error(f" on an emitted token ({emitted})")

    def with_forced(self, proposal: Proposal, limit: int) -> tuple[Proposal, int]:
        """The grammar as a draft: where it admits only one continuation from here (JSON's keys
        and punctuation under a schema), those tokens, at most ``limit``, are the proposal,
        unless the draft's own proposal already starts with them. Returns the proposal and how
        many of its tokens the grammar forced (0: the draft's). Lossless as any proposal: the
        verify accepts a forced token only where the target, masked, would emit it."""
        forced: list[int] = []
        for token in self._matcher().compute_ff_tokens():
            if len(forced) >= limit:
                break
            forced.append(token)
            if token in self.ends:
                break
        if not forced or proposal.tokens[:len(forced)] == forced:
            return proposal, 0
        return Proposal.chain(forced), len(forced)

