"""Task ``translation_frozen_encoder``: fairseq's translation task with the model's encoder frozen.

It fine-tunes a verifier's decoder, on self-distilled targets for instance, without retraining
its cached drafter: that drafter attends to the verifier's encoder output and decodes only with
the encoder it was trained on, which stays exactly as it was. With shared embeddings the
decoder's input and output embeddings are the encoder's, so they stay too. The checkpoints are
stock Transformers: decode them with ``--task translation`` or ``spec_translation``.
"""

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask


@register_task("translation_frozen_encoder", dataclass=TranslationConfig)
class TranslationFrozenEncoderTask(TranslationTask):
    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        # fairseq's optimizer takes only the parameters that require a gradient
        model.encoder.requires_grad_(False)
        return model
