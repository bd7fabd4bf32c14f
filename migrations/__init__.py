"""ulyssesd package."""
