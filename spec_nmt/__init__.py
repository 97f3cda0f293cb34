"""spec_nmt: speculative decoding for fairseq translation models, as a ``--user-dir`` plugin."""

# checkpoint_loading comes first: it lets torch >= 2.6 load fairseq checkpoints.
# The other imports register the task, model and criterion with fairseq.
from spec_nmt import checkpoint_loading, criterions, models, tasks  # noqa: F401
from spec_nmt.errors import install_error_hook

install_error_hook()
