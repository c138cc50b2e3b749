"""Tokenizers of three families, the byte-level encoder, language sampling, the stage."""
