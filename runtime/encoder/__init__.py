"""The encoder runtime: token ids in, embeddings or label probabilities out, concurrent requests batched by length."""
