"""Corpus encoding: documents to token ids per sentence, and the encode stage."""
