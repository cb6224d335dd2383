"""The serving engine: config, requests, scheduler, runners (plain and speculative), CUDA graphs, async loop."""
