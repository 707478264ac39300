#!/usr/bin/env python3
"""Runs llama.cpp's own convert_hf_to_gguf.py on a deepinfer checkpoint,
unchanged but for one thing: the name of the BPE pre-tokenizer.

llama.cpp names a tokenizer's pre-tokenizer by hashing the token ids of a
fixed text and looking the hash up in a table of published tokenizers
(`get_vocab_base_pre`); an unknown hash stops the conversion ("BPE
pre-tokenizer was not recognized"). The checkpoints of `deepinfer model init`
carry the built-in 1024-token byte-level BPE, whose hash no published model
has. Its pre-tokenizer is exactly GPT-2's (ByteLevel with the GPT-2 regex,
no normalizer), which llama.cpp calls "gpt-2"; so when, and only when, the
lookup fails and tokenizer.json says just that, this answers "gpt-2".
The weights, the config and every other choice are the converter's own.

`python3 convert_gguf.py LLAMA_CPP_SRC MODEL_DIR [convert_hf_to_gguf.py args...]`
"""

import json
import logging
import runpy
import sys
from pathlib import Path


def plain_gpt2_byte_level(tokenizer_json: Path) -> bool:
    try:
        tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    model = tok.get("model") or {}
    return (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True) is True
        and not pre.get("add_prefix_space", False)
        and tok.get("normalizer") is None
        and model.get("type") == "BPE"
    )


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    src = Path(sys.argv[1]).resolve()
    script = src / "convert_hf_to_gguf.py"
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))

    from conversion.base import TextModel  # llama.cpp's converter package

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not plain_gpt2_byte_level(Path(self.dir_model) / "tokenizer.json"):
                raise
            logging.getLogger("convert_gguf").warning(
                "pre-tokenizer hash unknown to llama.cpp; tokenizer.json is plain GPT-2 byte-level BPE: using 'gpt-2'"
            )
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(script)] + sys.argv[2:]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
