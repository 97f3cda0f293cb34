# registration of the criteria with fairseq
from spec_nmt.criterions import feature_drafter_loss, spec_drafter_loss  # noqa: F401
