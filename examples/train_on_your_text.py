"""Train a small model on your own plain-text files, then sample from it.

    .venv/bin/python examples/train_on_your_text.py 'my_notes/**/*.txt' [hydra overrides ...]
    .venv/bin/python examples/train_on_your_text.py 'my_notes/**/*.txt' +model=void125m trainer.max_steps=2000

Every file is one document. A SentencePiece BPE tokenizer (data.vocab_size pieces) is trained on
the files and cached with the tokenized text (data.cache_dir). Each run writes into a folder of its
own, outputs/your_text/<date_time>-<suffix>/, and samples from its own checkpoint. Sizes finish in minutes:
on a CPU (Triton's interpreter) those of experiment=cpu_smoke, on a GPU 300 steps of 8 x 128 tokens.
The command-line equivalent is

    .venv/bin/python -m tritonllm.train +model=void_tiny data=text data.files='my_notes/**/*.txt'
"""

import logging
import os
import sys
import tempfile
import time

import torch

from tritonllm.generate import generate_text, load_newest_for_generation
from tritonllm.runtime import compose_config, exit_on_user_error, resolve_device, resolve_dtype
from tritonllm.train import train

#: on a CPU every kernel runs in Triton's interpreter: the sizes of conf/experiment/cpu_smoke.yaml
SIZES = {"cpu": ["experiment=cpu_smoke"],
         "cuda": ["trainer.max_steps=300", "trainer.seq_len=128", "trainer.batch_size=8", "data.vocab_size=4096"]}
SAMPLE_TOKENS = 100  # generated after training


@exit_on_user_error
def main(files: str, overrides: list[str]) -> None:
    if not any(o.startswith("+model=") for o in overrides):
        overrides = ["+model=void_tiny", *overrides]
    os.makedirs("outputs/your_text", exist_ok=True)  # a new folder per run: never an earlier run's checkpoints
    out_dir = os.path.abspath(tempfile.mkdtemp(prefix=time.strftime("%Y-%m-%d_%H-%M-%S-"), dir="outputs/your_text"))
    sizes = SIZES["cuda" if torch.cuda.is_available() else "cpu"]
    cfg = compose_config("train", ["data=text", f"data.files={files}", f"out_dir={out_dir}", *sizes, *overrides])
    val_loss = train(cfg)
    print(f"validation loss {val_loss:.3f}; run folder {cfg.out_dir}")

    device = resolve_device(cfg.device)
    _, model, tokenizer = load_newest_for_generation(cfg.out_dir, device, resolve_dtype("auto", device))
    prompt = "The"
    print(prompt + generate_text(model, tokenizer, prompt, max_new_tokens=SAMPLE_TOKENS, temperature=0.8, top_k=50))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    main(sys.argv[1], sys.argv[2:])
