"""Incremental detokenization: no broken UTF-8, stop strings never split or emitted."""

from __future__ import annotations

import pytest

from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.tokenizer import Tokenizer
from inference.models.loader import resolve_model_directory

TEXT = "Voilà: naïve café 🚀🔥 日本語 — done. END of story"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model_directory("SmolLM2-135M-Instruct"))


def stream(tokenizer, token_ids, stop):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), stop)
    deltas = []
    for token in token_ids:
        detok.add_token(token)
        deltas.append(detok.take_delta(final=False))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    return deltas, detok


def test_deltas_join_to_the_full_text_without_replacement_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Multi-byte characters span several byte-level tokens here, so some tokens alone are
    # incomplete UTF-8.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas, _ = stream(tokenizer, ids, [])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_truncates_and_is_never_emitted_in_pieces(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, ["END of"])
    assert detok.stopped
    joined = "".join(deltas)
    assert joined == TEXT[: TEXT.index(" END of")] + " "
    # No delta carries the start of the stop string ahead of time.
    assert all("E" not in d for d in deltas)


def test_text_held_back_for_a_possible_stop_is_released_when_it_is_not_one(tokenizer):
    ids = tokenizer.encode("abc ENDING", add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, ["END!"])
    assert not detok.stopped
    assert "".join(deltas) == "abc ENDING"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_is_exactly_the_hugging_face_tokenizers_decode(tokenizer, skip_special_tokens):
    """Tokenizer.decode calls the Rust tokenizer directly (its hot path); what it returns must be
    what transformers' own decode returns, special tokens, broken UTF-8 and spaces included."""
    assert tokenizer._backend is not None  # SmolLM2's tokenizer takes the direct path
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXT + "  spaced , out ."}])
    pieces = [chat, chat[3:9], [chat[-1]], [], *[[t] for t in chat[:40]]]
    for ids in pieces:
        expected = tokenizer.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    """Where transformers may post-process the decoded text, the direct path is not taken."""
    monkeypatch.setattr(tokenizer.hf, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer.hf, "decode", lambda ids, skip_special_tokens: "transformers'")
    assert tokenizer.decode([1, 2, 3]) == "transformers'"
