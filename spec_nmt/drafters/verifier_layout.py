"""A drafter started from its verifier (``--init-from-verifier``) takes the verifier's layout
options for the parts it copies, so that the copied weights compute what they computed there."""

import logging

from omegaconf import OmegaConf, open_dict

logger = logging.getLogger(__name__)

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
