"""One module per DVC stage: ``python -m tasks.<stage> [--params params.yaml]``."""
