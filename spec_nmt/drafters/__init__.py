# registration of the models with fairseq
from spec_nmt.drafters import cached_drafter, feature_drafter, spec_drafter  # noqa: F401
