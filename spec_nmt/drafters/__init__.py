from spec_nmt.drafters import cached_drafter, proposal_heads, spec_drafter  # noqa: F401  (registration)
