"""Drafters: the proposal strategies for speculative decoding."""
