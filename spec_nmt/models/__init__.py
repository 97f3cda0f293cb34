from spec_nmt.models import spec_drafter  # noqa: F401  (registration)
