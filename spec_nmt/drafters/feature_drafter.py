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
from spec_nmt.decoding.drafter import (
    finished_rows, goes_on, grow_tree, no_drafts, pending_tokens, stopped_chain,
)
from spec_nmt.decoding.linears import PackedLinears
from spec_nmt.decoding.scorer import BlockScorer, ScorerState, among_real_entries, value_range
from spec_nmt.decoding.scripted_layers import decoder_layers, linear, script
from spec_nmt.decoding.tree import DraftTree, before_any_eos, greedy_chain
from spec_nmt.drafters.cached_drafter import same_weights
from spec_nmt.drafters.spec_drafter import over_all_symbols, restrict_output
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DraftPlan


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
                         vocabulary: Optional[Tensor] = None) -> "FeatureDrafter":  # fmt: skip
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


class FeatureDraftState:
    """A batch's drafting state: the drafter's scorer state (its cache holds the true inputs
    of the verified prefix, up to the pending token) and the verifier's states of the entries
    the verifier kept at its last commit, with their count per row, to be fed next."""

    def __init__(self, verifier_state: ScorerState, drafter_state: ScorerState):
        self.verifier_state = verifier_state
        self.drafter_state = drafter_state
        self.new_states: Optional[Tensor] = None  # [B, n, C]
        self.new_counts: Optional[Tensor] = None  # [B]


class FeatureDrafter:
    """The decoding loop's adapter of a feature drafter: a chain of k drafts per iteration, one
    drafter step each, after feeding the verifier's states of the newly verified positions. The
    drafter's layer runs on the block scorer as a one-layer decoder whose inputs are given; a
    chain of greedy drafts runs its steps in one scripted call (``greedy_drafts``) where the
    scorer's layers are scripted."""

    def __init__(self, model: FeatureDrafterModel, pad: int, eos: int,
                 vocabulary: Optional[Tensor] = None):  # fmt: skip
        self.model, self.pad, self.eos = model, pad, eos
        self.symbols = len(model.verifier.decoder.dictionary)
        self.decoder = model.decoding_decoder()
        self.vocabulary = vocabulary
        if vocabulary is not None:  # before packing: the smaller projection is what runs
            restrict_output(self.decoder, vocabulary)
        self.scorer = BlockScorer(DecodingModel(self.decoder, model.verifier.encoder),
                                  role="the feature drafter (--drafter-path)", drafter=True,
                                  project=PackedLinears(self.decoder))  # fmt: skip

    def max_positions(self) -> int:
        return self.scorer.max_positions()

    def max_source_positions(self) -> int:
        return self.model.verifier.encoder.max_positions()

    def check_depth(self, depth: int) -> None:
        """Any depth: each draft is one more step."""

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state: Optional[ScorerState] = None) -> FeatureDraftState:  # fmt: skip
        if verifier_state is None:
            raise SpecNmtError("the feature drafter reads the verifier's states: give it the "
                               "verifier's scorer state")
        verifier_state.keep_block_states = True
        drafter_state = self.scorer.start(net_input, encoder_out=verifier_encoder_out)
        drafter_state.keep_block_states = True
        return FeatureDraftState(verifier_state, drafter_state)

    def propose(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                plan: DraftPlan, generator) -> DraftTree:  # fmt: skip
        if state.new_counts is None:  # the first iteration: no verifier state to draft from
            return no_drafts(tokens, self.symbols, plan.sample)
        cache = state.drafter_state
        scripted = self._scripted_steps(tokens.device) is not None
        if plan.is_chain and not plan.sample and plan.depth and scripted:
            tree = self._greedy_chain(state, tokens, lengths, plan)
        else:
            tree = self._tree_by_steps(state, tokens, lengths, plan, generator)
        self.scorer.commit(cache, None, torch.zeros_like(lengths))  # drop the drafted entries
        return tree

    def _tree_by_steps(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                       plan: DraftPlan, generator) -> DraftTree:  # fmt: skip
        """Any chain or tree, one scorer call per level (grow_tree draws each level from its
        logits). A node's input is the state its parent predicted with its own token; it sees
        its ancestors among the drafted entries, the verified ones all."""
        cache = state.drafter_state
        predicted: Optional[Tensor] = None  # [B, nodes of the level before, C]
        drafted = 0  # the entries of the block: the drafted nodes

        def expand(level_tokens: Tensor, visible: Optional[Tensor], depth: int,
                   leaf: bool) -> Tensor:  # fmt: skip
            nonlocal predicted, drafted
            batch, width = level_tokens.shape
            if depth == 0:  # even when nothing is drafted: the cache takes the verified entries
                logits, predicted = self._feed_verified(state, tokens, lengths)
            if leaf:  # the leaves' children are never drafted
                return level_tokens.new_full((batch, width, self.symbols), float("-inf"),
                                             dtype=torch.float)  # fmt: skip
            if depth > 0:
                if visible is not None:  # block_visibility's: drop the root's column
                    visible = visible[:, :, 1:]
                if visible is not None and depth > 1:
                    before = drafted - predicted.size(1)  # the parents' level starts there
                    parent = visible[:, :, before:drafted].long().argmax(dim=2).expand(batch, -1)
                    parent = parent.unsqueeze(2).expand(-1, -1, predicted.size(2))
                    parent_states = predicted.gather(1, parent)
                else:  # a chain's parent, or the root
                    parent_states = predicted.expand(-1, width, -1)
                depths = torch.full((width,), depth - 1, device=level_tokens.device)
                inputs = self.model.step_inputs(parent_states, level_tokens)
                logits = self.scorer.score_logits(cache, level_tokens, depths, visible,
                                                  inputs=inputs)  # fmt: skip
                predicted = cache.block_states
                drafted += width
            logits = self._over_all_symbols(logits)
            return torch.log_softmax(logits, dim=-1) if plan.sample else logits

        pending = pending_tokens(tokens, lengths)
        return grow_tree(plan, pending, expand, self.eos, generator,
                         needs_visibility=not plan.is_chain,
                         finished=finished_rows(pending, lengths, self.eos))  # fmt: skip

    def _over_all_symbols(self, logits: Tensor) -> Tensor:
        """Logits [B, n, V] over the verifier's symbols from the projection's: -inf for PAD
        and for the symbols outside the draft vocabulary."""
        if self.vocabulary is not None:
            return over_all_symbols(logits, self.vocabulary, self.symbols)
        logits[:, :, self.pad] = float("-inf")
        return logits

    def _scripted_steps(self, device: torch.device):
        """The drafter's layer as ``greedy_drafts`` takes it, or None where the scorer runs
        the stock modules (no TorchScript, or not on the CPU: as in score_logits)."""
        if greedy_drafts_scripted is None or device.type != "cpu":
            return None
        return self.scorer.scripted_layers()

    def _greedy_chain(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor,
                      plan: DraftPlan) -> DraftTree:  # fmt: skip
        """The chain of ``depth`` greedy drafts in one scripted call (``greedy_drafts``): the
        drafts ``_tree_by_steps`` makes, without the Python between the steps."""
        cache, counts, depth = state.drafter_state, state.new_counts, plan.depth
        new_tokens = self._new_tokens(state, tokens, lengths)
        batch, width = new_tokens.shape
        # the loop's token buffer bounds every fed length: no need to read them
        self.scorer.reserve(cache, tokens.size(1) + width + depth, state.new_states)
        layers = self._scripted_steps(tokens.device)
        verifier, norm = self.model.verifier.decoder, self.decoder.layer_norm
        projection = self.decoder.output_projection
        finished = finished_rows(pending_tokens(tokens, lengths), lengths, self.eos)
        drafts, confidence = greedy_drafts_scripted(
            state.new_states, new_tokens, counts, finished, depth, cache.fed_lengths,
            self.scorer.position_table(tokens.size(1) + width + depth),
            verifier.embed_tokens.weight, float(verifier.embed_scale), self.model.combine.weight,
            self.model.combine.bias, layers.layers, layers.packed(batch * width),
            layers.packed(batch), cache.keys, cache.values, cache.encoder_keys,
            cache.encoder_values, cache.encoder_bias, norm.weight, norm.bias, projection.weight,
            self.scorer.project.packed_weight((projection,), batch), self.vocabulary, self.pad,
            self.eos, plan.stop_below, layers.heads, layers.scaling, layers.eps, layers.gelu)
        self.scorer.commit(cache, None, counts)
        if not plan.stop_below:
            return greedy_chain(drafts, self.eos)
        valid = before_any_eos(drafts, self.eos) & ~finished.unsqueeze(1)
        return stopped_chain(drafts, confidence, valid, plan.stop_below, self.eos)

    def _new_tokens(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor) -> Tensor:
        """[B, n] the tokens the verifier's kept states chose: each row's newly verified
        tokens, the pending one last (padded after a row's count)."""
        order = torch.arange(state.new_states.size(1), device=tokens.device)
        chosen = (lengths - state.new_counts + 1).unsqueeze(1) + order
        return tokens.gather(1, chosen.clamp(0, tokens.size(1) - 1))

    def _feed_verified(self, state: FeatureDraftState, tokens: Tensor, lengths: Tensor):
        """Feed each row the verifier's states kept at its last commit with the tokens they
        chose into the cache; returns the logits [B, 1, projection rows] and the predicted
        state [B, 1, C] after the pending token."""
        cache, counts = state.drafter_state, state.new_counts
        new_tokens = self._new_tokens(state, tokens, lengths)
        width = new_tokens.size(1)
        order = torch.arange(width, device=tokens.device)
        inputs = self.model.step_inputs(state.new_states, new_tokens)
        fewest, _ = value_range(counts)
        if fewest == width:  # every row feeds as many entries (always at batch 1)
            logits = self.scorer.score_logits(cache, new_tokens, outputs=1, inputs=inputs)
            predicted = cache.block_states[:, -1:]
        else:  # only each row's last state is projected, as greedy_drafts does
            causal = (order.unsqueeze(0) <= order.unsqueeze(1)).unsqueeze(0)
            visible = among_real_entries(causal, order < counts.unsqueeze(1))
            self.scorer.score_logits(cache, new_tokens, order, visible, outputs=0, inputs=inputs)
            last = (counts - 1).clamp(min=0)[:, None, None]
            predicted = cache.block_states.gather(
                1, last.expand(-1, 1, cache.block_states.size(2)))
            logits = self.scorer.project(self.decoder.output_projection, predicted).float()
        self.scorer.commit(cache, None, counts)
        return logits, predicted

    def commit(self, state: FeatureDraftState, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """The verifier's states of the kept entries (``keep[b, :n_keep[b]]`` in scoring order,
        None: a chain's first ``n_keep``) are fed with the next proposal."""
        states = state.verifier_state.block_states
        width = max(int(n_keep.max()), 1)
        if keep is None:
            state.new_states = states[:, :width]
        else:
            kept = keep[:, :width, None].expand(-1, -1, states.size(2))
            state.new_states = states.gather(1, kept)
        state.new_counts = n_keep

    def select_rows(self, state: FeatureDraftState, rows: Tensor) -> None:
        self.scorer.select_rows(state.drafter_state, rows)
        if state.new_counts is not None:
            state.new_states = state.new_states.index_select(0, rows)
            state.new_counts = state.new_counts.index_select(0, rows)


def greedy_drafts(states: Tensor, tokens: Tensor, counts: Tensor, finished: Tensor, drafts: int,
                  fed_lengths: Tensor, positions: Tensor, embed: Tensor, embed_scale: float,
                  combine_weight: Tensor, combine_bias: Tensor, layers: List[List[Tensor]],
                  packed_fed: List[List[Optional[Tensor]]],
                  packed_drafted: List[List[Optional[Tensor]]], keys: List[Tensor],
                  values: List[Tensor], encoder_keys: List[Tensor], encoder_values: List[Tensor],
                  encoder_bias: Optional[Tensor], norm_weight: Tensor, norm_bias: Tensor,
                  projection: Tensor, projection_packed: Optional[Tensor],
                  vocabulary: Optional[Tensor], pad: int, eos: int, stop_below: float,
                  heads: int, scaling: float, eps: float,
                  gelu: bool) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``drafts`` greedy drafts [B, drafts] of the feature drafter's layer (``decoder_layers``:
    pre-norm, one layer), its final norm and ``projection``, as the block scorer runs them (the
    same products, so the same drafts): first the verifier's kept ``states`` [B, n, C] with the
    ``tokens`` [B, n] they chose (row b's first ``counts[b]``), written at the cache slots and
    positions ``fed_lengths[b] + i``, give the first draft; then each draft with the state
    predicted before it, after them, gives the next. Every entry sees every slot up to its own.
    ``projection``'s rows are the symbols of ``vocabulary`` (ascending ids), or without one all
    symbols, of which ``pad`` is never drafted. Returns the drafts and, with ``stop_below`` > 0,
    their probabilities under the drafter [B, n] (else zeros): the chain ends, perhaps before
    ``drafts``, where no row goes on (goes_on; ``finished`` rows [B] never do, nor a
    row after its EOS)."""
    channels = states.size(-1)
    made: List[Tensor] = []
    inputs, chosen, starts, packed = states, tokens, fed_lengths, packed_fed
    going = ~finished  # rows whose chain goes on
    confidences: List[Tensor] = []
    for draft in range(drafts):
        if draft > 0:
            starts = fed_lengths + counts + (draft - 1)
            packed = packed_drafted
        width = chosen.size(1)
        embedded = embed_scale * F.embedding(chosen, embed)
        x = F.linear(torch.cat([inputs, embedded.to(inputs.dtype)], dim=-1), combine_weight,
                     combine_bias)  # fmt: skip
        slots = starts.unsqueeze(1) + torch.arange(width, device=x.device)  # [B, W]
        x = x + positions[slots.clamp(max=positions.size(0) - 1)]
        lowest, highest = int(starts.min()), int(starts.max())
        span = highest + width
        unseen = torch.arange(span, device=x.device)[None, None, :] > slots.unsqueeze(2)
        bias = torch.zeros(unseen.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(unseen, float("-inf")).unsqueeze(1)  # [B, 1, W, span]
        x = decoder_layers(x, layers, packed, keys, values, lowest,
                           None if lowest == highest else slots, span, bias, encoder_keys,
                           encoder_values, encoder_bias, heads, scaling, eps, True,
                           gelu)  # fmt: skip
        x = F.layer_norm(x, [channels], norm_weight, norm_bias, eps)
        if draft == 0:  # the state after each row's last fed entry
            last = (counts - 1).clamp(min=0)[:, None, None].expand(-1, 1, channels)
            x = x.gather(1, last)
        inputs = x
        logits = linear(x, projection, None, projection_packed).float()
        if vocabulary is None:
            logits[:, :, pad] = float("-inf")
        best, chosen = logits.max(dim=-1)  # max's indices: argmax's, faster on the CPU
        if vocabulary is not None:
            chosen = vocabulary[chosen]
        made.append(chosen)
        confidence = torch.zeros_like(best)
        if stop_below > 0:
            confidence = (best - logits.logsumexp(dim=-1)).exp()
            going = goes_on(chosen.squeeze(1), confidence.squeeze(1), going, stop_below, eos)
        confidences.append(confidence)
        if stop_below > 0 and not bool(going.any()):
            break
    return torch.cat(made, dim=1), torch.cat(confidences, dim=1)


greedy_drafts_scripted = script(greedy_drafts)


class DecodingModel(nn.Module):
    """What the block scorer reads of a model: the drafter's one-layer decoder, and the
    verifier's encoder (never run: the drafter starts from the verifier's encoder output)."""

    def __init__(self, decoder: TransformerDecoderBase, encoder):
        super().__init__()
        self.decoder, self.encoder = decoder, encoder
