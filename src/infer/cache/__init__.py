"""KV cache pools: contiguous slots, paged blocks with a prefix tree, and the views the
model's attention reads and writes through."""
