"""infer: LLM inference for Llama-family models with lossless speculative decoding."""
