"""A Hugging Face Trainer script: a causal language model from its config, a tokenized dataset
(random token ids here), TrainingArguments from the command line."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


def main():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(sys.argv[1:])
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256)
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 1000, (64,))} for _ in range(32)]
    data = [dict(d, labels=d["input_ids"]) for d in data]
    Trainer(model=model, args=args, train_dataset=data).train()


if __name__ == "__main__":
    main()
