"""Sampling engines (native, hf, vllm): how phase 1 draws the responses."""
