from spec_nmt.models import cached_drafter, heads_drafter, spec_drafter  # noqa: F401  (registration)
