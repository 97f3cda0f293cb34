"""spec_nmt: speculative decoding for fairseq translation models, as a ``--user-dir`` plugin."""

import logging

# Importing fairseq logs hints at INFO (e.g. "Please install tensorboardX") that say nothing to a
# user of this plugin; where fairseq is imported first (its own CLIs), this changes nothing.
logging.disable(logging.INFO)
# checkpoint_loading comes first: it lets torch >= 2.6 load fairseq checkpoints.
# The other imports register the task, model and criterion with fairseq.
from spec_nmt import checkpoint_loading, criterions, models, tasks  # noqa: F401,E402
from spec_nmt.errors import install_error_hook  # noqa: E402

logging.disable(logging.NOTSET)

install_error_hook()
