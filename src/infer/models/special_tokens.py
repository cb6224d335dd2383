"""Special-token strings that belong to a model family's definition.

Llama 3 ends a turn or a sequence with one of three control tokens. Files that list only one
eos id (a base model's generation_config.json, a GGUF's `tokenizer.ggml.eos_token_id`) still
stop on all three, as llama.cpp and Meta's reference do. Both the GGUF config reader and the
tokenizer read this tuple, so it sits here, below both.
"""

LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # Llama 3's end-of-sequence tokens
