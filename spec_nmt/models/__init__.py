from spec_nmt.models import spec_drafter  # noqa: F401  (registers the model and its archs)
