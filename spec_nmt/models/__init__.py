from spec_nmt.models import cached_drafter, spec_drafter  # noqa: F401  (registration)
