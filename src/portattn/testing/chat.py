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
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(path)
    return str(path)
