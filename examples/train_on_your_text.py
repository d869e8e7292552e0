"""Train a small model on your own plain-text files, then sample from it.

    python examples/train_on_your_text.py 'my_notes/**/*.txt' [hydra overrides ...]
    python examples/train_on_your_text.py 'my_notes/**/*.txt' +model=void125m trainer.max_steps=2000

Every file is one document. A SentencePiece BPE tokenizer (data.vocab_size pieces) is trained on
the files and cached with the tokenized text (data.cache_dir). The command-line equivalent is

    python -m tritonllm.train +model=void_tiny data=text data.files='my_notes/**/*.txt'
"""

import logging
import sys

from hydra import compose, initialize_config_module

from tritonllm.generate import generate_text, load_for_generation, resolve_checkpoint
from tritonllm.runtime import resolve_device, resolve_dtype
from tritonllm.train import train


def main(files: str, overrides: list[str]) -> None:
    if not any(o.startswith("+model=") for o in overrides):
        overrides = ["+model=void_tiny", *overrides]
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=["data=text", f"data.files={files}", "out_dir=outputs/your_text",
                                          "trainer.max_steps=300", "trainer.seq_len=128", "trainer.batch_size=8",
                                          "data.vocab_size=4096", *overrides])
    val_loss = train(cfg)
    print(f"validation loss {val_loss:.3f}; run folder {cfg.out_dir}")

    device = resolve_device(cfg.device)
    model, tokenizer = load_for_generation(resolve_checkpoint(cfg.out_dir), device, resolve_dtype("auto", device))
    prompt = "The"
    print(prompt + generate_text(model, tokenizer, prompt, max_new_tokens=100, temperature=0.8, top_k=50))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main(sys.argv[1], sys.argv[2:])
