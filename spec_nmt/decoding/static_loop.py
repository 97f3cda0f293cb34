"""The static-shape decoding loop: a batch's tensors allocated once at their final size, one host
read per iteration, and on CUDA each iteration replayed as one captured graph.

The dynamic loop (loop.py) grows its caches, drops finished sentences and reads sizes from the
device to slice; on a GPU each read makes the host wait (about 8 per verifier call), and the few
hundred small kernels of an iteration are launched one by one from Python. Here, per batch:
- the verifier's and the drafter's self-attention caches hold ``capacity`` slots per row (the
  batch's output limit plus room for one iteration's blocks; the CTC drafter's its extra masks
  more), written in place at each row's positions. Attention reads the whole cache under a
  mask built on the device from each row's length, so a rejected entry costs nothing: the next
  block overwrites it;
- every block has a fixed width. The verifier scores [pending token, k drafts]; the cached
  drafter feeds k + 1 prefix slots (the at most k + 1 tokens committed since its last call, then
  slots no mask sees) and its k masks (N x k in its CTC form); the feature drafter feeds the
  verifier's k + 1 states of its last block the same way, then takes k one-entry steps;
- acceptance (top-beta/tau, lossless with beta 1), the commit and the next input are computed on
  the device. A finished row stays in the batch and changes nothing;
- the host reads one flag per iteration but the first (whether a row is still going) and the
  output once, through ``host_read``.
On CUDA the whole iteration (draft, score, accept, commit) is captured once per batch size, source
length bucket, k and settings, then replayed: one launch instead of hundreds.

It serves the top-beta rule with chains of drafts from a drafter with a static form
(``Drafter.static_form``: the cached drafter, its CTC form, the feature drafter, the benchmark's
oracle) or none; other rules, trees, --draft-stop, other drafters and traces take the dynamic
loop. Its steps are the dynamic loop's: ``constraints.constrain``, the rule from
``rules.RULES`` and ``Rows.commit`` (batch_rows.py), on a ``cache.DecoderCache`` of fixed size.
``SpeculativeGenerator.execution`` (loop.py) decides which loop a batch takes, from
``StaticLoop.wanted`` (these settings on this device) and ``StaticLoop.serves`` (this batch's
drafter and draft plan).
"""

import logging
import time
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding import block_forward, scripted_layers
from spec_nmt.decoding.host import any_true, host_read
from spec_nmt.decoding.cache import DecoderCache
from spec_nmt.decoding.constraints import constrain
from spec_nmt.decoding.drafter import StaticDrafter, static_form
from spec_nmt.decoding.rules import RULES
from spec_nmt.decoding.scorer import BlockScorer
from spec_nmt.decoding.static_decoder import Batch, StaticDecoder
from spec_nmt.decoding.tree import before_any_eos, chain
from spec_nmt.settings import DecodingSettings, DraftPlan

logger = logging.getLogger(__name__)

# On CUDA, source lengths are padded up to a multiple of this: one captured graph per bucket
SOURCE_BUCKET = 16
# graphs kept per generator (batch sizes x source buckets x k): a file's last, smaller batch
# makes one of its own
MAX_GRAPHS = 64
# drafters kept in their static form, with their graphs: systems that take turns on one loop (a
# benchmark's oracle and real drafter at the same settings) would otherwise capture every batch
# again (H200 run 6: 135 captures where 6 did)
MAX_DRAFTERS = 4


class StaticLoop:
    """Decodes batches on the static loop for a ``SpeculativeGenerator`` (loop.py), which keeps
    the statistics and the hypotheses' format."""

    def __init__(self, verifier: BlockScorer, settings: DecodingSettings, eos: int, pad: int,
                 unk: int):  # fmt: skip
        self.verifier = StaticDecoder(verifier)
        self.verifier_scorer = verifier
        encoder = verifier.model.encoder
        self.encoder_layers = None  # the encoder's layers for block_forward.encode on CUDA
        if scripted_layers.encoder_supported(encoder):
            self.encoder_layers = scripted_layers.ScriptedLayers(encoder.layers, verifier.project)
        self.settings = settings
        self.eos, self.pad, self.unk = eos, pad, unk
        # id(drafter) -> (drafter, its static form or None), the oldest dropped past
        # MAX_DRAFTERS
        self._drafters: Dict[int, Tuple[object, Optional[StaticDrafter]]] = {}
        # per batch shape, its tensors and its graph's replay (the oldest dropped past
        # MAX_GRAPHS: each holds its batch's caches on the device)
        self._captured: Dict[Tuple, Tuple[Batch, object]] = {}
        self._graph_pool = None
        # False: on CUDA too every iteration runs eagerly (the same kernels, launched one by one)
        self.capture_graphs = True
        # whether batches take the shapes of a captured graph (source lengths in buckets, the
        # encoder without host reads); None: on CUDA. (The CPU tests set it, to check them.)
        self.graph_shapes: Optional[bool] = None
        self.captures = 0  # graphs captured so far, and the seconds that took
        self.capture_seconds = 0.0

    @staticmethod
    def wanted(settings: DecodingSettings, device: torch.device) -> bool:
        """Whether these settings decode on the static loop on ``device`` (the verifier's):
        --decoding-loop asks for it there, and it serves their rule and draft shape (whether
        it serves a batch's drafter is known per batch: ``serves``)."""
        loop = settings.decoding_loop
        asked = loop == "static" or (loop == "auto" and device.type == "cuda")
        return asked and _rule_and_shape(settings, settings.draft_plan)

    def current(self) -> bool:
        """Whether the verifier's weights are still those its layers were taken with."""
        return self.verifier.layers.current() and (
            self.encoder_layers is None or self.encoder_layers.current())

    def serves(self, plan: DraftPlan, drafter) -> bool:
        """Whether this loop decodes a batch drafted by ``drafter`` with ``plan`` (depth 0:
        no drafts, whatever the drafter): the rule and shape, the verifier's decoder and the
        drafter's static form."""
        if not _rule_and_shape(self.settings, plan) or not scripted_layers.decoder_supported(
                self.verifier_scorer.decoder):  # fmt: skip
            return False
        return plan.depth == 0 or self.drafter_for(drafter) is not None

    def drafter_for(self, drafter) -> Optional[StaticDrafter]:
        """The static form of ``drafter`` (None: it has none), kept per drafter and made again
        when its weights changed (a drafter in training); the graphs captured with a dropped
        form go with it."""
        kept = self._drafters.get(id(drafter))  # (kept drafters stay alive: ids stay theirs)
        if kept is not None and (kept[1] is None or kept[1].current()):
            return kept[1]
        if kept is not None:
            self._forget(self._drafters.pop(id(drafter))[1])
        if len(self._drafters) >= MAX_DRAFTERS:
            self._forget(self._drafters.pop(next(iter(self._drafters)))[1])
        drafts = static_form(drafter)
        self._drafters[id(drafter)] = (drafter, drafts)
        return drafts

    def _forget(self, drafts: Optional[StaticDrafter]) -> None:
        """Drop the graphs captured with this static form."""
        for key in [key for key in self._captured if key[-1] == id(drafts)]:
            del self._captured[key]

    def decode(self, net_input: Dict, src_lengths: Tensor, max_lens: Tensor, longest_limit: int,
               drafter, k: int) -> Dict:  # fmt: skip
        """Decode one batch (``max_lens`` [B] each sentence's output limit, ``longest_limit``
        their largest); returns each row's tokens, scores, length, iterations, accepted and
        proposed drafts with the source lengths, read to the host at once, and the verifier
        calls made."""
        src_tokens = net_input["src_tokens"]
        drafts = self.drafter_for(drafter) if k else None
        encoder_out = self._encode(net_input)
        batch, step = self._batch(src_tokens, longest_limit, k, drafts)
        batch.verifier.take_encoder(self.verifier_scorer, encoder_out)
        if drafts is not None:
            drafts.fill(batch, net_input, encoder_out)
        has_source = src_lengths > 1
        batch.tokens.fill_(self.pad)
        batch.tokens[:, 0] = self.eos
        batch.tokens[:, 1].masked_fill_(~has_source, self.eos)  # an empty line: EOS alone
        batch.scores.zero_()
        batch.lengths.copy_((~has_source).long())
        batch.max_lens.copy_(max_lens)
        batch.live.copy_(has_source)
        batch.iterations.zero_()
        batch.accepted.zero_()
        batch.drafted.zero_()
        calls = 0
        while calls <= longest_limit:  # a live row emits a token per call and ends at its limit
            step()
            calls += 1
            # not read after the first call: a sentence seldom ends there, and a call too many
            # changes nothing (a finished row stays as it is)
            if calls > 1 and not any_true(batch.going):
                break
        return dict(_read_back(batch, src_lengths), calls=calls)

    def _encode(self, net_input: Dict) -> Dict:
        """The verifier's encoder output: on CUDA without asking the device anything (stock
        encoders; fairseq's forward asks whether there is padding)."""
        encoder = self.verifier_scorer.model.encoder
        src_tokens = net_input["src_tokens"]
        if not self._graph_shapes(src_tokens.device) or self.encoder_layers is None:
            return self.verifier_scorer.encode(net_input)
        return block_forward.encode(encoder, src_tokens, self.encoder_layers, without_host=True)

    def _batch(self, src_tokens: Tensor, longest_limit: int, k: int,
               drafts: Optional[StaticDrafter]):  # fmt: skip
        """The batch's tensors and its iteration (a replay on CUDA): made anew on the CPU, on
        CUDA kept per shape with the graph captured for it."""
        rows, source_length = src_tokens.shape
        device = src_tokens.device
        graph_shapes = self._graph_shapes(device)
        captured = device.type == "cuda" and self.capture_graphs
        if graph_shapes:  # padded source, the capacity its longest limit needs
            source_length = -(-source_length // SOURCE_BUCKET) * SOURCE_BUCKET
            longest_limit = int(self.settings.length_limits(
                torch.tensor([source_length]), self.verifier.decoder.max_positions()))
        capacity = longest_limit + 2 * k + 3
        dtype = next(self.verifier.decoder.parameters()).dtype
        key = (rows, source_length, k, dtype, id(drafts))
        if captured and key in self._captured:
            return self._captured[key]
        masked = graph_shapes or rows > 1  # (a sentence alone has no padding)
        # buffers kept across calls in either mode (inference_mode(False) turns gradients on)
        with torch.inference_mode(False), torch.no_grad():
            batch = self._allocate(rows, capacity, source_length, longest_limit, k, dtype, device,
                                   masked, drafts)  # fmt: skip

            def iteration():
                self._iteration(batch, drafts)

            step = iteration
            if captured:
                try:
                    step = self._capture(iteration)
                except RuntimeError as error:  # a kernel that cannot be captured: run eagerly
                    logger.warning("the static loop runs without CUDA graphs: %s",
                                   str(error).strip().splitlines()[0])  # fmt: skip
                    self.capture_graphs = captured = False
        if captured:
            if len(self._captured) >= MAX_GRAPHS:
                del self._captured[next(iter(self._captured))]
            self._captured[key] = (batch, step)
        return batch, step

    def _graph_shapes(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.graph_shapes is None else self.graph_shapes

    def _allocate(self, rows, capacity, source_length, longest_limit, k, dtype, device, masked,
                  drafts) -> Batch:  # fmt: skip
        width = longest_limit + k + 3
        long = dict(dtype=torch.long, device=device)
        batch = Batch(
            k=k, capacity=capacity, tokens=torch.full((rows, width), self.pad, **long),
            scores=torch.zeros(rows, width - 1, device=device),
            lengths=torch.zeros(rows, **long), max_lens=torch.zeros(rows, **long),
            live=torch.zeros(rows, dtype=torch.bool, device=device),
            going=torch.zeros(1, dtype=torch.bool, device=device),
            iterations=torch.zeros(rows, **long), accepted=torch.zeros(rows, **long),
            drafted=torch.zeros(rows, **long),
            offsets=torch.arange(k + 1, **long), slot_index=torch.arange(capacity, **long),
            verifier=DecoderCache.allocate(self.verifier.decoder, rows, capacity, source_length,
                                           dtype, device, masked),  # fmt: skip
            drafter=None,
        )  # fmt: skip
        if drafts is not None:
            batch.drafter = drafts.buffers(batch, source_length, masked)
        return batch

    def _capture(self, iteration):
        """The iteration captured as a CUDA graph (after warm-up runs on a side stream, which
        the batch's start overwrites, and which also fill the caches of shape tensors such as
        tree._chain_shape outside the capture); returns its replay."""
        start = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                iteration()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            iteration()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start
        return graph.replay

    def _iteration(self, batch: Batch, drafts: Optional[StaticDrafter]) -> None:
        """Draft, score [pending, drafts], accept, commit: on the device, in place."""
        if drafts is not None:
            draft_tokens = drafts.draft(batch)
        else:
            draft_tokens = batch.lengths.new_zeros(batch.lengths.size(0), 0)
        pending = batch.tokens.gather(1, batch.lengths.unsqueeze(1))
        block = torch.cat([pending, draft_tokens], dim=1)
        positions = batch.lengths.unsqueeze(1) + batch.offsets  # = the entries' cache slots
        bias = block_forward.additive_mask(batch.slot_index <= positions.unsqueeze(2),
                                          batch.verifier.keys[0].dtype)
        states = self.verifier.features(batch.verifier, block, positions, positions, bias)
        logits = self.verifier_scorer.output_logits(states)
        normalizer = constrain(logits, positions, batch.max_lens, self.settings, self.eos,
                               self.pad, self.unk, ask_host=False)  # fmt: skip
        # drafts as the dynamic loop's tree.valid counts them: none at an empty slot (PAD) or
        # past an EOS
        valid = draft_tokens.ne(self.pad) & before_any_eos(draft_tokens, self.eos)
        tree = chain(draft_tokens, valid=valid)
        _, n_accepted, next_tokens = RULES[self.settings.verify](tree, logits, self.settings,
                                                                 self.eos, None)  # fmt: skip
        emitted, n_emitted, _ = batch.commit(draft_tokens, n_accepted, next_tokens, logits,
                                             normalizer, valid.sum(dim=1), self.eos)  # fmt: skip
        if drafts is not None:
            drafts.observe(batch, states, emitted, n_emitted)
        batch.going.copy_(batch.live.any().view(1))


def _rule_and_shape(settings: DecodingSettings, plan: DraftPlan) -> bool:
    """Whether the static loop serves this rule and draft shape: top-beta/tau over a chain that
    every row drafts whole (no --draft-stop)."""
    return settings.verify == "top_beta" and plan.is_chain and not plan.stop_below


def _read_back(batch: Batch, src_lengths: Tensor) -> Dict[str, Tensor]:
    """Each row's length, iterations, accepted and proposed drafts, source length, tokens and
    scores, copied to the host as one tensor (one wait; the scores' float64 bits ride along as
    integers)."""
    rows, width = batch.tokens.shape
    counts = (batch.lengths, batch.iterations, batch.accepted, batch.drafted, src_lengths.long())
    scores = batch.scores.double().view(torch.long)
    (packed,) = host_read(torch.cat([*counts, batch.tokens.flatten(), scores.flatten()]))
    names = ("lengths", "iterations", "accepted", "drafted", "src_lengths")
    found = dict(zip(names, packed[: len(names) * rows].view(len(names), rows)))
    start = len(names) * rows
    found["tokens"] = packed[start : start + width * rows].view(rows, width)
    found["scores"] = packed[start + width * rows :].view(torch.float64).view(rows, -1).float()
    return found
