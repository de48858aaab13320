"""Tokenizer, chat templates and incremental detokenization, below the engine and free of torch: the router and
the engine both use it."""
