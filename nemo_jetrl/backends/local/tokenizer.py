"""The local backend's character-level tokenizer, kept in the repo (nothing is downloaded).

The synthetic arithmetic task only needs digits, a few operators and three special tokens, so
every character is one token. The tokenizer is a regular HuggingFace ``tokenizers`` JSON file
(``assets/tokenizer.json``) loaded through ``PreTrainedTokenizerFast``, exactly as a real model's
tokenizer would be; ``build_tokenizer_json`` regenerates that file from ``VOCAB``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_jetrl._optional import require

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_JSON = ASSETS / "tokenizer.json"

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
# Characters the task writes: digits, operators, '=' between an operation and its result,
# ';' after every written step, '#' before the final answer.
CHARS = "0123456789+-*=;#"
VOCAB: tuple[str, ...] = SPECIALS + tuple(CHARS)


def build_tokenizer_json(path: Path = TOKENIZER_JSON) -> Path:
    """Write the character-level tokenizer for ``VOCAB`` to ``path`` (used to create the asset)."""
    tk = require("tokenizers", feature="the local backend's tokenizer")
    from tokenizers import Regex, decoders, models, pre_tokenizers

    tok = tk.Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    # One token per character; the decoder glues characters back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def tokenizer_file(path: str | Path | None) -> Path:
    """The tokenizers JSON file of ``jetrl.local.tokenizer`` (``path``; unset: the repo's)."""
    return Path(path) if path else TOKENIZER_JSON


def load_tokenizer(path: str | Path | None = None) -> Any:
    """``PreTrainedTokenizerFast`` over `tokenizer_file` (``path``) with pad/bos/eos set."""
    transformers = require("transformers", feature="the local backend's tokenizer")
    path = tokenizer_file(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} not found; set jetrl.local.tokenizer to a tokenizers JSON file"
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path), pad_token=PAD, bos_token=BOS, eos_token=EOS
    )
