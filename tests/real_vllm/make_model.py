"""Make a tiny random-weight Llama and a locally trained BPE tokenizer for vLLM's CPU build.

No model can be downloaded here, so the integration tier serves this one. Runs inside the
vLLM virtual environment (it needs torch, transformers and tokenizers):

    python tests/real_vllm/make_model.py OUT_DIR

37.8M parameters: hidden 512, 8 layers, 8 heads, vocab 4096, bf16 (the size the issue's
reference figures were measured with). Weights are seeded, so the model is the same each time.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    text = ("the engine batches requests and the gateway admits them below the knee of "
            "the throughput curve while queues and latency grow past it")
    words = text.split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 50


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    # the corpus yields a few hundred merges; fill the vocab so that every id the model can
    # pick decodes to a visible word (an id past the tokenizer's vocab decodes to "")
    tok.add_tokens([f" w{i}" for i in range(tok.get_vocab_size(), VOCAB)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        # random weights favour no token in particular; keep the special ids (unk, bos, eos)
        # out of greedy output so that generated text is visible words, not empty strings
        model.lm_head.weight[:3] = 0
    model.save_pretrained(out)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    make_model(out)
    print(out)


if __name__ == "__main__":
    main()
