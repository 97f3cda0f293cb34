"""spec_nmt: speculative decoding for fairseq translation models, as a ``--user-dir`` plugin."""
from spec_nmt import checkpoint_loading  # noqa: F401  (before anything loads a checkpoint)
from spec_nmt import criterions, models, tasks  # noqa: F401  (registration)
