"""The feature drafter (EAGLE, Li et al. 2024): an autoregressive drafter over the verifier's
last decoder states. One decoder layer reads, at each position, the verifier's state there and
the token that state chose, and predicts the verifier's next state; the verifier's own output
projection turns that into a draft token. Each later draft feeds the drafter's predicted state
and its own draft, so drafts see each other, at the cost of one drafter step per draft.

Training unrolls the drafting (EAGLE-3's training-time test): pass j feeds, at each position,
the state pass j - 1 predicted there, and attends to the true inputs before the last j - 1
positions and to the predicted ones after, exactly what draft j sees when it is drafted.
The verifier inside the model is frozen; only the drafter's layer trains.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils
from fairseq.models import BaseFairseqModel, register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoderBase, TransformerModel
from torch import Tensor, nn

from spec_nmt.checkpoint_loading import model_config
from spec_nmt.drafters.cached_drafter import same_weights
from spec_nmt.drafters.feature_drafting import FeatureDrafter
from spec_nmt.errors import SpecNmtError


@register_model("feature_drafter")
class FeatureDrafterModel(BaseFairseqModel):
    """Train it with ``--task translation --criterion feature_drafter_loss --verifier-path V``
    on the verifier's data directory (its dictionaries)."""

    # a drafter's checkpoint given as the verifier is refused by the block scorer
    IS_DRAFTER = True
    # the verifier inside it (compact_drafter.py drops it from exports)
    VERIFIER_COPIES = {"verifier.": ""}

    @staticmethod
    def add_args(parser):
        # the Transformer's flags, as the shared training flags (scripts/train_common.sh) pass
        # some; the layer takes the verifier's sizes, its own --dropout
        TransformerModel.add_args(parser)
        parser.add_argument("--verifier-path", metavar="CHECKPOINT",
                            help="the verifier whose decoder states the drafter reads (frozen)")
        parser.add_argument("--unroll-steps", type=int, metavar="J",
                            help="drafting steps simulated in training (training-time test)")

    def __init__(self, verifier, unroll_steps: int, dropout: float):
        super().__init__()
        self.verifier = verifier
        self.verifier.requires_grad_(False)
        decoder = verifier.decoder
        dim = decoder.embed_tokens.embedding_dim
        heads = decoder.layers[0].self_attn.num_heads
        self.heads, self.unroll_steps, self.dropout = heads, unroll_steps, dropout
        self.combine = nn.Linear(2 * dim, dim)
        self.self_norm, self.source_norm, self.ffn_norm, self.final_norm = (
            nn.LayerNorm(dim) for _ in range(4))
        self.self_qkv = nn.Linear(dim, 3 * dim)
        self.self_out = nn.Linear(dim, dim)
        self.source_q = nn.Linear(dim, dim)
        self.source_kv = nn.Linear(dim, 2 * dim)
        self.source_out = nn.Linear(dim, dim)
        ffn = decoder.layers[0].fc1.out_features
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(ffn, dim))

    @classmethod
    def build_model(cls, args, task):
        if not getattr(args, "verifier_path", None):
            raise SpecNmtError("the feature drafter needs --verifier-path VERIFIER.pt")
        if args.unroll_steps < 1:
            raise SpecNmtError(f"--unroll-steps must be at least 1, got {args.unroll_steps}")
        models, _ = checkpoint_utils.load_model_ensemble([args.verifier_path], task=task)
        return cls(models[0].float(), args.unroll_steps, args.dropout)

    @classmethod
    def beside(cls, state, path: str, verifier) -> "FeatureDrafterModel":
        """The drafter of checkpoint ``state`` (read from ``path``) around the loaded
        ``verifier``, which must be the verifier it was trained for."""
        config = model_config(state)
        model = cls(verifier, config.unroll_steps, config.dropout)
        theirs = verifier.state_dict()
        own = {}
        for name, value in state["model"].items():
            if not name.startswith("verifier."):
                own[name] = value
                continue
            verifier_name = name[len("verifier."):]
            if verifier_name not in theirs or not same_weights(theirs[verifier_name], value):
                raise SpecNmtError(
                    f"--drafter-path {path}: the feature drafter was trained for another "
                    f"verifier ({verifier_name} differs): it decodes only with the verifier it "
                    "was trained with (--verifier-path)"
                )
        reference = next(verifier.parameters())
        model.load_state_dict(dict(model.state_dict(), **own))
        return model.to(device=reference.device, dtype=reference.dtype).eval()

    def decoding_decoder(self) -> TransformerDecoderBase:
        """The drafter's layer as a one-layer fairseq decoder (the same computation: a pre-norm
        layer, then the final norm) on the verifier's embeddings and output projection, for
        the block scorer, which gives it its input vectors."""
        verifier = self.verifier.decoder
        cfg = copy.deepcopy(verifier.cfg)
        # the layer's own computation, whatever the verifier's layout
        cfg.decoder.layers, cfg.decoder.normalize_before, cfg.no_decoder_final_norm = 1, True, False
        cfg.activation_fn, cfg.layernorm_embedding = "relu", False
        decoder = TransformerDecoderBase(cfg, verifier.dictionary, verifier.embed_tokens,
                                         output_projection=verifier.output_projection)
        decoder.embed_positions = verifier.embed_positions
        weights = {"layer_norm": self.final_norm, "layers.0.self_attn_layer_norm": self.self_norm,
                   "layers.0.self_attn.out_proj": self.self_out,
                   "layers.0.encoder_attn_layer_norm": self.source_norm,
                   "layers.0.encoder_attn.q_proj": self.source_q,
                   "layers.0.encoder_attn.out_proj": self.source_out,
                   "layers.0.final_layer_norm": self.ffn_norm,
                   "layers.0.fc1": self.ffn[0], "layers.0.fc2": self.ffn[3]}
        state = {f"{name}.{key}": value for name, module in weights.items()
                 for key, value in module.state_dict().items()}
        for fused, names in ((self.self_qkv, ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj")),
                             (self.source_kv, ("encoder_attn.k_proj", "encoder_attn.v_proj"))):
            for key, value in fused.state_dict().items():
                for name, part in zip(names, value.chunk(len(names))):
                    state[f"layers.0.{name}.{key}"] = part
        missing = [name for name in decoder.state_dict() if name not in state
                   and not name.startswith(("embed_tokens.", "output_projection.",
                                            "embed_positions.", "version"))]
        if missing:
            raise SpecNmtError("the verifier's decoder layers have parts a feature drafter's layer "
                               f"cannot stand for ({missing[0]}): use a stock Transformer verifier")
        torch.nn.Module.load_state_dict(decoder, state, strict=False)
        reference = next(self.parameters())
        return decoder.to(device=reference.device, dtype=reference.dtype).eval()

    def decoding_adapter(self, pad: int, eos: int,
                         vocabulary: Optional[Tensor] = None) -> FeatureDrafter:  # fmt: skip
        """What the decoding loop drafts with (``vocabulary``: the ascending symbol ids it
        drafts over, see restrict_output; None: every symbol)."""
        return FeatureDrafter(self, pad, eos, vocabulary)

    def train(self, mode: bool = True):
        super().train(mode)
        self.verifier.eval()  # frozen: its states exactly as when it decodes
        return self

    # -- the verifier's side ------------------------------------------------------------------

    @torch.no_grad()
    def verifier_states(self, src_tokens, src_lengths, prev_output_tokens) -> Tuple[Dict, Tensor]:
        """The verifier's encoder output and its last decoder states [B, T, C] (what its output
        projection reads) over ``prev_output_tokens``."""
        encoder_out = self.verifier.encoder(src_tokens, src_lengths=src_lengths)
        states, _ = self.verifier.decoder(prev_output_tokens, encoder_out, features_only=True)
        return encoder_out, states

    def logits(self, states: Tensor) -> Tensor:
        return self.verifier.decoder.output_layer(states)

    def source_keys(self, encoder_out: Dict) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Keys and values [B, heads, S, d] of the encoder attention, and its padding mask."""
        encoded = encoder_out["encoder_out"][0].transpose(0, 1)  # [B, S, C]
        keys, values = self._heads(self.source_kv(encoded), 2)
        padding = encoder_out["encoder_padding_mask"]
        visible = ~padding[0][:, None, None, :] if padding else None
        return keys, values, visible

    # -- the drafter's layer ------------------------------------------------------------------

    def _heads(self, x: Tensor, parts: int) -> Tuple[Tensor, ...]:
        """[B, T, parts * C] -> ``parts`` tensors [B, heads, T, C / heads]."""
        batch, length, _ = x.shape
        return x.view(batch, length, parts, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def step_inputs(self, states: Tensor, tokens: Tensor) -> Tensor:
        """The layer's input vectors [B, T, C] before positions: the verifier's (or a
        predicted) state with the token it chose."""
        decoder = self.verifier.decoder
        embedded = decoder.embed_scale * decoder.embed_tokens(tokens)
        return self.combine(torch.cat([states, embedded.to(states.dtype)], dim=-1))

    def embed(self, states: Tensor, tokens: Tensor, positions: Tensor) -> Tensor:
        """``step_inputs`` plus the verifier's position embeddings ``positions`` [B, T, C]."""
        return self.step_inputs(states, tokens) + positions

    def queries_keys_values(self, x: Tensor) -> Tuple[Tensor, ...]:
        return self._heads(self.self_qkv(self.self_norm(x)), 3)

    def finish(self, x: Tensor, queries: Tensor, keys: Tensor, values: Tensor,
               visible: Tensor, source: Tuple[Tensor, Tensor, Optional[Tensor]]) -> Tensor:
        """The rest of the layer after its self-attention inputs: the predicted next states."""
        batch, length, dim = x.shape
        p = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible,
                                                  dropout_p=p)
        x = x + F.dropout(self.self_out(attended.transpose(1, 2).reshape(batch, length, dim)),
                          p, self.training)
        source_keys, source_values, source_visible = source
        q = self.source_q(self.source_norm(x)).view(batch, length, self.heads, -1).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, source_keys, source_values,
                                                  attn_mask=source_visible, dropout_p=p)
        x = x + F.dropout(self.source_out(attended.transpose(1, 2).reshape(batch, length, dim)),
                          p, self.training)
        x = x + F.dropout(self.ffn(self.ffn_norm(x)), p, self.training)
        return self.final_norm(x)

    def unrolled(self, states: Tensor, next_tokens: Tensor, positions: Tensor,
                 source) -> List[Tensor]:
        """Predicted next states [B, T, C] of each drafting step j = 1 .. J. Pass j's input at
        position t is (pass j - 1's prediction of the state at t, or the verifier's own for j =
        1; the token at t + 1); its query sees pass 1's keys up to t - j + 1 and pass i's key at
        t - j + i for i = 2 .. j: true inputs up to the verified prefix's end, then its drafts.
        Positions t < j - 1 have no such prefix; their outputs mean nothing."""
        length = states.size(1)
        t = torch.arange(length, device=states.device)
        outputs, keys, values = [], [], []
        inputs = states
        for step in range(1, self.unroll_steps + 1):
            if step > 1:  # the state predicted for position t came out at t - 1
                inputs = torch.cat([states[:, :1], outputs[-1][:, :-1]], dim=1)
            x = self.embed(inputs, next_tokens, positions)
            queries, k, v = self.queries_keys_values(x)
            keys.append(k)
            values.append(v)
            masks = [t[None, :] <= (t[:, None] - step + 1)]
            masks += [t[None, :] == (t[:, None] - step + i) for i in range(2, step + 1)]
            visible = torch.cat(masks, dim=1)  # [T, step * T]
            outputs.append(self.finish(x, queries, torch.cat(keys, dim=2),
                                       torch.cat(values, dim=2), visible, source))
        return outputs

    def extend(self, states: Tensor, next_tokens: Tensor, positions: Tensor, source,
               cache: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tuple]:
        """Feed n inputs [B, n, ...] after the ``cache``d ones (keys and values [B, heads, L,
        d]), causally: what drafting computes, in plain modules (the acceptance replay and the
        tests; decoding runs the same layer on the block scorer). Returns the predicted next
        states [B, n, C] and the cache with the n entries added."""
        x = self.embed(states, next_tokens, positions)
        queries, keys, values = self.queries_keys_values(x)
        if cache is not None:
            keys, values = torch.cat([cache[0], keys], dim=2), torch.cat([cache[1], values], dim=2)
        entries, length = x.size(1), keys.size(2)
        visible = None if entries == 1 else torch.ones(
            entries, length, dtype=torch.bool, device=x.device).tril(length - entries)
        return self.finish(x, queries, keys, values, visible, source), (keys, values)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, target, **unused):
        """Logits [J, B, T, V] of each drafting step, the drafter's predicted states
        [J, B, T, C] and the verifier's states [B, T, C]. At position t, step j predicts the
        verifier's state at t + 1 and the token after ``target[t]``."""
        encoder_out, states = self.verifier_states(src_tokens, src_lengths, prev_output_tokens)
        positions = self.verifier.decoder.embed_positions(prev_output_tokens)
        predicted = torch.stack(self.unrolled(states, target, positions,
                                              self.source_keys(encoder_out)))
        return self.logits(predicted), predicted, states


@register_model_architecture("feature_drafter", "feature_drafter")
def feature_drafter_architecture(args):
    args.unroll_steps = getattr(args, "unroll_steps", 3)
    args.dropout = getattr(args, "dropout", 0.1)
