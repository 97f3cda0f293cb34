from spec_nmt.tasks import spec_translation  # noqa: F401  (registers the task)
