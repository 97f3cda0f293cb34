"""The verifier adapter: a stock fairseq Transformer translation model that scores a block of new
decoder inputs in ONE forward pass on top of its key/value cache. The same adapter runs the
autoregressive drafter (a small stock Transformer, whose drafts are blocks and trees too) and the
cached drafter (prefix entries and mask blocks on the verifier's encoder output).

fairseq's own incremental decoder reads only the last input token and its attention takes one
mask for the whole batch, so block scoring has its own short forward: token and position
embeddings for the block, then per layer a self-attention over the cache with a per-row mask, an
encoder attention over keys/values projected once per batch, and the feed-forward. The common
decoder layers run as one TorchScript function (``scripted_layers``), the others through the
stock modules (``block_forward``). A block may be a chain (causal inside the block) or a draft
tree (each entry sees the cached prefix and its ancestors only; positions by depth).

The cache (``cache.DecoderCache``, the static loop's too) is preallocated per layer
([rows, heads, capacity, head_dim], grown by doubling when a block would not fit) and written in
place at per-row positions. Row b holds its committed decoder inputs in slots
``[0, fed_lengths[b])``; the entries scored since the last commit follow them, so a block is
written at ``fed_lengths[b] + uncommitted`` and no query ever sees a slot past what its row
wrote. Committing a chain's accepted prefix only advances ``fed_lengths``: the rejected entries
stay where they are and the next block overwrites them. Only a tree's kept path, whose entries
are not contiguous, is moved into place (a few slots per row).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor

from spec_nmt.decoding import block_forward, scripted_layers
from spec_nmt.decoding.cache import DecoderCache
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.errors import SpecNmtError

# initial cache slots per row (cache.layer_slots: zeros)
INITIAL_CACHE_SLOTS = 64


def value_range(values: Tensor) -> Tuple[int, int]:
    """The smallest and largest of a 1-d integer tensor, read into Python at once."""
    if values.numel() == 1:
        value = int(values)
        return value, value
    lowest, highest = torch.stack(torch.aminmax(values)).tolist()
    return lowest, highest


def among_real_entries(pattern: Tensor, real: Tensor) -> Tensor:
    """A block's visibility [B, W, W] where only the ``real`` [B, W] entries of each row count:
    ``pattern`` [1 or B, W, W] between real entries, and a padding entry sees only itself (no
    attention row without a key)."""
    itself = torch.eye(real.size(1), dtype=torch.bool, device=real.device)
    return (pattern & real.unsqueeze(1) & real.unsqueeze(2)) | itself


@dataclass(eq=False)  # (compared and hashed by identity, as tensors are)
class ScorerState(DecoderCache):
    """Per-batch decoding state: the decoder's cache (the encoder output itself is not kept:
    nothing reads it after its keys and values are projected) and each row's committed length."""

    fed_lengths: Optional[Tensor] = None  # [B]
    uncommitted: int = 0  # block entries scored since the last commit (every row alike)
    # a drafter that reads the verifier's last decoder states (the feature drafter) asks for
    # each scored block's: [B, W, C], what the output projection read
    keep_block_states: bool = False
    block_states: Optional[Tensor] = None


class BlockScorer:
    """Wraps a fairseq ``TransformerModel`` (any checkpoint trained with ``--task translation``)."""

    def __init__(self, model, temperature: float = 1.0, role: str = "the verifier (--path)",
                 drafter: bool = False, project: Optional[PackedLinears] = None):  # fmt: skip
        """``role`` names the model in errors; ``drafter``: it scores blocks for a drafter (a
        cached drafter is a Spec-Drafter model, which is refused as a verifier); ``project``:
        the model's packed linear layers, when packed before (packing takes a while)."""
        if not drafter and getattr(model, "IS_DRAFTER", False):
            raise SpecNmtError(
                f"{role} is a Spec-Drafter, not a verifier: the verifier is the Transformer "
                "trained with --task translation (--path, verifier.pt), the drafter goes to "
                "--drafter-path (drafter.pt)"
            )
        decoder = getattr(model, "decoder", None)
        if (
            not isinstance(decoder, TransformerDecoderBase)
            or getattr(model, "encoder", None) is None
        ):
            raise SpecNmtError(
                f"{role} must be a fairseq Transformer encoder-decoder translation "
                f"model, got {type(model).__name__}"
            )
        block_forward.check_supported(decoder, role)
        self.model = model
        self.decoder = decoder
        self.temperature = temperature
        self._position_table: Optional[Tensor] = None
        # the model's linear layers with prepacked weights (blocks of a few entries per row)
        self.project = project or PackedLinears(model)
        # the decoder layers as one scripted call where they are the common kind, else (None)
        # through the stock modules; the benchmark swaps in other engines of the same function
        supported = scripted_layers.decoder_supported(decoder)
        self.layers_function = scripted_layers.decoder_layers_scripted if supported else None
        self._scripted: Optional[scripted_layers.ScriptedLayers] = None
        # and the encoder's layers by encoder_layers where they are the stock kind
        self._encoder_supported = (scripted_layers.encoder_layers_scripted is not None
                                   and scripted_layers.encoder_supported(model.encoder))
        self._scripted_encoder: Optional[scripted_layers.ScriptedLayers] = None

    def max_positions(self) -> int:
        return self.decoder.max_positions()

    def encode(self, net_input: Dict[str, Tensor]) -> Dict:
        """The encoder output for the batch (fairseq's ``encoder_out`` dict): its layers run by
        ``scripted_layers`` where the encoder is a stock Transformer one, on the CPU in
        evaluation without gradient; else fairseq's own forward."""
        encoder = self.model.encoder
        if (not self._encoder_supported or encoder.training or torch.is_grad_enabled()
                or net_input["src_tokens"].device.type != "cpu"):  # as in score_logits
            return encoder.forward_torchscript(net_input)
        self._scripted_encoder = _current(self._scripted_encoder, encoder.layers, self.project)
        return block_forward.encode(encoder, net_input["src_tokens"], self._scripted_encoder)

    def start(
        self, net_input: Dict[str, Tensor], encoder_out: Optional[Dict] = None
    ) -> ScorerState:
        """Project the batch's encoder output (``encoder_out``, from ``encode`` or another
        model's: the cached drafter reads the verifier's; by default encoded here) for every
        layer's encoder attention; nothing is cached for the decoder yet. The scripted
        decoder layers are taken again here if a weight changed since the last batch."""
        if encoder_out is None:
            encoder_out = self.encode(net_input)
        if self._scripted is not None:
            self._scripted = _current(self._scripted, self.decoder.layers, self.project)
        encoded = encoder_out["encoder_out"][0]  # [source length, B, C]
        keys, values, bias = block_forward.encoder_keys_values(self.decoder, encoder_out,
                                                               self.project)  # fmt: skip
        fed_lengths = torch.zeros(encoded.size(1), dtype=torch.long, device=encoded.device)
        return ScorerState([], [], keys, values, bias, fed_lengths)

    def score_logits(
        self,
        state: ScorerState,
        block_tokens: Tensor,  # [B, W]
        depths: Optional[Tensor] = None,  # [W] or [B, W]; default 0 .. W-1
        visible: Optional[Tensor] = None,  # [B or 1, W, U+W] bool over uncommitted entries
        outputs: Optional[int] = None,  # logits for the last ``outputs`` entries only
        inputs: Optional[Tensor] = None,  # [B, W, C] in place of the tokens' embeddings
    ) -> Tensor:
        """Float logits [B, W, V] (temperature applied) of the next token after each of the W
        block inputs (or the last ``outputs`` of them): a fresh tensor the caller may change
        in place.

        Block entry i of row b sits at decoder position ``fed_lengths[b] + depths[i]`` and sees
        the row's committed prefix plus the uncommitted entries (U from earlier blocks since the
        last commit, then this block's) that ``visible`` marks; by default a causal chain.
        The block's keys/values join the cache; ``commit`` decides which stay.
        """
        dec = self.decoder
        width = block_tokens.size(1)
        device = block_tokens.device
        if depths is None:
            depths = torch.arange(width, device=device)
        entries = state.uncommitted + width  # uncommitted entries once this block is written
        if visible is None:
            visible = torch.ones(width, entries, dtype=torch.bool, device=device)
            visible = visible.tril(state.uncommitted).unsqueeze(0)

        # where the block goes: row b's entries at fed_lengths[b] + uncommitted
        first_slot = state.fed_lengths + state.uncommitted  # [B]
        lowest, highest = value_range(first_slot)
        span = highest + width
        x = block_forward.embed(dec, block_tokens, state.fed_lengths.unsqueeze(1) + depths,
                                self.position_table(span), inputs)
        self.reserve(state, span, x)
        uniform = lowest == highest  # always at batch 1
        bias = _attention_bias(state, visible, lowest if uniform else None, span, x.dtype)
        if not uniform:
            slots = first_slot.unsqueeze(1) + torch.arange(width, device=device)  # [B, W]

        # on the CPU only, where the scripted layers were measured and tested: a GPU keeps the
        # modules (TorchScript's GPU fusers may round fp16 otherwise)
        scripted = self.scripted_layers() if device.type == "cpu" else None
        if scripted is not None:
            x = scripted.run(self.layers_function, x.transpose(0, 1), state, lowest,
                             None if uniform else slots, span, bias)  # fmt: skip
            if dec.layer_norm is not None:
                x = dec.layer_norm(x)
        else:
            x = self._module_layers(state, x, span, bias, lowest if uniform else None,
                                    None if uniform else slots)  # fmt: skip
        if state.keep_block_states:
            state.block_states = x
        state.uncommitted = entries
        return self.output_logits(x, outputs)

    def output_logits(self, features: Tensor, outputs: Optional[int] = None) -> Tensor:
        """Float logits [B, W, V] (temperature applied) of the decoder's final features [B, W, C],
        or of their last ``outputs`` entries: the decoder's output_layer without an adaptive
        softmax (check_supported)."""
        if outputs is not None:
            features = features[:, features.size(1) - outputs :]
        logits = self.project(self.decoder.output_projection, features).float()
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits

    def scripted_layers(self) -> Optional[scripted_layers.ScriptedLayers]:
        """The decoder's layers for ``decoder_layers`` where they serve this call (a supported
        decoder in evaluation without gradient): taken at the first call, and again by
        ``start`` when a weight has changed (one check per batch, not per call)."""
        if self.layers_function is None or self.decoder.training or torch.is_grad_enabled():
            return None
        if self._scripted is None:
            self._scripted = scripted_layers.ScriptedLayers(self.decoder.layers, self.project)
        return self._scripted

    def _module_layers(self, state: ScorerState, x: Tensor, span: int, bias: Tensor,
                       first_slot: Optional[int], slots: Optional[Tensor]) -> Tensor:  # fmt: skip
        """The decoder layers through the stock modules (block_forward), writing the block's
        keys and values at ``first_slot`` (every row alike) or at ``slots`` [B, W]."""
        width = x.size(0)
        dec = self.decoder

        def write(cache: Tensor, new: Tensor) -> None:  # new [B, heads, W, head_dim]
            if slots is None:
                cache[:, :, first_slot : first_slot + width] = new
            else:
                index = slots[:, None, :, None].expand(-1, new.size(1), -1, new.size(3))
                cache.scatter_(2, index, new)

        def self_attention(i: int):
            keys, values = state.keys[i], state.values[i]

            def attention(attn, x: Tensor) -> Tensor:
                query, key, value = (
                    block_forward.split_heads(projected, attn.num_heads)
                    for projected in self.project.many((attn.q_proj, attn.k_proj, attn.v_proj), x)
                )
                write(keys, key)
                write(values, value)
                seen_keys, seen_values = keys[:, :, :span], values[:, :, :span]
                return block_forward.attend(attn, query, seen_keys, seen_values, bias,
                                            self.project)  # fmt: skip

            return attention

        return block_forward.layers(dec, x, self_attention, state.encoder_keys,
                                    state.encoder_values, state.encoder_bias,
                                    self.project)  # fmt: skip

    def commit(self, state: ScorerState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Row b keeps its uncommitted entries ``keep[b, :n_keep[b]]`` (indices in scoring
        order, e.g. the root and the accepted path of a draft tree); all others are dropped.
        ``keep=None`` keeps the first ``n_keep[b]`` (a chain's accepted prefix). Kept entries
        already in place are not touched."""
        if keep is not None and keep.size(1):
            order = torch.arange(keep.size(1), device=keep.device)
            counted = order < n_keep.unsqueeze(1)
            if not bool((keep.eq(order) | ~counted).all()):
                # move the kept entries behind the committed prefix; rows that keep fewer
                # entries rewrite their last kept one
                last = (n_keep - 1).clamp(min=0).unsqueeze(1)
                position = torch.where(counted, order, last)
                source = state.fed_lengths.unsqueeze(1) + keep.gather(1, position)
                target = state.fed_lengths.unsqueeze(1) + position
                for cache in state.keys + state.values:
                    heads, head_dim = cache.size(1), cache.size(3)
                    src = source[:, None, :, None].expand(-1, heads, -1, head_dim)
                    dst = target[:, None, :, None].expand(-1, heads, -1, head_dim)
                    cache.scatter_(2, dst, cache.gather(2, src))
        state.fed_lengths = state.fed_lengths + n_keep
        state.uncommitted = 0

    def select_rows(self, state: ScorerState, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (finished sentences leave), in place."""
        state.select_rows(rows)
        state.fed_lengths = state.fed_lengths.index_select(0, rows)
        state.block_states = None  # read at the commit before, never across a selection

    def reserve(self, state: ScorerState, slots: int, like: Tensor) -> None:
        """Make every layer's cache hold at least ``slots`` slots per row (doubling), of
        ``like``'s dtype and device."""
        if slots > state.capacity:
            capacity = max(slots, 2 * state.capacity, INITIAL_CACHE_SLOTS)
            state.grow(self.decoder, state.fed_lengths.size(0), capacity, like)

    def position_table(self, length: int) -> Optional[Tensor]:
        """The decoder's position table, built once and at least ``length`` long (up to the
        decoder's limit)."""
        if self.decoder.embed_positions is None:
            return None
        limit = self.decoder.max_positions()
        if self._position_table is None or self._position_table.size(0) < min(length, limit):
            length = min(max(length, 256), limit)
            self._position_table = block_forward.position_table(self.decoder, length)
        return self._position_table


def _current(taken: Optional[scripted_layers.ScriptedLayers], layers, project: PackedLinears):
    """``taken`` where it holds the layers' current weights, else the layers taken now."""
    if taken is None or not taken.current():
        return scripted_layers.ScriptedLayers(layers, project)
    return taken


def _attention_bias(state: ScorerState, visible: Tensor, first_slot: Optional[int], span: int,
                    dtype: torch.dtype) -> Tensor:  # fmt: skip
    """A block's additive self-attention mask over the first ``span`` cache slots: each row's
    committed prefix, then the uncommitted entries ``visible`` [B or 1, W, U+W] marks.
    ``first_slot``: where every row's block starts when that is the same for all rows (always
    at batch 1), else None. [B or 1, 1, W, span]."""
    width = visible.size(1)
    if first_slot is not None:
        # every row sees its whole committed prefix: only the uncommitted columns vary
        committed = first_slot - state.uncommitted
        bias = torch.zeros(visible.size(0), 1, width, span, dtype=dtype, device=visible.device)
        bias[:, 0, :, committed:].masked_fill_(~visible, float("-inf"))
        return bias
    entries = state.uncommitted + width
    relative = torch.arange(span, device=visible.device) - state.fed_lengths.unsqueeze(1)
    in_block = (relative >= 0) & (relative < entries)  # [B, span]
    entry = relative.clamp(0, entries - 1).unsqueeze(1).expand(-1, width, -1)
    block_seen = visible.expand(relative.size(0), -1, -1).gather(2, entry)
    seen = torch.where(in_block.unsqueeze(1), block_seen, (relative < 0).unsqueeze(1))
    return block_forward.additive_mask(seen, dtype)  # [B, 1, W, span]
