from spec_nmt.criterions import proposal_heads_loss, spec_drafter_loss  # noqa: F401  (registration)
