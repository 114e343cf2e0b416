"""Transports: execute a plan's buckets (pack -> move -> unpack)."""
