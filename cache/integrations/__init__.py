"""Engine integrations: the vLLM load format, the transformers helper, FlashInfer tables."""
