"""The speculative decoding loop, as a drop-in for fairseq's ``SequenceGenerator``.

Each iteration, for every unfinished sentence of the batch:
  1. draft:  the drafter proposes a draft tree after the verified prefix (a chain of k tokens,
             or with --tree-branching / --tree-budget a wider tree: the drafter's best tokens or
             beam search's sequences for top-beta/tau, drawn ones for RSD);
  2. score:  the verifier scores [pending token, tree nodes] in one pass on its KV cache;
  3. accept: the rule keeps a path of drafts, then the verifier's own token follows (correction
             at the first rejection, bonus after a fully accepted path);
  4. commit: accepted tokens join the prefix, verifier and drafter caches drop everything else,
             finished sentences leave the batch (the states are compacted once a quarter of
             their rows has finished; until then finished rows are carried and ignored).
Every iteration emits at least one token, so even a useless drafter degrades to plain decoding.
A batch of more sentences than the settings' drafting limit (--max-draft-batch) drafts nothing:
the verifier decodes it alone on the same loop.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.drafter import Drafter, NoDrafter
from spec_nmt.settings import DraftPlan
from spec_nmt.settings import DecodingSettings
from spec_nmt.decoding.rules import RULES
from spec_nmt.decoding.tree import DraftTree, block_depths, block_visibility
from spec_nmt.errors import SpecNmtError

logger = logging.getLogger(__name__)


@dataclass
class DecodingStats:
    """Totals over everything a generator decoded. An iteration is one verifier call for one
    sentence; ``batched_verifier_calls`` counts the calls for whole batches."""

    sentences: int = 0
    iterations: int = 0
    batched_verifier_calls: int = 0
    batches_without_drafts: int = 0  # more sentences than the drafting limit
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    output_tokens: int = 0

    @property
    def mean_accepted_per_iteration(self) -> float:
        return self.accepted_tokens / max(self.iterations, 1)

    def summary(self) -> str:
        return (
            f"speculative decoding: {self.sentences} sentences, {self.iterations} iterations "
            f"({self.batched_verifier_calls} batched verifier calls), "
            f"{self.drafted_tokens} drafted tokens, {self.accepted_tokens} accepted tokens, "
            f"{self.output_tokens} output tokens, "
            f"mean accepted tokens per iteration {self.mean_accepted_per_iteration:.2f}"
            + (f"; {self.batches_without_drafts} batches of more sentences than "
               "--max-draft-batch decoded without drafts" if self.batches_without_drafts else "")
        )


@dataclass
class IterationRecord:
    """What one iteration did for one sentence (``generate(..., trace=[])``), as plain data."""

    sentence: int  # row of the batch
    prefix: List[int]  # verified output tokens before the iteration
    draft_tokens: List[int]  # the draft tree's nodes ...
    draft_parents: List[int]  # ... and each node's parent (-1: the root)
    candidates: List[List[int]]  # per block entry: the verifier's best tokens (beta, at least 3)
    candidate_logprobs: List[List[float]]
    accepted_path: List[int]  # accepted nodes, root to leaf
    next_token: int  # the verifier's token after them
    next_kind: str  # "correction" (after a rejection) or "bonus" (after a leaf)
    ended_by_accepted_eos: bool


class SpeculativeGenerator:
    """Generates translations like ``SequenceGenerator`` (``--beam 1``, or ``--sampling`` for the
    sampling rules) with the same penalties, hypothesis format (tokens, score, positional_scores
    from the verifier) and length limits, except that each sentence's limit comes from its own
    source length rather than the batch's padded width (see ``_max_lengths``).

    ``settings`` (settings.py) pick the rule (``top_beta``: greedy drafts judged by ``beta`` and
    ``tau``; ``sampling``: speculative sampling over a sampled chain; ``rsd``: recursive rejection
    sampling over a draft tree), the drafts' shape and fairseq's generation settings. The
    verifier adapter must apply the same temperature. Sampling uses its own ``torch.Generator``
    seeded with the settings' seed, so equal seeds give equal outputs.
    """

    def __init__(self, verifier, drafter, tgt_dict, settings: DecodingSettings):
        if verifier.temperature != settings.temperature:
            raise ValueError("the verifier adapter's temperature differs from the settings'")
        self.verifier = verifier
        self.settings = settings
        self.plan = settings.draft_plan
        # k = 0, or a batch too large to draft for: the verifier alone, whatever drafter was
        # loaded
        self.no_drafter = NoDrafter(verifier.max_positions(), len(tgt_dict))
        self.drafter = drafter if self.plan.depth else self.no_drafter
        self.drafter.check_depth(self.plan.depth)
        self.verify = settings.verify
        self._rng: Optional[torch.Generator] = None
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.max_len = verifier.max_positions()
        self.stats = DecodingStats()

    def rng(self, device: torch.device) -> torch.Generator:
        """The sampling generator: one per decoder, seeded once, so a run is reproducible."""
        if self._rng is None or self._rng.device != device:
            self._rng = torch.Generator(device=device).manual_seed(self.settings.seed)
        return self._rng

    @torch.no_grad()
    def generate(
        self,
        models,
        sample: Dict,
        prefix_tokens=None,
        constraints=None,
        trace: Optional[List[IterationRecord]] = None,
        **unused,
    ):
        """fairseq's hypotheses per sentence. With a ``trace`` list, one ``IterationRecord`` per
        sentence and iteration is appended to it."""
        if prefix_tokens is not None or constraints is not None:
            raise SpecNmtError("speculative decoding does not support prefix tokens or constraints")
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        bsz = src_tokens.size(0)
        src_lengths = net_input.get("src_lengths")
        if src_lengths is None:
            src_lengths = src_tokens.ne(self.pad).sum(dim=1)
        max_lens = self._max_lengths(src_lengths)
        if self.settings.min_len > int(max_lens.min()):
            raise SpecNmtError("--min-len cannot be larger than the maximum output length")
        rng = self.rng(src_tokens.device)
        # Empty source lines (the appended EOS only) get an empty translation without running
        # the decoder; a typed "</s>" is text and gets translated, as by SequenceGenerator.
        has_source = src_lengths > 1
        drafter, full_plan = self._drafting(int(has_source.sum()))
        if drafter is not self.drafter:
            self.stats.batches_without_drafts += 1

        slack = full_plan.depth + 1  # an iteration may write depth+1 tokens past the prefix
        width = int(max_lens.max())
        tokens = src_tokens.new_full((bsz, width + 2 + slack), self.pad)
        tokens[:, 0] = self.eos
        token_scores = torch.zeros(bsz, width + 1 + slack, device=src_tokens.device)
        finalized: List[List[Dict]] = [[] for _ in range(bsz)]

        encoder_out = self.verifier.encode(net_input)
        verifier_state = self.verifier.start(net_input, encoder_out)
        drafter_state = drafter.start(net_input, encoder_out)
        del encoder_out  # the states hold what they need of it
        tokens[~has_source, 1] = self.eos
        for row in (~has_source).nonzero().squeeze(1).tolist():
            finalized[row].append(self._hypothesis(tokens[row], token_scores[row], 1))
            self.stats.output_tokens += 1
        # From here on every per-sentence tensor has a row per state row; ``sentences`` holds
        # each state row's sentence in the batch.
        rows = has_source.nonzero().squeeze(1)
        if rows.numel() < bsz:
            self._select(drafter, verifier_state, drafter_state, rows)
            tokens, token_scores, max_lens = tokens[rows], token_scores[rows], max_lens[rows]
        sentences = rows.tolist()
        device = tokens.device
        lengths = tokens.new_zeros(len(sentences))  # verified output tokens per row
        iterations = torch.zeros_like(lengths)
        accepted = torch.zeros_like(lengths)
        drafted = torch.zeros_like(lengths)
        # Finished rows stay in the states (their results are ignored) until a quarter of them
        # has finished: copying every cache out for each finished sentence costs more.
        live = torch.ones_like(lengths, dtype=torch.bool)
        finished = 0
        # an upper bound of the longest live prefix: the position limit is checked on the
        # device only when it could be near
        longest = 0
        position_limit = drafter.max_positions() - 1

        while sentences:
            depth = full_plan.depth
            # The drafter cannot look past its own position limit: shrink the drafts near it.
            if longest + depth > position_limit:
                longest = int(lengths[live].max())
                depth = min(depth, max(position_limit - longest, 0))
            plan = full_plan if depth == full_plan.depth else full_plan.shrink(depth)
            # 1. draft
            tree = drafter.propose(drafter_state, tokens, lengths, plan, rng)
            # 2. score [pending token, tree nodes] in one verifier pass
            pending = tokens.gather(1, lengths.unsqueeze(1))
            depths = block_depths(tree)
            visible = None if plan.is_chain else block_visibility(tree.parents)
            block = torch.cat([pending, tree.tokens], dim=1)
            logits = self.verifier.score_logits(verifier_state, block, depths, visible)
            normalizer = self._constrain(logits, lengths, depths, max_lens)
            # 3. accept a path, then the correction/bonus token
            path, n_accepted, next_tokens = self._accept(tree, logits, rng)
            n_accepted *= live
            path_tokens = tree.tokens.gather(1, path.clamp(min=0)) if path.size(1) else path
            if trace is not None:
                trace.extend(self._trace_records(sentences, live, tokens, lengths, tree, logits,
                                                 normalizer, path, n_accepted,
                                                 next_tokens))  # fmt: skip
            emitted, n_emitted, ended = _emitted_tokens(
                path_tokens, n_accepted, next_tokens, self.eos
            )
            n_emitted *= live
            # 4. commit: append, keep [pending, accepted path] in both caches
            kept_entries = torch.cat([torch.zeros_like(pending), path.clamp(min=0) + 1], dim=1)
            slots = lengths.unsqueeze(1) + 1 + torch.arange(emitted.size(1), device=device)
            tokens.scatter_(1, slots, emitted)
            state_rows = torch.arange(len(sentences), device=device).unsqueeze(1)
            emitted_logits = logits[state_rows, kept_entries, emitted]
            emitted_scores = emitted_logits - normalizer.gather(1, kept_entries)
            token_scores.scatter_(1, slots - 1, emitted_scores)
            lengths += n_emitted
            longest += emitted.size(1)  # no row emits more
            iterations += live
            accepted += n_accepted
            drafted += (tree.valid & live.unsqueeze(1)).sum(dim=1)
            n_kept = (n_accepted + 1) * live
            kept = None if plan.is_chain else kept_entries  # a chain keeps its first entries
            self.verifier.commit(verifier_state, kept, n_kept)
            drafter.commit(drafter_state, kept, n_kept)
            self.stats.batched_verifier_calls += 1
            ended &= live
            for i in ended.nonzero().squeeze(1).tolist():
                hypothesis = self._hypothesis(tokens[i], token_scores[i], lengths[i])
                hypothesis["spec_iterations"] = int(iterations[i])
                hypothesis["spec_accepted_tokens"] = int(accepted[i])
                finalized[sentences[i]].append(hypothesis)
                finished += 1
            live &= ~ended
            if finished and 4 * finished >= len(sentences):  # all finished is a quarter too
                self._count(lengths, iterations, accepted, drafted, ~live)
                keep = live.nonzero().squeeze(1)
                live = live[keep]
                tokens, token_scores, lengths = tokens[keep], token_scores[keep], lengths[keep]
                iterations, accepted, drafted = iterations[keep], accepted[keep], drafted[keep]
                max_lens = max_lens[keep]
                sentences = [sentences[i] for i in keep.tolist()]
                finished = 0
                if sentences:
                    self._select(drafter, verifier_state, drafter_state, keep)

        self.stats.sentences += bsz
        return finalized

    def _count(self, lengths: Tensor, iterations: Tensor, accepted: Tensor, drafted: Tensor,
               finished_rows: Tensor) -> None:  # fmt: skip
        """Add the rows that ``finished_rows`` (a mask) marks to the statistics."""
        per_row = (lengths, iterations, accepted, drafted)
        totals = torch.stack([counts[finished_rows].sum() for counts in per_row])
        output_tokens, iteration_count, accepted_tokens, drafted_tokens = totals.tolist()
        self.stats.output_tokens += output_tokens
        self.stats.iterations += iteration_count
        self.stats.accepted_tokens += accepted_tokens
        self.stats.drafted_tokens += drafted_tokens

    def _accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator):
        """(path [B, depth] of accepted node indices padded with -1, n_accepted [B],
        next token [B]) under the configured rule, from the block's constrained logits."""
        return RULES[self.verify].accept(tree, logits, self.settings, self.eos, rng)

    def _trace_records(self, sentences, live, tokens, lengths, tree, logits, normalizer, path,
                       n_accepted, next_tokens):  # fmt: skip
        """What one iteration did for each unfinished state row (``sentences``: each one's
        sentence in the batch), as plain Python data: the verified
        prefix, the draft tree, the verifier's best candidates at every block entry (its beta
        best, at least 3) with log-probs, the accepted path and the correction/bonus token."""
        n_best = min(max(self.settings.beta, 3), logits.size(2))
        best_logits, best_tokens = logits.topk(n_best, dim=2)
        best_logprobs = best_logits - normalizer.unsqueeze(2)
        records = []
        for i, sentence in enumerate(sentences):
            if not live[i]:
                continue
            n = int(n_accepted[i])
            accepted = path[i, :n].tolist()
            # a bonus token follows an entry without children to try; else a correction
            leaf = _is_leaf(tree, i, accepted[-1] if n else -1)
            records.append(IterationRecord(
                sentence=sentence,
                prefix=tokens[i, 1 : int(lengths[i]) + 1].tolist(),
                draft_tokens=tree.tokens[i].tolist(),
                draft_parents=tree.parents[i].tolist(),
                candidates=best_tokens[i].tolist(),
                candidate_logprobs=best_logprobs[i].float().tolist(),
                accepted_path=accepted,
                next_token=int(next_tokens[i]),
                next_kind="bonus" if leaf else "correction",
                ended_by_accepted_eos=bool(n and tree.tokens[i, accepted[-1]] == self.eos),
            ))  # fmt: skip
        return records

    def _drafting(self, sentences: int) -> Tuple[Drafter, DraftPlan]:
        """(drafter, draft plan) for a batch of this many sentences to translate: no drafts
        (an empty chain, which commits without moving cache entries) above the settings'
        drafting batch limit."""
        limit = self.settings.draft_batch_limit
        if limit and sentences > limit and self.drafter is not self.no_drafter:
            return self.no_drafter, DraftPlan.chain(0, sample=self.plan.sample)
        return self.drafter, self.plan

    def _select(self, drafter, verifier_state, drafter_state, keep: Tensor) -> None:
        """Keep only rows ``keep`` in the verifier's and ``drafter``'s states."""
        self.verifier.select_rows(verifier_state, keep)
        drafter.select_rows(drafter_state, keep)

    def _max_lengths(self, src_lengths: Tensor) -> Tensor:
        """Each sentence's output length limit, max_len_a * its source length + max_len_b, in
        SequenceGenerator's arithmetic. SequenceGenerator takes the padded width of the batch
        instead; a per-sentence limit keeps a translation independent of what else is in its
        batch (the same as SequenceGenerator's for a sentence decoded alone)."""
        a, b = self.settings.max_len_a, self.settings.max_len_b
        limits = [min(int(a * length + b), self.max_len - 1) for length in src_lengths.tolist()]
        return torch.tensor(limits, device=src_lengths.device)

    def _constrain(
        self, logits: Tensor, lengths: Tensor, depths: Tensor, max_lens: Tensor
    ) -> Tensor:
        """Make in ``logits`` [B, W, V] the adjustments SequenceGenerator makes to every step's
        log-probs, for every block entry at once (the token predicted at an entry of depth d is
        output step lengths + d), touching only the columns and entries concerned. Returns the
        log-normaliser [B, W] of the unadjusted distribution: ``logits - normaliser`` are
        fairseq's adjusted log-probs, and the rules only compare tokens of one entry, which a
        per-entry shift does not change."""
        normalizer = torch.logsumexp(logits, dim=-1)
        broken = normalizer.isnan()
        if broken.any():  # a NaN logit makes fairseq's log-probs NaN, then -inf, at that step
            logits[broken] = float("-inf")
            normalizer = normalizer.masked_fill(broken, 0.0)
        logits[:, :, self.pad] = float("-inf")
        if self.settings.unkpen:
            logits[:, :, self.unk] -= self.settings.unkpen
        steps = lengths.unsqueeze(1) + depths
        force_eos = steps.ge(max_lens.unsqueeze(1))
        if force_eos.any():
            eos_logits = logits[:, :, self.eos].clone()
            logits.masked_fill_(force_eos.unsqueeze(2), float("-inf"))
            logits[:, :, self.eos] = eos_logits
        logits[:, :, self.eos].masked_fill_(steps.lt(self.settings.min_len), float("-inf"))
        return normalizer

    def _hypothesis(self, row_tokens: Tensor, row_scores: Tensor, length) -> Dict:
        length = int(length)
        positional_scores = row_scores[:length].clone()
        score = positional_scores.sum()
        if not self.settings.unnormalized:
            score = score / length**self.settings.lenpen
        return {
            "tokens": row_tokens[1 : length + 1].clone(),
            "score": score,
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": positional_scores,
        }

    def log_summary(self) -> None:
        if self.stats.sentences:
            logger.info(self.stats.summary())


def _is_leaf(tree: DraftTree, row: int, node: int) -> bool:
    """Whether a node (-1: the root) of a row's draft tree has no valid children."""
    return not bool((tree.parents[row].eq(node) & tree.valid[row]).any())


def _emitted_tokens(drafts: Tensor, n_accepted: Tensor, next_tokens: Tensor, eos: int):
    """What an iteration appends to each row, given the drafts along the accepted path [B, k]
    (the first n_accepted count): tokens [B, k+1] (the accepted drafts, then the
    correction/bonus token unless an accepted EOS ended the sentence), how many of them count
    [B], and whether the row is finished [B]."""
    k = drafts.size(1)
    emitted = torch.cat([drafts, drafts.new_zeros(drafts.size(0), 1)], dim=1)
    emitted.scatter_(1, n_accepted.unsqueeze(1), next_tokens.unsqueeze(1))
    accepted_mask = torch.arange(k, device=drafts.device) < n_accepted.unsqueeze(1)
    eos_accepted = (drafts.eq(eos) & accepted_mask).any(dim=1)
    ended = eos_accepted | next_tokens.eq(eos)
    return emitted, n_accepted + (~eos_accepted).long(), ended
