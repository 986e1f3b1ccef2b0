"""A byte-level BPE tokenizer trained on the corpus's train split (``tokenizers``), saved in the
Hugging Face format (``PreTrainedTokenizerFast``) with a chat-free plain template.

Special tokens: ``<|endoftext|>`` (end of a file: eos and pad) and ``<|mask|>`` (the block drafters'
mask token). Every byte is in the base alphabet, so any text round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

EOS = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = [EOS, MASK]

# No roles, no markers: a "conversation" is its contents concatenated, so a prompt is raw code and
# the target simply continues it (``train/data.py`` renders prompts through this template).
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train on ``texts`` and return a ``PreTrainedTokenizerFast`` with ``vocab_size`` entries
    (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size}; a byte-level tokenizer needs at least "
            f"{256 + len(SPECIAL_TOKENS)} entries (256 bytes + special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = PLAIN_TEMPLATE
    return fast


def encode_documents(tokenizer, texts: Iterable[str]) -> list[list[int]]:
    """Token ids of each text followed by eos (one document per file)."""
    eos = tokenizer.eos_token_id
    return [ids + [eos] for ids in tokenizer(list(texts), add_special_tokens=False).input_ids]
