"""The data pipeline: tokenizer, preprocessing CLI, indexed dataset, blends, sample order, cursor, prefetch."""
