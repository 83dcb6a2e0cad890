"""Speculative decoding: draft trees, drafters, verification."""
