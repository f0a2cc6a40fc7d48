"""Train the byte-level BPE tokenizer shipped with the synthetic presets.

Run once, offline; the result (mlxb/models/assets/tokenizer.json) is committed.
Never run this per machine: stdlib sources differ between Python builds, so the
merges (and therefore every token id in the goldens) would differ.
"""

import glob
import os
import sys
import sysconfig

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# NOTE: the normalizer and pre-tokenizer are exactly the ones transformers' Qwen3.5 tokenizer class
# rebuilds from vocab + merges. transformers 5 picks that class from config.json's model_type for
# a qwen3_5 folder whatever tokenizer_config.json says; with this pipeline it yields the same ids
# as tokenizer.json loaded directly, so every preset tokenizes identically on every path.
SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def main(out: str, vocab_size: int = 8192) -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.save(out)
    print(f"trained on {len(files)} files from {stdlib} -> {out} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mlxb/models/assets/tokenizer.json")
