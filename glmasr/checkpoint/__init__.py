"""A checkpoint on disk: its weights (``weights``: folder or hub id -> checked tensors; the on-disk layouts),
its tokenizer and prompts (``tokenizer``), random-weight checkpoints for tests and timing (``random_weights``) and
where the package's data and caches are (``resources``). The model's config is ``glmasr.models.config``."""
