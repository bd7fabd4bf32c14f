"""The built-in GPT: transformer blocks, rotary embeddings, tiled LM loss, and the Ulysses attention wrapper."""
