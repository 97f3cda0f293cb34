"""spec_nmt: speculative decoding for fairseq translation models, as a ``--user-dir`` plugin."""

import logging
import warnings

# fairseq's CLIs call Hydra's deprecated APIs (hydra.experimental, strict, "@package _group_")
# on every run, and its loader pins memory without a GPU: about 20 lines of warnings per run
# that no user of fairseq-interactive or -generate can act on.
warnings.filterwarnings("ignore", module=r"hydra\.")
warnings.filterwarnings("ignore", message=r"\s*'config' is validated against ConfigStore schema")
warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator")

# Importing fairseq logs hints at INFO (e.g. "Please install tensorboardX") that say nothing to a
# user of this plugin; where fairseq is imported first (its own CLIs), this changes nothing.
_disabled = logging.root.manager.disable
logging.disable(max(_disabled, logging.INFO))
try:
    # checkpoint_loading comes first: it lets torch >= 2.6 load fairseq checkpoints.
    # The other imports register the task, model and criterion with fairseq.
    from spec_nmt import (  # noqa: F401
        checkpoint_loading,
        criterions,
        drafters,
        frozen_encoder_task,
        task,
    )
    from spec_nmt.errors import install_error_hook
finally:
    logging.disable(_disabled)

install_error_hook()
