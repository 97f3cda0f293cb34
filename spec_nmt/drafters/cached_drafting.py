"""The cached drafter's decoding side (its model: cached_drafter.py): on the dynamic loop a
``CachedDrafter`` keeps its prefix in a ``ScorerState`` and feeds each iteration the tokens
committed since the last one plus k masks; its static form (``StaticCachedDrafter``) does the
same on the static loop's preallocated batch.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from spec_nmt.decoding import scripted_layers
from spec_nmt.decoding.block_forward import additive_mask
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.scorer import BlockScorer, ScorerState, among_real_entries, value_range
from spec_nmt.decoding.cache import DecoderCache
from spec_nmt.decoding.static_decoder import StaticDecoder
from spec_nmt.drafters.spec_drafter import NarDrafter


class CachedDrafter(NarDrafter):
    """The cached drafter (drafters/cached_drafter.py): a NAR drafter on the verifier's encoder
    output whose causal prefix lives in a KV cache. Each iteration feeds the tokens committed
    since the last one (causally, kept in the cache) and the k masks (seeing the prefix and each
    other, dropped again), on the verifier's block scorer."""

    def __init__(self, model, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        super().__init__(model, pad, eos, vocabulary)
        # only the decoder runs: its encoder copy is for training
        self.scorer = BlockScorer(model, role="the cached drafter (--drafter-path)",
                                          drafter=True, project=PackedLinears(model.decoder))
        self._visibility: Dict[Tuple[int, int, torch.device], Tensor] = {}

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None) -> ScorerState:  # fmt: skip
        return self.scorer.start(net_input, encoder_out=self.in_own_dtype(verifier_encoder_out))

    @property
    def dtype(self) -> torch.dtype:
        """What its decoder computes in: the verifier's, or bf16 (--drafter-precision)."""
        return self.scorer.decoder.embed_tokens.weight.dtype

    def in_own_dtype(self, verifier_encoder_out: Dict) -> Dict:
        """The verifier's encoder output in the drafter's dtype, for its encoder attention."""
        encoded = verifier_encoder_out["encoder_out"][0]
        if encoded.dtype == self.dtype:
            return verifier_encoder_out
        return dict(verifier_encoder_out, encoder_out=[encoded.to(self.dtype)])

    def position_logits(self, cache: ScorerState, tokens: Tensor, lengths: Tensor, k: int):
        """Float logits [B, k, D] over the draft columns at the k masks after each row's
        ``tokens[b, :lengths[b] + 1]``; the prefix entries not yet in the cache join it."""
        return self._draft_columns(self.mask_logits(cache, tokens, lengths, k))

    def mask_logits(self, cache: ScorerState, tokens: Tensor, lengths: Tensor, k: int):
        """The output layer's logits [B, k, V] at the k masks after each row's
        ``tokens[b, :lengths[b] + 1]`` (every column); the prefix entries not yet in the cache
        join it."""
        fed = cache.fed_lengths
        n_new = lengths + 1 - fed  # BOS + prefix entries still to feed, per row
        fewest, width = value_range(n_new)
        order = torch.arange(width, device=tokens.device)
        slots = fed.unsqueeze(1) + order
        new_tokens = tokens.gather(1, slots.clamp(max=tokens.size(1) - 1))
        if fewest == width:  # every row feeds as many entries (always at batch 1)
            depths = torch.arange(width + k, device=tokens.device)
            visible = self._visibility_pattern(width, k, tokens.device)
        else:
            new = order < n_new.unsqueeze(1)
            new_tokens = torch.where(new, new_tokens, self.pad)
            masks = n_new.unsqueeze(1) + torch.arange(k, device=tokens.device)
            depths = torch.cat([order.expand_as(new), masks], dim=1)
            # new prefix entries: causal among the real ones (so never a mask); masks: every
            # real new entry and each other; padding entries: only themselves (no empty
            # attention row)
            real = torch.cat([new, new.new_ones(tokens.size(0), k)], dim=1)  # [B, entries]
            visible = among_real_entries(self._visibility_pattern(width, k, tokens.device), real)
        block = torch.cat([new_tokens, tokens.new_full((tokens.size(0), k), self.mask)], dim=1)
        logits = self.scorer.score_logits(cache, block, depths, visible, outputs=k)
        self.scorer.commit(cache, None, n_new)
        return logits

    def _visibility_pattern(self, width: int, k: int, device: torch.device) -> Tensor:
        """[1, width + k, width + k]: ``width`` new prefix entries, causal, then k masks that
        see every entry (built once per shape)."""
        key = (width, k, device)
        if key not in self._visibility:
            column = torch.arange(width + k, device=device)
            causal = column.unsqueeze(0) <= column.unsqueeze(1)
            self._visibility[key] = (causal | (column >= width).unsqueeze(1)).unsqueeze(0)
        return self._visibility[key]

    def commit(self, cache: ScorerState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """The accepted tokens join the cache as prefix entries next time."""

    def mask_slots(self, k: int) -> int:
        """The masks a call feeds for k drafts."""
        return k

    def best_drafts(self, logits: Tensor, k: int) -> Tensor:
        """The k drafts [B, k] of the masks' logits [B, mask_slots(k), V] (changed in place):
        each mask's best token among the draft columns."""
        best = self._draft_columns(logits).max(dim=-1).indices
        return best if self.vocabulary is None else self.vocabulary[best]

    def static_form(self) -> Optional["StaticCachedDrafter"]:
        """This drafter on the static loop, where its decoder is the kind the scripted layers
        run (not with int8 products, for one)."""
        if not scripted_layers.decoder_supported(self.scorer.decoder):
            return None
        return StaticCachedDrafter(self)

    def select_rows(self, cache: ScorerState, rows: Tensor) -> None:
        self.scorer.select_rows(cache, rows)


@dataclass
class CachedDrafterBuffers:
    cache: DecoderCache
    fed: Tensor  # [B] prefix entries in the drafter's cache (BOS included)
    masks: Tensor  # [masks] 0 .. masks - 1
    slot_index: Tensor  # [capacity] 0 .. capacity - 1 of its cache


class StaticCachedDrafter:
    """The cached drafter on the static loop (``CachedDrafter.static_form``): each call feeds k + 1
    prefix slots at ``fed`` (the real ones: the tokens committed since the last call; the others
    are seen by no mask and overwritten next time) and k masks after them, which see the real
    prefix and each other. Its CTC form (drafters/ctc.py) has N x k masks, collapsed on the
    device; the places they leave empty draft PAD, which the verifier never accepts."""

    def __init__(self, cached):
        self.cached = cached
        self.decoder = StaticDecoder(cached.scorer)

    def buffers(self, batch, source_length: int, masked_source: bool):
        tokens = batch.tokens
        masks = self.cached.mask_slots(batch.k)
        capacity = batch.capacity + masks - batch.k  # (the verifier's has room for k masks)
        cache = DecoderCache.allocate(self.decoder.decoder, tokens.size(0), capacity,
                                      source_length, self.cached.dtype, tokens.device,
                                      masked_source)  # fmt: skip
        return CachedDrafterBuffers(cache, torch.zeros_like(batch.lengths),
                                    torch.arange(masks, device=tokens.device),
                                    torch.arange(capacity, device=tokens.device))  # fmt: skip

    def current(self) -> bool:
        return self.decoder.layers.current()

    def fill(self, batch, net_input: Dict, encoder_out: Dict) -> None:
        batch.drafter.cache.take_encoder(self.cached.scorer, self.cached.in_own_dtype(encoder_out))
        batch.drafter.fed.zero_()

    def observe(self, batch, states: Tensor, emitted: Tensor, counts: Tensor) -> None:
        """Nothing: the committed tokens are in ``batch.tokens``."""

    def draft(self, batch) -> Tensor:
        state = batch.drafter
        masks = state.masks.numel()
        prefix = state.fed.unsqueeze(1) + batch.offsets  # [B, k + 1] slots = positions
        mask_slots = prefix[:, -1:] + 1 + state.masks
        mask_positions = batch.lengths.unsqueeze(1) + 1 + state.masks
        last = batch.tokens.size(1) - 1
        tokens = torch.cat([batch.tokens.gather(1, prefix.clamp(max=last)),
                            torch.full_like(mask_slots, self.cached.mask)], dim=1)  # fmt: skip
        slot = state.slot_index
        prefix_seen = slot <= prefix.unsqueeze(2)  # causal
        mask_seen = ((slot <= batch.lengths.view(-1, 1, 1))
                     | ((slot >= mask_slots[:, :1, None]) & (slot <= mask_slots[:, -1:, None])))
        seen = torch.cat([prefix_seen, mask_seen.expand(-1, masks, -1)], dim=1)
        logits = self.decoder.logits(state.cache, tokens, torch.cat([prefix, mask_positions], 1),
                                     torch.cat([prefix, mask_slots], 1),
                                     additive_mask(seen, state.cache.keys[0].dtype),
                                     outputs=masks)  # fmt: skip
        state.fed.copy_(batch.lengths + 1)
        return self.cached.best_drafts(logits, batch.k)
