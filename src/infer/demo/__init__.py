"""The project's own small draft/target Llama pair, trained on the Python standard library.

`corpus` picks and splits the training files, `bpe` trains the byte-level BPE tokenizer,
`presets` holds the shapes and settings, `trainer` / `train` train both models,
`evaluate` measures the pair (losses, the paper's alpha, greedy agreement, n-gram
baselines) and writes the model cards. The trained checkpoints ship in
`infer/demo_models/{target,draft}`; `python -m infer.demo` runs the whole pipeline.
"""
