"""Heads drafter: draft heads on the verifier's own last-layer state (Medusa-1, Cai et al., 2024,
with the pending token's embedding as EAGLE feeds it, Li et al., 2024).

Head j maps the verifier state that chose the pending token, and that token's embedding, to a
state for the j-th token after it (``DraftHeads``), and the verifier's own output projection
(frozen) turns that into a distribution. Decoding takes the state from the verifier's block
call, so drafting costs a few one-row matrix products and one output projection of k rows: no
decoder layer of its own, no pass over the prefix and no encoder. The first iteration of a
sentence drafts nothing (no verifier state exists yet).

Training runs the verifier (a frozen copy in the model, from ``--init-from-verifier``) over
``BOS + target`` once per sentence and trains only the heads, on the cached drafter's batches:
block m of k labels after cut c_m reads the state at entry c_m - 1 (the one that chose the cut's
last prefix token), so cuts start at 1.
"""

from typing import NamedTuple, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor, nn

from spec_nmt.errors import SpecNmtError
from spec_nmt.models.block_forward import Project, encoder_keys_values, plain
from spec_nmt.models.cached_drafter import (
    CachedDrafterModel,
    cached_drafter_architecture,
    cached_drafter_small,
)
from spec_nmt.models.spec_drafter import MASK_SYMBOL, set_option


class SourceMemory(NamedTuple):
    """What the heads attend to: the verifier's last decoder layer's encoder-attention keys and
    values [N, heads, S, head_dim] and the source padding as an additive mask [N, 1, 1, S]."""

    keys: Tensor
    values: Tensor
    bias: Optional[Tensor]

    def select(self, rows: Tensor) -> "SourceMemory":
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        return SourceMemory(self.keys.index_select(0, rows), self.values.index_select(0, rows),
                            bias)  # fmt: skip


def source_memory(verifier_decoder, encoder_out, project: Project = plain) -> SourceMemory:
    """The heads' source memory of a batch, from the verifier's encoder output."""
    keys, values, bias = encoder_keys_values(verifier_decoder, encoder_out, project,
                                             layers=verifier_decoder.layers[-1:])  # fmt: skip
    return SourceMemory(keys[0], values[0], bias)


class DraftHeads(nn.Module):
    """From the verifier state s that chose the pending token and that token's embedding e, a
    shared trunk: ``z = s + SiLU(M [s; e])``, one attention over the source (its query from
    z, the keys and values of the verifier's last encoder attention) ``z += O a``, a feed-
    forward block ``z += F2 SiLU(F1 z)``; then ``count`` residual SiLU heads ``z + SiLU(H_j
    z)``, all in one product. Every residual branch starts at zero (Medusa's initialisation:
    every head starts from the verifier's own prediction from that state, the pending token
    itself). ``project(linear, x)`` runs each linear layer (decoding passes prepacked
    products)."""

    def __init__(self, count: int, channels: int, attention_heads: int):
        super().__init__()
        self.count = count
        self.attention_heads = attention_heads
        self.mix = nn.Linear(2 * channels, channels)
        self.query = nn.Linear(channels, channels)
        self.source_out = nn.Linear(channels, channels)
        self.fc1 = nn.Linear(channels, 4 * channels)
        self.fc2 = nn.Linear(4 * channels, channels)
        self.heads = nn.Linear(channels, count * channels)  # head j: rows j*C .. (j+1)*C
        for branch_end in (self.mix, self.source_out, self.fc2, self.heads):
            nn.init.zeros_(branch_end.weight)
            nn.init.zeros_(branch_end.bias)

    def forward(self, states: Tensor, pending: Tensor, memory: SourceMemory, k: int,
                project: Project = plain) -> Tensor:  # fmt: skip
        """states [N, C], the pending tokens' embeddings [N, C] and their rows' source memory ->
        [N, k, C]: the first k heads' states."""
        silu = nn.functional.silu
        z = states + silu(project(self.mix, torch.cat([states, pending], dim=-1)))
        batch, channels = z.shape
        query = project(self.query, z).view(batch, self.attention_heads, 1, -1)
        attended = nn.functional.scaled_dot_product_attention(
            query, memory.keys, memory.values, attn_mask=memory.bias
        )
        z = z + project(self.source_out, attended.reshape(batch, channels))
        z = z + project(self.fc2, silu(project(self.fc1, z)))
        heads = project(self.heads, z).view(batch, self.count, channels)[:, :k]
        return z.unsqueeze(1) + silu(heads)


@register_model("heads_drafter")
class HeadsDrafterModel(CachedDrafterModel):
    """Draft heads on a frozen copy of the verifier (encoder and decoder). Train with
    ``--task spec_translation --init-from-verifier VERIFIER.pt``; it drafts only with that
    verifier (checked when loaded)."""

    # a block reads the state that chose its cut's last prefix token, which BOS alone has not
    FIRST_CUT = 1

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        self.heads = DraftHeads(args.draft_heads, decoder.output_embed_dim,
                                decoder.layers[-1].encoder_attn.num_heads)  # fmt: skip

    @staticmethod
    def add_args(parser):
        CachedDrafterModel.add_args(parser)
        parser.add_argument(
            "--draft-heads",
            type=int,
            metavar="N",
            help="draft heads: the most tokens drafted per iteration (train with --block-size "
            "at most N)",
        )

    @classmethod
    def adopt_verifier(cls, model_cfg, verifier_cfg, path) -> None:
        """The decoder is a copy of the verifier's: its depth too."""
        super().adopt_verifier(model_cfg, verifier_cfg, path)
        for name in ("encoder_layers", "decoder_layers"):
            set_option(model_cfg, name, getattr(verifier_cfg, name))

    @classmethod
    def build_model(cls, args, task):
        if args.draft_heads < 1:
            raise SpecNmtError(f"--draft-heads must be >= 1, got {args.draft_heads}")
        if getattr(args, "verifier_states", False):
            raise SpecNmtError("a heads drafter always reads the verifier's states: drop "
                               "--verifier-states")  # fmt: skip
        model = super().build_model(args, task)
        for parameter in model.decoder.parameters():
            parameter.requires_grad_(False)
        return model

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        """The verifier's decoder (a stock one, its copy)."""
        return TransformerDecoderBase(cfg, tgt_dict, embed_tokens)

    def train(self, mode: bool = True):
        super().train(mode)
        self.decoder.eval()  # frozen: the verifier's states exactly
        return self

    def forward(self, src_tokens, src_lengths, prev_output_tokens, cuts=None, scored=None,
                **unused):  # fmt: skip
        """prev_output_tokens [B, P + M*k]: BOS + target, then M blocks of k masks (their count
        gives k); cuts [B, M], each >= 1. Returns (logits [B*M, k, V], extra), or [n, V] at the
        ``scored`` [B*M, k] blocks' entries."""
        if cuts is None:
            raise ValueError("the heads drafter needs the cut points of its label blocks")
        mask = self.decoder.dictionary.index(MASK_SYMBOL)
        masks = int(prev_output_tokens[0].eq(mask).sum())
        k = masks // cuts.size(1)
        if k > self.heads.count:
            raise SpecNmtError(f"--block-size {k} needs more heads than --draft-heads "
                               f"{self.heads.count}")  # fmt: skip
        with torch.no_grad():
            encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
            prefix = prev_output_tokens[:, : prev_output_tokens.size(1) - masks]
            states, _ = self.decoder.extract_features(prefix, encoder_out)  # [B, P, C]
            pending = self.decoder.embed_tokens(prev_output_tokens.gather(1, cuts))  # [B, M, C]
            rows = torch.arange(cuts.size(0), device=cuts.device).repeat_interleave(cuts.size(1))
            memory = source_memory(self.decoder, encoder_out).select(rows)
        chosen = (cuts - 1).clamp(min=0).unsqueeze(2).expand(-1, -1, states.size(2))
        features = self.heads(states.gather(1, chosen).flatten(0, 1), pending.flatten(0, 1), memory,
                              k)  # fmt: skip
        if scored is not None:
            features = features[scored]
        return self.decoder.output_layer(features), {}

    def initialize_from_verifier(self, path, checkpoint):
        """Also start the heads' source query as the verifier's last encoder-attention query.
        The copy ties its output projection to its embeddings: a verifier with its own output
        projection would never match it, so it is refused now, not after training."""
        weights = checkpoint["model"]
        output = weights.get("decoder.output_projection.weight")
        if output is not None and not torch.equal(output, weights["decoder.embed_tokens.weight"]):
            raise SpecNmtError(
                f"--init-from-verifier: {path} has an output projection of its own (untied "
                "decoder embeddings): a heads drafter needs a verifier trained with "
                "--share-decoder-input-output-embed or --share-all-embeddings"
            )
        super().initialize_from_verifier(path, checkpoint)
        with torch.no_grad():
            query = self.decoder.layers[-1].encoder_attn.q_proj
            self.heads.query.weight.copy_(query.weight)
            self.heads.query.bias.copy_(query.bias)

    def verifier_copies(self):
        return [("encoder", self.encoder), ("decoder", self.decoder)]


@register_model_architecture("heads_drafter", "heads_drafter")
def heads_drafter_architecture(args):
    """Defaults of every heads drafter: 6 heads; the verifier's shape (--init-from-verifier
    gives the depths, the sizes must match it)."""
    args.draft_heads = getattr(args, "draft_heads", 6)
    cached_drafter_architecture(args)


@register_model_architecture("heads_drafter", "heads_drafter_small")
def heads_drafter_small(args):
    """Pairs with the small verifier (d=256, 4 heads, FFN 1024)."""
    args.draft_heads = getattr(args, "draft_heads", 6)
    cached_drafter_small(args)
