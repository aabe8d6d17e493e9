"""A tiny chat checkpoint built offline: a byte-level BPE tokenizer trained with ``tokenizers`` on a
built-in text, a chat template that writes its own BOS, and a random two-layer Llama.

The tokenizer adds a BOS to plain text (as Llama 3's does), so a chat prompt tokenized with special
tokens added would start with two; the serving tests and the CPU serving benchmark use it.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TEXT = """
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A paged cache keeps the keys and values of every token in pages of a fixed size.
Attention reads the pages of a sequence through its page table, one page at a time.
When the pool runs out of pages, the newest request waits and computes its prompt again later.
Servers stream tokens to their clients as soon as each step of the engine has produced them.
Rivers run to the sea, mountains rise over the plains, and the wind carries the rain inland.
Numbers such as 1, 2, 3, 10, 42 and 1000 appear in text, as do names like Alice and Bob.
She said: "Hello, world!" and he answered: 'Good morning; how are you today?'
Every morning the baker opens the shop at seven and sells bread, cakes and coffee.
The library holds old books, new maps, and letters written by hand long ago.
At the café a naïve tourist paid 5€ for a crème brûlée.
"""


def save_tiny_chat_checkpoint(
    path: str | Path, *, vocab_size: int = 384, seed: int = 0, chat_template: bool = True, num_layers: int = 2
) -> str:
    """Write the checkpoint (config, weights, tokenizer, generation config) to ``path``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from .checkpoints import save_quietly

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The bytes of printable ASCII and of the text (a few multi-byte characters among them), not all
    # 256: random weights then produce readable text more often than stray bytes.
    printable = "".join(map(chr, range(32, 127))) + "\n"
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(printable + _TEXT)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=sorted({ch for piece, _ in pieces for ch in piece}),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _TEXT.splitlines() if line], trainer)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    save_quietly(LlamaForCausalLM(config), path)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(path)
    return str(path)


# The tiny Qwen2.5-VL checkpoint's special tokens (portattn.testing.checkpoints) and a Qwen-style
# template that writes one image placeholder per image part.
VISION_SPECIAL_TOKENS = {
    "<s>": 0,
    "</s>": 1,
    "<unk>": 2,
    "<|vision_start|>": 248,
    "<|vision_end|>": 249,
    "<|image_pad|>": 250,
    "<|video_pad|>": 251,
    "<|im_start|>": 252,
    "<|im_end|>": 253,
}
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
    "{% endif %}"
)


def save_tiny_vision_chat_checkpoint(path: str | Path) -> str:
    """The tiny Qwen2.5-VL checkpoint with what chat with images needs: a word-level tokenizer (the
    words of the built-in text; the special tokens at the checkpoint's ids), a chat template that
    writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image part, and an image processor
    (4x4-pixel patches, 2x2 merge, 256 to 4096 pixels). Returns ``str(path)``."""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor

    from .checkpoints import save_tiny_checkpoint

    path = Path(save_tiny_checkpoint("qwen2_5_vl", path))
    words = sorted(set(re.findall(r"\w+|[^\w\s]", _TEXT + " user assistant system")))
    free = [i for i in range(256) if i not in VISION_SPECIAL_TOKENS.values()]
    vocab = {**dict(zip(words, free)), **VISION_SPECIAL_TOKENS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=[t for t in VISION_SPECIAL_TOKENS if t.startswith("<|")],
    )
    fast.chat_template = VISION_CHAT_TEMPLATE
    fast.save_pretrained(path)
    processor = Qwen2VLImageProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=4096
    )
    processor.save_pretrained(path)
    return str(path)
