from spec_nmt.criterions import spec_drafter_loss  # noqa: F401  (registration)
