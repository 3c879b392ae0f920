"""Prompts: reading them (files, built-in sets, Hugging Face datasets), tokenizing them, the order they are drawn in."""
