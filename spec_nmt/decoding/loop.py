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
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding.batch_rows import BatchDecoding, BatchRows
from spec_nmt.decoding.constraints import constrain
from spec_nmt.decoding.drafter import (
    Drafter,
    NoDrafter,
    drafter_for_rule,
    drafts_continuations,
    pending_tokens,
)
from spec_nmt.decoding.rules import RULES
from spec_nmt.decoding.static_loop import StaticLoop
from spec_nmt.decoding.trace import IterationRecord, trace_records
from spec_nmt.decoding.tree import DraftTree, block_depths, block_visibility
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DecodingSettings, DraftPlan

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

    def __init__(self, verifier, drafter, tgt_dict, settings: DecodingSettings,
                 static: Optional[StaticLoop] = None):  # fmt: skip
        """``static``: a static loop made earlier for this verifier and these settings (the
        task keeps them, with their captured graphs); by default one is made here."""
        if verifier.temperature != settings.temperature:
            raise ValueError("the verifier adapter's temperature differs from the settings'")
        self.verifier = verifier
        self.settings = settings
        self.plan = settings.draft_plan
        # k = 0, or a batch too large to draft for: the verifier alone, whatever drafter was
        # loaded
        self.no_drafter = NoDrafter(verifier.max_positions(), len(tgt_dict))
        drafter = drafter_for_rule(drafter, settings)
        self.drafter = drafter if self.plan.depth else self.no_drafter
        self.drafter.check_depth(self.plan.depth)
        self.verify = settings.verify
        self._rng: Optional[torch.Generator] = None
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.max_len = verifier.max_positions()
        self.stats = DecodingStats()
        # the static loop, for the batches it serves (settings.decoding_loop)
        self.static = static
        if static is None and StaticLoop.wanted(settings,
                                                next(verifier.model.parameters()).device):
            self.own_static_loop()

    def own_static_loop(self) -> StaticLoop:
        """A static loop of this generator's own, with nothing captured yet, in place of any it
        was given (the task shares one between generators of equal settings); returned, to
        be set up."""
        self.static = StaticLoop(self.verifier, self.settings, self.eos, self.pad, self.unk)
        return self.static

    def execution(self, src_lengths: Tensor, traced: bool = False) -> Tuple[Drafter, DraftPlan,
                                                                            bool]:  # fmt: skip
        """(drafter, draft plan, on the static loop) for a batch with these source lengths: the
        one place that decides. The static loop takes it where this generator has one
        (``StaticLoop.wanted``), it serves the batch (``StaticLoop.serves``) and no trace is
        asked for; it reads nothing from the device first, so every row counts for the
        drafting limit (an empty line changes the speed, not the tokens)."""
        if not traced and self.static is not None:
            drafter, plan = self._drafting(src_lengths.numel())
            if self.static.serves(plan, drafter):
                return drafter, plan, True
        drafter, plan = self._drafting(int((src_lengths > 1).sum()))
        return drafter, plan, False

    @property
    def on_static_loop(self) -> bool:
        """Whether the static loop decodes the batches this generator drafts for."""
        return self.execution(torch.tensor([2]))[2]  # (a sentence of one token and EOS)

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
        src_lengths = net_input.get("src_lengths")
        if src_lengths is None:
            src_lengths = src_tokens.ne(self.pad).sum(dim=1)
        drafter, plan, static = self.execution(src_lengths, trace is not None)
        if drafter is not self.drafter:
            self.stats.batches_without_drafts += 1
        if static:
            return self._generate_static(net_input, src_lengths, drafter, plan)
        max_lens = self._max_lengths(src_lengths)
        self._check_min_len(max_lens)
        rng = self.rng(src_tokens.device)
        batch = self._start(net_input, src_lengths, max_lens, drafter, plan)
        rows = batch.rows
        while rows.sentences:
            plan = self._iteration_plan(batch)
            # 1. draft
            tree = batch.drafter.propose(batch.drafter_state, rows.tokens, rows.lengths, plan, rng)
            # 2. score [pending token, tree nodes] in one verifier pass
            pending = pending_tokens(rows.tokens, rows.lengths).unsqueeze(1)
            depths = block_depths(tree)
            visible = None if plan.is_chain else block_visibility(tree.parents)
            block = torch.cat([pending, tree.tokens], dim=1)
            logits = self.verifier.score_logits(batch.verifier_state, block, depths, visible)
            normalizer = self.constrain(logits, rows.lengths, depths, rows.max_lens)
            # 3. accept a path, then the correction/bonus token
            path, n_accepted, next_tokens = self.accept(tree, logits, rng)
            n_accepted *= rows.live
            if trace is not None:
                trace.extend(trace_records(rows, tree, logits, normalizer, path, n_accepted,
                                           next_tokens, self.settings.beta, self.eos))  # fmt: skip
            # 4. commit: append, keep [pending, accepted path] in both caches
            ended = self._commit(batch, plan, tree, logits, normalizer, path, n_accepted,
                                 next_tokens)  # fmt: skip
            self._finish(batch, ended)
        self.stats.sentences += src_tokens.size(0)
        return batch.finalized

    def look_ahead(self, samples: Sequence[Dict]) -> None:
        """The batches this generator decodes next (fairseq samples, in order): a drafter that
        drafts ahead (``draft_ahead``: the twin, cheaper per sentence for several at once) is
        given the sentences of those it drafts for. Only under the lossless rule: the relaxed
        rule's output is its drafts', and which sample a seed draws depends on the drafts, and
        neither should depend on the sentences that come after."""
        draft_ahead = getattr(self.drafter, "draft_ahead", None)
        if draft_ahead is None or self.settings.verify != "top_beta" or self.settings.relaxed:
            return
        sources, limits = [], []
        for sample in samples:
            src_tokens = sample["net_input"]["src_tokens"]
            src_lengths = sample["net_input"]["src_lengths"]
            has_source = src_lengths > 1  # (an empty line is not decoded)
            if self.execution(src_lengths)[0] is self.drafter:
                rows = has_source.tolist()
                sources.extend(row for row, kept in zip(src_tokens.tolist(), rows) if kept)
                limits.extend(limit for limit, kept in
                              zip(self._max_lengths(src_lengths).tolist(), rows) if kept)
        draft_ahead(sources, limits)

    def _generate_static(self, net_input: Dict, src_lengths: Tensor, drafter: Drafter,
                         plan: DraftPlan):  # fmt: skip
        """``generate`` on the static loop (static_loop.py): the same hypotheses and totals,
        the length limits computed on the device."""
        max_lens = self._max_lengths(src_lengths)
        width = net_input["src_tokens"].size(1)  # the longest source
        longest = int(self._max_lengths(torch.tensor([width])))
        decoded = self.static.decode(net_input, src_lengths, max_lens, longest, drafter,
                                     plan.depth)  # fmt: skip
        self._check_min_len(self._max_lengths(decoded["src_lengths"]))
        source_lengths = decoded["src_lengths"].tolist()
        finalized = []
        for row, source_length in enumerate(source_lengths):
            length = int(decoded["lengths"][row])
            hypothesis = self._hypothesis(decoded["tokens"][row], decoded["scores"][row], length)
            if source_length > 1:  # (an empty line's EOS comes without decoding)
                hypothesis["spec_iterations"] = int(decoded["iterations"][row])
                hypothesis["spec_accepted_tokens"] = int(decoded["accepted"][row])
            finalized.append([hypothesis])
        iterations = int(decoded["iterations"].sum())
        self.stats.iterations += iterations
        self.stats.batched_verifier_calls += decoded["calls"]
        self.stats.drafted_tokens += int(decoded["drafted"].sum())
        self.stats.accepted_tokens += int(decoded["accepted"].sum())
        self.stats.output_tokens += int(decoded["lengths"].sum())
        self.stats.sentences += len(source_lengths)
        return finalized

    def _start(self, net_input: Dict, src_lengths: Tensor, max_lens: Tensor, drafter: Drafter,
               plan: DraftPlan) -> BatchDecoding:  # fmt: skip
        """Encode the batch and start both states. Empty source lines (the appended EOS only)
        get an empty translation without running the decoder; a typed "</s>" is text and gets
        translated, as by SequenceGenerator."""
        src_tokens = net_input["src_tokens"]
        bsz = src_tokens.size(0)
        has_source = src_lengths > 1
        width = int(max_lens.max())
        if plan.depth and drafts_continuations(drafter):
            plan = DraftPlan.chain(width, sample=plan.sample)  # (to the end of the sentence)
        slack = plan.depth + 1  # an iteration may write depth+1 tokens past the prefix
        tokens = src_tokens.new_full((bsz, width + 2 + slack), self.pad)
        tokens[:, 0] = self.eos
        scores = torch.zeros(bsz, width + 1 + slack, device=src_tokens.device)
        encoder_out = self.verifier.encode(net_input)
        verifier_state = self.verifier.start(net_input, encoder_out)
        batch = BatchDecoding(
            drafter=drafter, plan=plan, finalized=[[] for _ in range(bsz)],
            verifier_state=verifier_state,
            drafter_state=drafter.start(net_input, encoder_out, verifier_state),
            position_limit=drafter.max_positions() - 1,
            rows=BatchRows.start(tokens, scores, max_lens),
        )  # fmt: skip
        tokens[~has_source, 1] = self.eos
        for row in (~has_source).nonzero().squeeze(1).tolist():
            batch.finalized[row].append(self._hypothesis(tokens[row], scores[row], 1))
            self.stats.output_tokens += 1
        # From here on every per-sentence tensor has a row per state row
        rows = has_source.nonzero().squeeze(1)
        if rows.numel() < bsz:
            self._select(batch, rows)
        return batch

    def _iteration_plan(self, batch: BatchDecoding) -> DraftPlan:
        """The batch's plan, shrunk near the drafter's position limit (it cannot look past it)
        and, for a drafter of whole continuations, to what is left of the rows' length limits."""
        depth = batch.plan.depth
        rows = batch.rows
        if batch.longest + depth > batch.position_limit:
            batch.longest = int(rows.lengths[rows.live].max())
            depth = min(depth, max(batch.position_limit - batch.longest, 0))
        if depth and drafts_continuations(batch.drafter):
            depth = min(depth, int((rows.max_lens - rows.lengths)[rows.live].max()))
        return batch.plan if depth == batch.plan.depth else batch.plan.shrink(depth)

    def _commit(self, batch: BatchDecoding, plan: DraftPlan, tree: DraftTree, logits: Tensor,
                normalizer: Tensor, path: Tensor, n_accepted: Tensor,
                next_tokens: Tensor) -> Tensor:  # fmt: skip
        """Append each live row's accepted drafts and next token with their scores
        (``Rows.commit``), and keep [pending, accepted path] in both caches. Returns the rows
        this iteration finished."""
        rows = batch.rows
        kept = None  # a chain keeps its first entries
        drafts = tree.tokens
        if not plan.is_chain:
            root = torch.zeros_like(next_tokens).unsqueeze(1)
            kept = torch.cat([root, path.clamp(min=0) + 1], dim=1)
            drafts = tree.tokens.gather(1, path.clamp(min=0)) if path.size(1) else path
        emitted, _, ended = rows.commit(drafts, n_accepted, next_tokens, logits, normalizer,
                                        tree.valid.sum(dim=1), self.eos, kept)  # fmt: skip
        batch.longest += emitted.size(1)  # no row emits more
        n_kept = (n_accepted + 1) * (rows.live | ended)  # (the rows live before this commit)
        self.verifier.commit(batch.verifier_state, kept, n_kept)
        batch.drafter.commit(batch.drafter_state, kept, n_kept)
        self.stats.batched_verifier_calls += 1
        return ended

    def _finish(self, batch: BatchDecoding, ended: Tensor) -> None:
        """Finalize the rows that ended. Finished rows stay in the states (their results are
        ignored) until a quarter of them has finished: copying every cache out for each finished
        sentence costs more."""
        rows = batch.rows
        for i in ended.nonzero().squeeze(1).tolist():
            hypothesis = self._hypothesis(rows.tokens[i], rows.scores[i], rows.lengths[i])
            hypothesis["spec_iterations"] = int(rows.iterations[i])
            hypothesis["spec_accepted_tokens"] = int(rows.accepted[i])
            batch.finalized[rows.sentences[i]].append(hypothesis)
            batch.finished += 1
        if batch.finished and 4 * batch.finished >= len(rows.sentences):  # all is a quarter too
            self._count(rows, ~rows.live)
            keep = rows.live.nonzero().squeeze(1)
            batch.finished = 0
            self._select(batch, keep)

    def _count(self, rows: BatchRows, finished_rows: Tensor) -> None:
        """Add the rows that ``finished_rows`` (a mask) marks to the statistics."""
        per_row = (rows.lengths, rows.iterations, rows.accepted, rows.drafted)
        totals = torch.stack([counts[finished_rows].sum() for counts in per_row])
        output_tokens, iteration_count, accepted_tokens, drafted_tokens = totals.tolist()
        self.stats.output_tokens += output_tokens
        self.stats.iterations += iteration_count
        self.stats.accepted_tokens += accepted_tokens
        self.stats.drafted_tokens += drafted_tokens

    def accept(self, tree: DraftTree, logits: Tensor, rng: torch.Generator):
        """(path [B, depth] of accepted node indices padded with -1, n_accepted [B],
        next token [B]) under the configured rule, from the block's constrained logits."""
        return RULES[self.verify](tree, logits, self.settings, self.eos, rng)

    def _drafting(self, sentences: int) -> Tuple[Drafter, DraftPlan]:
        """(drafter, draft plan) for a batch of this many sentences to translate: no drafts
        (an empty chain, which commits without moving cache entries) above the settings'
        drafting batch limit."""
        limit = self.settings.draft_batch_limit(self.drafter)
        if limit and sentences > limit and self.drafter is not self.no_drafter:
            return self.no_drafter, DraftPlan.chain(0, sample=self.plan.sample)
        return self.drafter, self.plan

    def _select(self, batch: BatchDecoding, keep: Tensor) -> None:
        """Keep only rows ``keep`` of the batch: its per-row tensors and both states."""
        batch.rows.select(keep)
        if batch.rows.sentences:
            self.verifier.select_rows(batch.verifier_state, keep)
            batch.drafter.select_rows(batch.drafter_state, keep)

    def _check_min_len(self, limits: Tensor) -> None:
        if self.settings.min_len > int(limits.min()):
            raise SpecNmtError("--min-len cannot be larger than the maximum output length")

    def _max_lengths(self, src_lengths: Tensor) -> Tensor:
        """Each sentence's output length limit (``DecodingSettings.length_limits``).
        SequenceGenerator takes the padded width of the batch instead; a per-sentence limit
        keeps a translation independent of what else is in its batch (the same as
        SequenceGenerator's for a sentence decoded alone)."""
        return self.settings.length_limits(src_lengths, self.max_len)

    def constrain(self, logits: Tensor, lengths: Tensor, depths: Tensor,
                  max_lens: Tensor) -> Tensor:  # fmt: skip
        """fairseq's adjustments (constraints.constrain) of a block's logits [B, W, V], whose
        entry of depth d predicts output step lengths + d; returns the log-normaliser."""
        return constrain(logits, lengths.unsqueeze(1) + depths, max_lens, self.settings,
                         self.eos, self.pad, self.unk)  # fmt: skip

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
