"""spec_nmt's registrations with fairseq: importing this module imports fairseq and registers the
task (``spec_translation``), the drafter models and the criteria.

fairseq's commands with ``--user-dir spec_nmt`` import it through the package (fairseq is
imported by then); ``spec_nmt.translator`` and ``spec_nmt.cli_session`` import it first, so the
API and ``spec-nmt-translate`` have it before a checkpoint loads; a script that calls fairseq's
own API imports it first. The package
itself stays light without fairseq, so that ``spec-nmt-translate --help`` and its argument
errors answer without loading torch and fairseq (seconds).
"""

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
    from spec_nmt import (  # noqa: F401
        checkpoint_loading,
        criterions,
        drafters,
        frozen_encoder_task,
        task,
    )
finally:
    logging.disable(_disabled)
