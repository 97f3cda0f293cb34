from spec_nmt.models import (  # noqa: F401  (registers the model and its archs)
    spec_drafter,
)
