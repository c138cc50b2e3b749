"""`PretrainedFiles`: the config of a tokenizer brought as files instead of trained.

Only which files there are and that they go together; reading them with a family's conventions
is `load_tokenizer_files` in `tasks/tokenizer/tokenizer.py`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PretrainedFiles(BaseModel):
    """Bring your own tokenizer instead of training one (local files only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tokenizer_json: str | None = Field(None, description="A `tokenizers` tokenizer.json.")
    vocab_txt: str | None = Field(None, description="A BERT WordPiece vocab.txt.")
    vocab_json: str | None = Field(None, description="GPT-2 vocab.json / encoder.json.")
    merges: str | None = Field(None, description="GPT-2 merges.txt / vocab.bpe.")
    spm_model: str | None = Field(
        None, description="A SentencePiece Unigram model (T5's spiece.model), converted."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> PretrainedFiles:
        kinds = [
            self.tokenizer_json is not None,
            self.vocab_txt is not None,
            self.spm_model is not None,
            self.vocab_json is not None or self.merges is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError(
                "give exactly one of tokenizer_json, vocab_txt, spm_model, or vocab_json+merges"
            )
        if (self.vocab_json is None) != (self.merges is None):
            raise ValueError("vocab_json and merges go together")
        return self
