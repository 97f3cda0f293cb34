"""A verifier with proposal heads, trained together (Stern et al., 2018; Medusa-2, Cai et al., 2024).

The verifier is a stock Transformer; ``ProposalHeads`` read its last decoder state, the one that
chooses the next token, and that token's embedding (as EAGLE feeds it), and propose the k tokens
after it. Trained jointly, the verifier's states learn to carry the future the heads need. In
decoding, the block the verifier scores yields the state at the first rejection, so the next
block is drafted by two one-row products and one output projection of k rows.

Train with ``--arch transformer_proposal_heads`` and ``--criterion proposal_heads_loss`` from a
stock verifier checkpoint (``--finetune-from-model``: the heads start at their initialisation).
"""

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, base_architecture
from torch import Tensor, nn

from spec_nmt.errors import SpecNmtError


class ProposalHeads(nn.Module):
    """From the state s that chose the pending token and that token's embedding e, a trunk
    ``z = s + SiLU(M [s; e])``, ``z += F2 SiLU(F1 z)``, and ``count`` residual heads
    ``z + SiLU(H_j z)``, all heads in one product. Every residual branch starts at zero, so each head starts from the verifier's own
    prediction from that state (Medusa's initialisation)."""

    def __init__(self, count: int, channels: int):
        super().__init__()
        self.count = count
        self.mix = nn.Linear(2 * channels, channels)
        self.fc1 = nn.Linear(channels, 4 * channels)
        self.fc2 = nn.Linear(4 * channels, channels)
        self.heads = nn.Linear(channels, count * channels)  # head j: rows j*C .. (j+1)*C
        for branch in (self.mix, self.fc2, self.heads):
            nn.init.zeros_(branch.weight)
            nn.init.zeros_(branch.bias)

    def forward(self, states: Tensor, pending: Tensor) -> Tensor:
        """states [..., C] and the pending tokens' embeddings [..., C] -> [..., count, C]."""
        silu = nn.functional.silu
        trunk = states + silu(self.mix(torch.cat([states, pending], dim=-1)))
        trunk = trunk + self.fc2(silu(self.fc1(trunk)))
        heads = self.heads(trunk).unflatten(-1, (self.count, -1))
        return trunk.unsqueeze(-2) + silu(heads)


@register_model("transformer_proposal_heads")
class TransformerProposalHeadsModel(TransformerModel):
    """fairseq's Transformer plus ``--proposal-heads`` heads on its last decoder state."""

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        parser.add_argument("--proposal-heads", type=int, metavar="N",
                            help="proposal heads: the most tokens drafted per iteration")  # fmt: skip
        parser.add_argument("--freeze-verifier", action="store_true",
                            help="train the heads only (Medusa-2's first stage)")  # fmt: skip

    @classmethod
    def build_model(cls, args, task):
        if args.proposal_heads < 1:
            raise SpecNmtError(f"--proposal-heads must be >= 1, got {args.proposal_heads}")
        model = super().build_model(args, task)
        if getattr(args, "freeze_verifier", False):
            model.requires_grad_(False)  # fairseq's optimizer takes only what needs a gradient
        model.proposal_heads = ProposalHeads(args.proposal_heads, args.decoder_embed_dim)
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **unused):
        """The verifier's logits [B, T, V] and, in extra, its last decoder states [B, T, C]."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        states, extra = self.decoder.extract_features(prev_output_tokens, encoder_out=encoder_out)
        extra["states"] = states
        return self.decoder.output_layer(states), extra

    def proposal_logits(self, states: Tensor, pending: Tensor, vocabulary: int = 0) -> Tensor:
        """states [..., C] and the pending tokens [...] -> the heads' logits [..., count, V] over
        the first ``vocabulary`` symbols of the dictionary (its most frequent; 0: all)."""
        embedded = self.decoder.embed_tokens(pending)
        weight = self.decoder.output_projection.weight
        return nn.functional.linear(self.proposal_heads(states, embedded),
                                    weight[:vocabulary] if vocabulary else weight)  # fmt: skip

    def upgrade_state_dict_named(self, state_dict, name):
        """A stock verifier's checkpoint has no heads: they keep their initialisation."""
        super().upgrade_state_dict_named(state_dict, name)
        prefix = f"{name}." if name else ""
        for key, value in self.proposal_heads.state_dict().items():
            state_dict.setdefault(f"{prefix}proposal_heads.{key}", value)


@register_model_architecture("transformer_proposal_heads", "transformer_proposal_heads")
def proposal_heads_architecture(args):
    args.proposal_heads = getattr(args, "proposal_heads", 4)
    base_architecture(args)
