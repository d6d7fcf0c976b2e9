"""`pkg build` for encoder functions (embeddings, classifiers): export, quantize under the budget, verify, bundle."""
