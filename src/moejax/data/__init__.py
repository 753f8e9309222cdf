"""Data: tokenizers, token shards, the embedded corpus and the Grain input pipeline."""
