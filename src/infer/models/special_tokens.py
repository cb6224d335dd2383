"""Special-token strings that belong to a model family's definition.

Llama 3 stops on all three end tokens even where files list one eos id, as llama.cpp and Meta's
reference do.
"""

LLAMA3_STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # Llama 3's end-of-sequence tokens
