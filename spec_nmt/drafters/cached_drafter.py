"""Cached drafter: a non-autoregressive drafter with no encoder of its own and a cacheable prefix.

Its decoder reads the verifier's encoder output (computed once per sentence for the verifier
anyway) and sees ``BOS + verified prefix + k [MASK]``, like the Spec-Drafter's, with another
attention pattern: prefix entries attend causally, so their keys/values can be cached and
extended by each iteration's committed tokens; the k masks see the whole prefix and each other.
An iteration then computes only the newly committed tokens and the k masks.

Training uses the same pattern: the verifier's encoder is copied into the model and frozen
(``--init-from-verifier`` is required), and one pass over ``BOS + target`` followed by
``--cuts-per-sentence`` blocks of k masks trains every cut at once: block m's masks sit at the
positions after cut c_m and see the prefix entries up to c_m and their own block only.

"""

from typing import Dict, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoderBase, base_architecture
from torch import Tensor

from spec_nmt.decoding import block_forward
from spec_nmt.drafters.cached_drafting import CachedDrafter
from spec_nmt.drafters.ctc import CtcCachedDrafter
from spec_nmt.drafters.spec_drafter import (
    MASK_SYMBOL,
    SpecDrafterModel,
    architecture_defaults,
    score_masks,
)
from spec_nmt.errors import SpecNmtError


def cut_visibility(prefix_width: int, cuts: Tensor, block_size: int) -> Tensor:
    """Which entries each entry sees [B, P + M*k, P + M*k] for P prefix entries (causal) then M
    blocks of k masks, block m after cut ``cuts[:, m]`` (it sees prefix entries 0 .. c_m and its
    own block)."""
    batch, blocks = cuts.shape
    device = cuts.device
    prefix = torch.arange(prefix_width, device=device)
    masks = blocks * block_size
    causal = (prefix.unsqueeze(0) <= prefix.unsqueeze(1)).expand(batch, -1, -1)
    top = torch.cat([causal, causal.new_zeros(batch, prefix_width, masks)], dim=2)
    sees_prefix = (prefix.view(1, 1, -1) <= cuts.unsqueeze(2)).repeat_interleave(block_size, dim=1)
    block = torch.arange(blocks, device=device).repeat_interleave(block_size)
    same_block = (block.unsqueeze(0) == block.unsqueeze(1)).expand(batch, -1, -1)
    return torch.cat([top, torch.cat([sees_prefix, same_block], dim=2)], dim=1)


def cut_positions(prefix_width: int, cuts: Tensor, block_size: int) -> Tensor:
    """Decoder positions [B, P + M*k]: prefix entry i at i, mask j of block m at c_m + 1 + j."""
    batch = cuts.size(0)
    prefix = torch.arange(prefix_width, device=cuts.device).expand(batch, -1)
    offsets = torch.arange(1, block_size + 1, device=cuts.device)
    masks = (cuts.unsqueeze(2) + offsets).flatten(1)
    return torch.cat([prefix, masks], dim=1)


class CachedDrafterDecoder(TransformerDecoderBase):
    """A Transformer decoder whose prefix is causal and whose [MASK] blocks see their cut's
    prefix and each other; it scores only the masks."""

    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(cfg, dictionary, embed_tokens)
        if MASK_SYMBOL not in dictionary.indices:
            raise ValueError(f"the drafter's dictionary has no {MASK_SYMBOL} symbol")
        self.mask_idx = dictionary.index(MASK_SYMBOL)

    def forward(self, prev_output_tokens, encoder_out=None, cuts=None, scored=None, **unused):
        """prev_output_tokens [B, P + M*k]: BOS + target prefix (right-padded), then M blocks of
        k masks; cuts [B, M]. Returns (logits [B*M, k, V] at the masks, extra); with ``scored``
        [B*M, k] bool, logits [n, V] of the n masks it marks only."""
        if cuts is None:
            raise ValueError("the cached drafter's decoder needs the cut points of its mask blocks")
        blocks = cuts.size(1)
        masks = int(prev_output_tokens[0].eq(self.mask_idx).sum())
        if masks == 0 or masks % blocks:
            raise ValueError(f"{masks} masks per row do not make {blocks} blocks")
        block_size = masks // blocks
        prefix_width = prev_output_tokens.size(1) - masks
        positions = cut_positions(prefix_width, cuts, block_size)
        x = block_forward.embed(self, prev_output_tokens, positions)
        bias = block_forward.additive_mask(cut_visibility(prefix_width, cuts, block_size), x.dtype)

        def self_attention(_layer: int):
            def attention(attn, x: Tensor) -> Tensor:
                heads = attn.num_heads
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
                query, keys, values = (block_forward.split_heads(proj(x), heads)
                                       for proj in projections)  # fmt: skip
                return block_forward.attend(attn, query, keys, values, bias)

            return attention

        keys, values, encoder_bias = block_forward.encoder_keys_values(self, encoder_out)
        features = block_forward.layers(self, x, self_attention, keys, values, encoder_bias)
        block_features = features[:, prefix_width:].reshape(-1, block_size, features.size(-1))
        return score_masks(self, block_features, scored), {}


def same_weights(ours: Tensor, theirs: Tensor) -> bool:
    """Whether two copies of a verifier tensor are the same weights: equal, or one of them is
    the other rounded to fp16 (export_model.py stores fp16: a drafter trained on the fp32
    checkpoint meets its verifier from a model directory, or the other way round)."""
    theirs = theirs.to(ours.device)
    if ours.shape != theirs.shape:
        return False
    if torch.equal(ours, theirs.to(ours.dtype)):
        return True
    if not (ours.is_floating_point() and theirs.is_floating_point()):
        return False
    ours16, theirs16 = ours.half(), theirs.half()
    exported = (torch.equal(ours16.to(ours.dtype), ours)
                or torch.equal(theirs16.to(theirs.dtype), theirs))  # fmt: skip
    return exported and torch.equal(ours16, theirs16)


@register_model("cached_drafter")
class CachedDrafterModel(SpecDrafterModel):
    """Decoder-only NAR drafter on the verifier's frozen encoder. Train it with
    ``--task spec_translation --init-from-verifier VERIFIER.pt``; decoding uses the verifier's
    encoder output, so the drafter only runs with the verifier it was trained on."""

    # its frozen copy of the verifier's encoder (compact_drafter.py drops it from exports)
    VERIFIER_COPIES = {"encoder.": "encoder."}

    @staticmethod
    def add_args(parser):
        SpecDrafterModel.add_args(parser)
        parser.add_argument(
            "--ctc-upsample",
            type=int,
            default=0,
            metavar="N",
            help="train and draft with a CTC output (drafters/ctc.py): N x k mask slots per "
            "block, collapsed to k drafts; 0: one mask per draft, trained position by position",
        )

    @classmethod
    def build_model(cls, args, task):
        upsample = getattr(args, "ctc_upsample", 0)
        if upsample == 1 or upsample < 0:
            raise SpecNmtError(f"--ctc-upsample must be 0 (no CTC) or at least 2, got {upsample}")
        # The encoder must stay the verifier's: it gets embeddings of its own (frozen), and the
        # decoder ties only its input and output embeddings.
        args.share_all_embeddings = False
        args.share_decoder_input_output_embed = True
        model = super().build_model(args, task)
        # its training and decoding both run the block forward: refuse what that cannot compute
        # now, not after hours of training
        block_forward.check_supported(model.decoder, "the cached drafter")
        for parameter in model.encoder.parameters():
            parameter.requires_grad_(False)
        model.ctc_upsample = upsample
        return model

    def draft_slots(self, k: int) -> int:
        """Mask slots per block of k drafts."""
        return k * self.ctc_upsample if self.ctc_upsample else k

    @staticmethod
    def training_input(shifted: Tensor, cuts: Tensor, k: int, mask: int,
                       pad: int) -> Dict[str, Tensor]:  # fmt: skip
        """BOS + target once, then one block of k masks per cut (``cuts`` [B * m], m cuts per
        sentence next to each other)."""
        blocks = cuts.size(0) // shifted.size(0)
        masks = shifted.new_full((shifted.size(0), blocks * k), mask)
        return {"prev_output_tokens": torch.cat([shifted, masks], dim=1),
                "cuts": cuts.view(-1, blocks)}  # fmt: skip

    def decoding_adapter(self, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        adapter = CtcCachedDrafter if self.ctc_upsample else CachedDrafter
        return adapter(self, pad, eos, vocabulary)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return CachedDrafterDecoder(cfg, tgt_dict, embed_tokens)

    # the verifier's encoder (frozen here), embeddings and decoder layers 0 .. N-1
    VERIFIER_PARTS = ("encoder.", "decoder.")

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.eval()  # frozen: no dropout, the verifier's output exactly
        return self

    def forward(self, src_tokens, src_lengths, prev_output_tokens, cuts=None, scored=None,
                **unused):  # fmt: skip
        with torch.no_grad():
            encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decoder(prev_output_tokens, encoder_out, cuts=cuts, scored=scored)

    def check_verifier_matches(self, verifier_model) -> None:
        """Refuse a verifier whose encoder is not the copy this drafter was trained with."""
        own, theirs = self.encoder.state_dict(), verifier_model.encoder.state_dict()
        # both ways: a tensor only one side has (a pre-norm encoder's final norm) differs too
        for name in sorted(own.keys() | theirs.keys()):
            value, other = own.get(name), theirs.get(name)
            if value is None or other is None:
                side = "verifier" if value is None else "drafter"
                difference = f"only the {side} has {name}"
            else:
                if name.endswith(("embed_tokens.weight", "output_projection.weight")):
                    value = value[: other.size(0)]  # the drafter's row for [MASK] is extra
                if same_weights(value, other):
                    continue
                difference = f"{name} differs"
            raise SpecNmtError(
                f"the drafter was trained on another verifier's encoder ({difference}): it "
                "decodes only with the verifier given to --init-from-verifier"
            )


@register_model_architecture("cached_drafter", "cached_drafter")
def cached_drafter_architecture(args):
    """Defaults of every cached drafter: the verifier's encoder shape, a 2-layer decoder."""
    architecture_defaults(args, decoder_layers=2)
    base_architecture(args)


@register_model_architecture("cached_drafter", "cached_drafter_small")
def cached_drafter_small(args):
    """Pairs with the small verifier (6 encoder layers, d=256, 4 heads, FFN 1024)."""
    architecture_defaults(args, encoder_layers=6, encoder_embed_dim=256, decoder_embed_dim=256,
                          encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
                          encoder_attention_heads=4, decoder_attention_heads=4)  # fmt: skip
    cached_drafter_architecture(args)


@register_model_architecture("cached_drafter", "cached_drafter_base")
def cached_drafter_base(args):
    """Pairs with the base verifier (transformer_wmt_en_de: 6 encoder layers, d=512)."""
    cached_drafter_architecture(args)
