"""Glue for training frameworks; each module imports its framework, which gossipmesh does not
depend on (``pip install transformers`` for ``huggingface``)."""
