"""Serving: the engine, speculative decoding, requests, sampling, stats."""
