"""Spec-Drafter (Xia et al., 2023, "Speculative Decoding: Exploiting Speculative Execution for
Accelerating Seq2seq Generation"): a non-autoregressive drafter with a deep encoder and a shallow
decoder. Its decoder input is BOS + the verified target prefix + k ``[MASK]`` symbols; one
bidirectional pass predicts the k next tokens at the mask positions.

The mask is a real dictionary symbol: the task appends ``[MASK]`` to the end of the (joined)
dictionary when the data's dictionary lacks it, so every other symbol keeps its index and the
drafter's ids match the verifier's, which is trained on the unchanged dictionary.
"""

import hashlib
import logging
from types import SimpleNamespace
from typing import Dict, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerModel,
    base_architecture,
)
from torch import Tensor

from spec_nmt.decoding.drafter import finished_rows, grow_tree, pending_tokens, stopped_chain
from spec_nmt.decoding.tree import DraftTree, beam_tree, before_any_eos, greedy_chain, greedy_tree
from spec_nmt.drafters.verifier_layout import adopt_verifier_layout
from spec_nmt.errors import SpecNmtError
from spec_nmt.settings import DraftPlan

logger = logging.getLogger(__name__)

MASK_SYMBOL = "[MASK]"


def masked_input(tokens: torch.Tensor, prefix_ends: torch.Tensor, k: int, mask: int,
                 pad: int) -> torch.Tensor:  # fmt: skip
    """The Spec-Drafter's decoder input [B, max(prefix_ends) + k], in training and decoding
    alike: row b's first ``prefix_ends[b]`` tokens (BOS + prefix), k masks, then padding.
    ``tokens`` [B, >= max(prefix_ends) + k] holds each row's BOS + prefix from column 0."""
    width = int(prefix_ends.max()) + k
    slots = torch.arange(width, device=tokens.device).unsqueeze(0)
    ends = prefix_ends.unsqueeze(1)
    return torch.where(slots < ends, tokens[:, :width], torch.where(slots < ends + k, mask, pad))


def fit_width(tokens: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    """Right-pad or cut [B, T] tokens to [B, width]."""
    if tokens.size(1) >= width:
        return tokens[:, :width]
    filler = tokens.new_full((tokens.size(0), width - tokens.size(1)), pad)
    return torch.cat([tokens, filler], dim=1)


def dictionary_fingerprint(dictionary) -> str:
    """A short hash of a dictionary's symbols in index order."""
    return hashlib.sha1("\n".join(dictionary.symbols).encode("utf-8")).hexdigest()[:16]


class SpecDrafterDecoder(TransformerDecoderBase):
    """A Transformer decoder without the causal mask, scoring only the [MASK] positions."""

    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(cfg, dictionary, embed_tokens)
        if MASK_SYMBOL not in dictionary.indices:
            raise ValueError(f"the drafter's dictionary has no {MASK_SYMBOL} symbol")
        self.mask_idx = dictionary.index(MASK_SYMBOL)

    def forward(self, prev_output_tokens, encoder_out=None, scored=None, **unused):
        """prev_output_tokens: [B, T], each row BOS + prefix + k masks, right-padded.
        Returns (logits [B, k, V] at the mask positions, extra); with ``scored`` [B, k] bool,
        logits [n, V] of the n masks it marks only (see ``score_masks``)."""
        is_mask = prev_output_tokens.eq(self.mask_idx)
        block = is_mask.sum(dim=1)
        if block.numel() and not bool(block.eq(block[0]).all()):
            raise ValueError("every row of a drafter input must hold the same number of masks")
        features, extra = self.extract_features(
            prev_output_tokens, encoder_out, full_context_alignment=True
        )
        batch = prev_output_tokens.size(0)
        block_features = features[is_mask].view(batch, -1, features.size(-1))
        return score_masks(self, block_features, scored), extra


def score_masks(decoder, block_features: torch.Tensor,
                scored: Optional[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The output layer over the masks' features [B, k, C]: logits [B, k, V], or with
    ``scored`` [B, k] bool logits [n, V] of the marked masks in row-major order. The loss marks
    the masks that have a label: a cut near the end of its sentence has masks past the EOS
    (27 % of all on bench-de-en), and the output layer is about half of a training step."""
    if scored is not None:
        block_features = block_features[scored]
    return decoder.output_layer(block_features)


@register_model("spec_drafter")
class SpecDrafterModel(TransformerModel):
    """Deep-encoder/shallow-decoder NAR drafter. Train it with ``--task spec_translation``."""

    # a drafter's checkpoint given as the verifier is refused by the block scorer
    IS_DRAFTER = True

    def decoding_adapter(self, pad: int, eos: int, vocabulary: Optional[torch.Tensor] = None):
        """What the decoding loop drafts with (``vocabulary``: see restrict_output)."""
        return NarDrafter(self, pad, eos, vocabulary)

    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        parser.add_argument(
            "--drafter-dictionary-fingerprint",
            default=None,
            help="set automatically: hash of the dictionary the drafter was trained with, "
            "checked when it is loaded next to a verifier",
        )
        parser.add_argument(
            "--init-from-verifier",
            default=None,
            metavar="CHECKPOINT",
            help="start training from a verifier checkpoint's encoder and token embeddings "
            "(same encoder shape required); the [MASK] embedding keeps its random init",
        )

    @classmethod
    def build_model(cls, args, task):
        if not hasattr(task, "drafter_dictionaries"):
            raise SpecNmtError(
                "spec_drafter models are trained and loaded with --task spec_translation"
            )
        src_dict, tgt_dict = task.drafter_dictionaries()
        fingerprint = dictionary_fingerprint(tgt_dict)
        saved = getattr(args, "drafter_dictionary_fingerprint", None)
        if saved and saved != fingerprint:
            raise SpecNmtError(
                f"the drafter was trained with a different dictionary than the one in "
                f"{task.cfg.data} (fingerprint {saved} != {fingerprint}): use the data directory "
                "the drafter and verifier were trained on"
            )
        args.drafter_dictionary_fingerprint = fingerprint
        dictionaries = SimpleNamespace(source_dictionary=src_dict, target_dictionary=tgt_dict)
        return super().build_model(args, dictionaries)

    # The earliest cut a training block may follow (0: right after BOS).
    FIRST_CUT = 0

    def draft_slots(self, k: int) -> int:
        """Mask slots per block of k drafts: one per draft."""
        return k

    @staticmethod
    def training_input(shifted: torch.Tensor, cuts: torch.Tensor, k: int, mask: int,
                       pad: int) -> Dict[str, torch.Tensor]:  # fmt: skip
        """The decoder's training input for targets ``shifted`` [B, T] (BOS + target) cut at
        ``cuts`` [B * m] (m cuts per sentence, next to each other): one row BOS + y[:c] + k
        masks per cut (the model runs its encoder once per sentence)."""
        blocks = cuts.size(0) // shifted.size(0)
        rows = fit_width(shifted.repeat_interleave(blocks, dim=0), int(cuts.max()) + 1 + k, pad)
        return {"prev_output_tokens": masked_input(rows, cuts + 1, k, mask, pad)}

    # Name prefixes of the verifier's tensors this drafter starts from: the encoder (and, always,
    # the token embeddings and output projection), SpecDec's drafter initialisation.
    VERIFIER_PARTS = ("encoder.",)

    @classmethod
    def adopt_verifier(cls, model_cfg, verifier_cfg, path) -> None:
        """Give the drafter configuration what it must share with the verifier whose
        configuration is ``verifier_cfg`` (--init-from-verifier ``path``)."""
        adopt_verifier_layout(model_cfg, verifier_cfg, path, cls.VERIFIER_PARTS)

    def initialize_from_verifier(self, path, checkpoint):
        """Copy the tensors named by ``VERIFIER_PARTS`` from ``checkpoint`` (the verifier's, read
        from ``path``) where the drafter has them. The drafter's dictionary is the verifier's plus
        [MASK] at the end, so vocabulary rows line up; the [MASK] row keeps its random init."""
        copied = self.copy_from_verifier(path, checkpoint["model"], self.VERIFIER_PARTS)
        if not any(name.startswith("encoder.layers.") for name in copied):
            raise SpecNmtError(f"--init-from-verifier: {path} holds no Transformer encoder")
        logger.info("initialised %d drafter tensors from the verifier %s", len(copied), path)

    def copy_from_verifier(self, path, verifier_state, parts) -> Dict[str, torch.Tensor]:
        """Load the tensors of ``verifier_state`` (read from ``path``) whose names start with
        ``parts``, and the embeddings, where the drafter has them; returns what it loaded."""
        own_state = self.state_dict()
        copied = {}
        for name, value in verifier_state.items():
            is_embedding = name.endswith(("embed_tokens.weight", "output_projection.weight"))
            if not (name.startswith(parts) or is_embedding) or name not in own_state:
                continue
            target = own_state[name]
            rows = value.size(0)
            if is_embedding and target.size(0) == rows + 1 and target.shape[1:] == value.shape[1:]:
                copied[name] = torch.cat([value.to(target.dtype), target[rows:]])
            elif target.shape == value.shape:
                copied[name] = value.to(target.dtype)
            else:
                side = "decoder" if "decoder." in name else "encoder"
                raise SpecNmtError(
                    f"--init-from-verifier: {path} has {name} of shape {tuple(value.shape)}, the "
                    f"drafter needs {tuple(target.shape)}: give the drafter the verifier's {side} "
                    f"shape (--{side}-embed-dim/--{side}-ffn-embed-dim)"
                )
        # Depths may differ (a deeper drafter's extra layers start random, a shallower one takes
        # the first layers); any other tensor that only one side has means the copied layers
        # would compute something else (a final layer norm, embedding norm, learned positions).
        for name in sorted(verifier_state.keys() ^ own_state.keys()):
            if name.startswith(parts) and ".layers." not in name:
                side = "the verifier" if name in verifier_state else "the drafter"
                raise SpecNmtError(
                    f"--init-from-verifier: only {side} has {name}, so the copied layers would "
                    f"compute something else than in {path}: train the drafter with the "
                    "verifier's layer-norm and position flags"
                )
        # torch's loading, not fairseq's: fairseq would first "upgrade" the parts missing from
        # ``copied`` as if they came from an old checkpoint (version 1, final norms dropped)
        torch.nn.Module.load_state_dict(self, copied, strict=False)
        return copied

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return SpecDrafterDecoder(cfg, tgt_dict, embed_tokens)

    def forward(self, src_tokens, src_lengths, prev_output_tokens, scored=None, **unused):
        """prev_output_tokens may hold several rows per sentence (consecutive, the same number
        for every sentence): training with several cut points shares one encoder pass.
        ``scored``: the masks to score (the decoder's ``forward``)."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        rows, sentences = prev_output_tokens.size(0), src_tokens.size(0)
        if rows != sentences:
            if rows % sentences:
                raise ValueError(f"{rows} decoder rows for {sentences} sentences")
            index = torch.arange(sentences, device=src_tokens.device)
            encoder_out = self.encoder.reorder_encoder_out(
                encoder_out, index.repeat_interleave(rows // sentences)
            )
        return self.decoder(prev_output_tokens, encoder_out, scored=scored)


def architecture_defaults(args, **defaults) -> None:
    """Set each of ``defaults`` on ``args`` where the command line left it unset (fairseq's
    architecture functions)."""
    for name, value in defaults.items():
        setattr(args, name, getattr(args, name, value))


@register_model_architecture("spec_drafter", "spec_drafter")
def spec_drafter_architecture(args):
    """Defaults of every Spec-Drafter: deep encoder, shallow decoder; the rest as fairseq's
    transformer base. Named variants set their sizes and call this."""
    architecture_defaults(args, encoder_layers=12, decoder_layers=2)
    base_architecture(args)


@register_model_architecture("spec_drafter", "spec_drafter_base")
def spec_drafter_base(args):
    """The paper's shape: 12 encoder / 2 decoder layers, d=512, 8 heads, FFN 2048."""
    architecture_defaults(args, encoder_embed_dim=512, encoder_ffn_embed_dim=2048,
                          encoder_attention_heads=8)  # fmt: skip
    spec_drafter_architecture(args)


@register_model_architecture("spec_drafter", "spec_drafter_small")
def spec_drafter_small(args):
    """A drafter that trains on a few CPU cores: 6 encoder / 2 decoder layers, d=256, 4 heads."""
    architecture_defaults(args, encoder_layers=6, encoder_embed_dim=256,
                          encoder_ffn_embed_dim=1024, encoder_attention_heads=4,
                          decoder_embed_dim=256, decoder_ffn_embed_dim=1024,
                          decoder_attention_heads=4)  # fmt: skip
    spec_drafter_architecture(args)


def output_size(decoder) -> int:
    """Columns of a decoder's output projection (fp32 or dynamically quantized)."""
    return decoder.output_projection.out_features


def restrict_output(decoder, vocabulary: Tensor) -> None:
    """Keep only the rows of ``vocabulary`` (ascending symbol ids) in a NAR drafter decoder's
    output projection, in place. Ascending ids break ties between equal logits as the whole
    projection would, so a best token inside the vocabulary stays the one drafted."""
    if decoder.output_projection.bias is not None:
        raise ValueError("a drafter's output projection has no bias in fairseq")
    weight = decoder.output_projection.weight
    projection = torch.nn.Linear(weight.size(1), vocabulary.numel(), bias=False,
                                 device=weight.device, dtype=weight.dtype)  # fmt: skip
    with torch.no_grad():
        projection.weight.copy_(weight.index_select(0, vocabulary.to(weight.device)))
    decoder.output_projection = projection


def over_all_symbols(values: Tensor, vocabulary: Tensor, symbols: int) -> Tensor:
    """[B, n, D] over a draft vocabulary's columns (``restrict_output``'s) -> [B, n, symbols]
    over every symbol, -inf outside the vocabulary."""
    full = values.new_full((*values.shape[:2], symbols), float("-inf"))
    full[:, :, vocabulary] = values
    return full


class NarDrafter:
    """The non-autoregressive Spec-Drafter: one decoder pass fills k ``[MASK]`` positions.

    Its decoder attends bidirectionally over the whole input, so nothing of the prefix can be
    cached between iterations; the (deep) encoder runs once per sentence.
    """

    def __init__(self, model, pad: int, eos: int, vocabulary: Optional[Tensor] = None):
        """``vocabulary``: the ascending symbol ids that ``restrict_output`` left the model's
        output projection (None: every symbol of the verifier's dictionary)."""
        self.model = model
        self.mask = model.decoder.dictionary.index(MASK_SYMBOL)
        if self.mask != len(model.decoder.dictionary) - 1:
            raise ValueError("the Spec-Drafter's [MASK] must be its dictionary's last symbol")
        if vocabulary is not None and output_size(model.decoder) != vocabulary.numel():
            raise ValueError("the drafter's output projection was not restricted to its vocabulary")
        self.pad, self.eos = pad, eos
        self.vocabulary = vocabulary

    def max_positions(self) -> int:
        return self.model.decoder.max_positions()

    def max_source_positions(self) -> int:
        return self.model.encoder.max_positions()

    def start(self, net_input: Dict[str, Tensor], verifier_encoder_out: Dict,
              verifier_state=None) -> Dict:  # fmt: skip
        return self.model.encoder.forward_torchscript(net_input)

    def position_logits(self, encoder_out: Dict, tokens: Tensor, lengths: Tensor, k: int):
        """Float logits [B, k, D] over the draft columns (``_draft_columns``) at the k masks
        after each row's ``tokens[b, :lengths[b] + 1]`` (BOS + verified prefix). ``tokens``
        must be at least ``lengths.max() + 1 + k`` wide."""
        decoder_input = masked_input(tokens, lengths + 1, k, self.mask, self.pad)
        logits, _ = self.model.decoder(decoder_input, encoder_out)  # at the masks only
        return self._draft_columns(logits)

    def check_depth(self, depth: int) -> None:
        """Any depth: one pass fills as many masks."""

    def _draft_columns(self, logits: Tensor) -> Tensor:
        """The columns a draft may take: the vocabulary's, or without a vocabulary the
        verifier's symbols except PAD ([MASK] is the drafter's last symbol, appended to the
        verifier's dictionary: dropping its column leaves exactly the verifier's)."""
        if self.vocabulary is not None:  # neither PAD nor [MASK] is in it
            return logits.float()
        logits = logits[:, :, : self.mask].float()
        logits[:, :, self.pad] = float("-inf")
        return logits

    def _over_verifier_vocabulary(self, logprobs: Tensor) -> Tensor:
        """[B, k, D] over the draft columns -> [B, k, V] over the verifier's symbols (-inf for
        the symbols outside the vocabulary)."""
        if self.vocabulary is None:
            return logprobs
        return over_all_symbols(logprobs, self.vocabulary, self.mask)

    def propose(self, state, tokens, lengths, plan: DraftPlan, generator) -> DraftTree:
        depth = plan.depth
        logits = self.position_logits(state, tokens, lengths, depth)
        if not plan.sample and plan.beam_width:  # the drafter's most probable sequences
            best_logits, best = logits.topk(plan.beam_width, dim=-1)
            best_logprobs = best_logits - logits.logsumexp(dim=-1, keepdim=True)
            if self.vocabulary is not None:
                best = self.vocabulary[best]
            return beam_tree(best_logprobs, best, plan.beam_width, self.eos)
        if not plan.sample:  # each position's best tokens: no tree to grow
            if plan.is_chain:
                # max's indices, not argmax: the same token, faster over many columns on the CPU
                best = logits.max(dim=-1).indices
            else:
                best = logits.topk(max(plan.branching), dim=-1).indices
            if self.vocabulary is not None:
                best = self.vocabulary[best]
            if plan.is_chain and plan.stop_below:
                confidence = (logits.amax(dim=-1) - logits.logsumexp(dim=-1)).exp()
                valid = before_any_eos(best, self.eos)
                valid &= ~finished_rows(pending_tokens(tokens, lengths), lengths, self.eos)[:, None]
                return stopped_chain(best, confidence, valid, plan.stop_below, self.eos)
            if plan.is_chain:
                return greedy_chain(best, self.eos)
            return greedy_tree(best, plan.branching, self.eos)
        logprobs = self._over_verifier_vocabulary(torch.log_softmax(logits, dim=-1))

        def expand(level_tokens: Tensor, _visible, level_depth: int, _leaf) -> Tensor:
            if depth == 0:  # no drafts at all (position limit): no distribution is needed
                return logprobs.new_zeros(*level_tokens.shape, logprobs.size(2))
            position = logprobs[:, min(level_depth, depth - 1)]
            return position.unsqueeze(1).expand(-1, level_tokens.size(1), -1)

        pending = pending_tokens(tokens, lengths)
        return grow_tree(plan, pending, expand, self.eos, generator, needs_visibility=False,
                         finished=finished_rows(pending, lengths, self.eos))  # fmt: skip

    def commit(self, encoder_out, keep: Optional[Tensor], n_keep: Tensor) -> None:
        """Nothing to keep: the next pass reads the whole verified prefix again."""

    def select_rows(self, encoder_out: Dict, rows: Tensor) -> None:
        encoder_out.update(self.model.encoder.reorder_encoder_out(encoder_out, rows))
