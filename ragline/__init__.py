"""Shared building blocks of Ragline: settings, blob store, text processing, errors."""
