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
from omegaconf import OmegaConf, open_dict

from spec_nmt.errors import SpecNmtError

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


# fairseq options that change what the verifier's tensors compute (or which of them exist)
# without changing the copied weights' shapes, by the part of the model they shape. A drafter
# started from a verifier takes the verifier's values for the parts it copies, so that the copied
# encoder (and a cached drafter's decoder layers) compute what they computed in the verifier.
VERIFIER_LAYOUT = {
    "encoder.": ("encoder_normalize_before", "encoder_learned_pos", "max_source_positions",
                 "encoder_attention_heads"),
    "decoder.": ("decoder_normalize_before", "no_decoder_final_norm", "decoder_learned_pos",
                 "max_target_positions", "decoder_attention_heads"),
    "": ("layernorm_embedding", "no_scale_embedding", "no_token_positional_embeddings",
         "activation_fn"),
}  # fmt: skip


def adopt_verifier_layout(model_cfg, verifier_cfg, path, parts) -> None:
    """Give the drafter configuration ``model_cfg`` the verifier's values of VERIFIER_LAYOUT
    (read from ``verifier_cfg``, the model configuration saved in ``path``) for the parts it
    copies (its model class's ``VERIFIER_PARTS``)."""
    for name in [name for part in ("", *parts) for name in VERIFIER_LAYOUT[part]]:
        value = getattr(verifier_cfg, name, None)
        if value is None or getattr(model_cfg, name, None) == value:
            continue
        logger.info("--init-from-verifier: %s = %s, as in %s", name, value, path)
        set_option(model_cfg, name, value)


def set_option(model_cfg, name: str, value) -> None:
    """Set an option of a model configuration, a hydra config or an argparse namespace."""
    if OmegaConf.is_config(model_cfg):
        with open_dict(model_cfg):
            model_cfg[name] = value
    else:
        setattr(model_cfg, name, value)


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


@register_model_architecture("spec_drafter", "spec_drafter")
def spec_drafter_architecture(args):
    """Defaults of every Spec-Drafter: deep encoder, shallow decoder; the rest as fairseq's
    transformer base. Named variants set their sizes and call this."""
    args.encoder_layers = getattr(args, "encoder_layers", 12)
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    base_architecture(args)


@register_model_architecture("spec_drafter", "spec_drafter_base")
def spec_drafter_base(args):
    """The paper's shape: 12 encoder / 2 decoder layers, d=512, 8 heads, FFN 2048."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 2048)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    spec_drafter_architecture(args)


@register_model_architecture("spec_drafter", "spec_drafter_small")
def spec_drafter_small(args):
    """A drafter that trains on a few CPU cores: 6 encoder / 2 decoder layers, d=256, 4 heads."""
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 256)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 1024)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 4)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 256)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 1024)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 4)
    spec_drafter_architecture(args)
